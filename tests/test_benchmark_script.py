"""scripts/benchmark.py --quick: the CSV has every variant, mode and length, with positive times and memory."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["primal-all", "primal-last", "sdpa", "eager"]


def _read(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_quick_benchmark_writes_complete_csv_summary_and_plot(tmp_path):
    # The eager limit is set so that eager runs at N=64 but is skipped at N=128, exercising both paths.
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--quick", "--out-dir", str(tmp_path),
         "--eager-limit-gib", "0.001"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Summary" in result.stdout

    rows = _read(tmp_path / "benchmark.csv")
    by_key = {(r["section"], r["variant"], int(r["n"]), r["mode"]): r for r in rows}
    for section in ("lra", "bert-base"):
        for n in (64, 128):
            for mode in ("train", "infer"):
                for variant in VARIANTS:
                    row = by_key[(section, variant, n, mode)]
                    if variant == "eager" and n == 128:
                        assert row["status"].startswith("skipped") and row["time_ms"] == ""
                        continue
                    assert row["status"] == "ok"
                    assert float(row["time_ms"]) > 0 and float(row["time_ms_min"]) > 0
                    assert 0 < float(row["time_ms_min"]) <= float(row["time_ms"])
                    assert int(row["reps"]) >= 1
                    if mode == "train":
                        assert float(row["peak_mib"]) > 0
                    if variant == "sdpa":
                        assert float(row["speedup_vs_sdpa"]) == 1.0
    for part in ("attention", "middle", "layer"):
        for section in ("bert-base", "lra"):
            variants = ["primal-all", "sdpa", "eager"] if part == "attention" else ["primal-all"]
            for variant in variants:
                assert float(by_key[(f"{part}:{section}", variant, 128, "train")]["time_ms"]) > 0

    summary = {r["name"]: r for r in _read(tmp_path / "benchmark_summary.csv")}
    for variant in ("primal-all", "primal-last", "sdpa"):
        assert f"exponent lra {variant} train (N 64-128)" in summary
    assert "exponent lra eager train (N 64-128)" not in summary  # one point only: no fit
    share = summary["bert-base primal middle share of attention sub-layer fwd+bwd (N=128)"]
    assert 0 < float(share["value"]) < 1 and share["target"] == "<= 0.2" and share["met"] in ("True", "False")
    assert "lra primal-all train speedup vs sdpa (N=128)" in summary
    assert any(name.startswith("environment: torch") for name in summary)

    png = (tmp_path / "benchmark.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
