"""scripts/run_gpu_benchmarks.sh end to end on CPU with tiny settings: every step runs, writes its tables with every
variant it promises, and each ratio column equals the quotient of the two measurements it names (recomputed here
from the raw columns, so a swapped column, a ratio taken the wrong way round or a dropped variant fails). The same
relations are checked on the committed results the docs quote."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "scripts" / "results"


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


# (table, the columns that make one comparison group, the baseline variant, [(ratio column, measured column,
#  True when the ratio is baseline / row, False when row / baseline)])
RELATIONS = {
    "long_documents_timing.csv": (("n",), "sdpa", [
        ("speedup_vs_sdpa", "step_ms", True), ("memory_ratio_vs_sdpa", "peak_mib", True),
        ("attention_memory_ratio_vs_sdpa", "attention_peak_mib", True)]),
    "benchmark.csv": (("section", "n", "batch", "mode"), "sdpa", [("speedup_vs_sdpa", "time_ms", True),
                                                                  ("mem_ratio_vs_sdpa", "peak_mib", True)]),
    "peers_benchmark.csv": (("width", "n", "mode"), "sdpa", [("speedup_vs_sdpa", "time_ms", True)]),
    "generation_benchmark.csv": (("context",), "stock-sdpa", [
        ("latency_ms_vs_stock", "latency_ms", False), ("cache_bytes_vs_stock", "cache_bytes", False),
        ("decode_peak_rss_mb_vs_stock", "decode_peak_rss_mb", False)]),
}


def check_relations(name: str, rows: list[dict]) -> int:
    """Assert every ratio of `rows` (a table named `name`) against its raw columns; returns how many were checked."""
    group_by, base_variant, relations = RELATIONS[name]
    rows = [r for r in rows if r.get("status", "ok") == "ok"]
    base = {tuple(r[k] for k in group_by): r for r in rows if r["variant"] == base_variant}
    checked = 0
    for row in rows:
        reference = base.get(tuple(row[k] for k in group_by))
        for ratio, measured, baseline_over_row in relations:
            if reference is None or not row.get(ratio) or not row.get(measured) or not reference.get(measured):
                continue
            mine, theirs = float(row[measured]), float(reference[measured])
            assert math.isfinite(mine) and mine >= 0, (name, row["variant"], measured, mine)
            expected = theirs / mine if baseline_over_row else mine / theirs
            # Ratios are written to 3 decimals in some tables.
            assert float(row[ratio]) == pytest.approx(expected, rel=2e-3, abs=6e-4), (name, row["variant"], ratio)
            checked += 1
    return checked


def test_long_document_attention_memory_is_the_peak_above_the_no_attention_network():
    rows = [r for r in _rows(RESULTS / "long_documents_timing.csv") if r["status"] == "ok"]
    floor = {r["n"]: float(r["peak_mib"]) for r in rows if r["variant"] == "no-attention"}
    for row in rows:
        if row["attention_peak_mib"]:
            assert float(row["attention_peak_mib"]) == pytest.approx(float(row["peak_mib"]) - floor[row["n"]],
                                                                     abs=0.15), row["variant"]


@pytest.mark.parametrize("name", sorted(RELATIONS))
def test_committed_results_hold_their_ratios(name):
    assert check_relations(name, _rows(RESULTS / name)) >= 4


def test_a_swapped_ratio_is_caught():
    rows = _rows(RESULTS / "long_documents_timing.csv")
    primal = next(r for r in rows if r["variant"] == "primal")
    speed, memory = primal["speedup_vs_sdpa"], primal["memory_ratio_vs_sdpa"]
    primal["speedup_vs_sdpa"], primal["memory_ratio_vs_sdpa"] = memory, speed
    with pytest.raises(AssertionError):
        check_relations("long_documents_timing.csv", rows)


def test_gpu_script_runs_end_to_end_on_cpu(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "run_gpu_benchmarks.sh")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for step in ("long_documents", "layers", "peers", "generation"):
        assert f"== {step} done in" in result.stdout, step
    tables = {
        "long_documents_timing.csv": (tmp_path / "long_documents",
                                      {"sdpa", "eager", "primal", "primal-last", "no-attention", "performer",
                                       "nystrom", "linformer"}),
        "benchmark.csv": (tmp_path / "layers", {"sdpa", "eager", "primal-all", "primal-last"}),
        "peers_benchmark.csv": (tmp_path / "peers", {"sdpa", "primal", "performer", "nystrom", "linformer"}),
        "generation_benchmark.csv": (tmp_path / "generation", {"stock-sdpa", "all-primal", "last-layer-primal"}),
    }
    for name, (folder, variants) in tables.items():
        rows = _rows(folder / name)
        measured = [r for r in rows if r.get("status", "ok") == "ok"]
        assert variants <= {r["variant"] for r in measured}, (name, variants - {r["variant"] for r in measured})
        assert check_relations(name, rows) >= 3, name
        # The device and precision the script was told, on every row that records them.
        assert {(r["device"], r["dtype"]) for r in rows if r.get("device")} <= {("cpu", "fp32")}, name
    trained = _rows(tmp_path / "long_documents" / "long_documents.csv")
    assert {r["variant"] for r in trained if r["status"] == "ok"} >= {"sdpa", "primal", "primal-last", "no-attention"}
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in trained if r["status"] == "ok")
