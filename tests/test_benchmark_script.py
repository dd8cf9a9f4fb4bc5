"""scripts/benchmarks/layers.py --quick: the CSV has every variant, mode and length, with positive times and memory,
and its ratio columns and summary agree with its own raw timings (recomputed here from different rows)."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["primal-all", "primal-last", "sdpa", "eager"]


def _read(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_quick_benchmark_writes_complete_csv_summary_and_plot(tmp_path):
    # The eager limit is set so that eager runs at N=64 but is skipped at N=128, exercising both paths.
    result = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.layers", "--quick", "--out-dir", str(tmp_path),
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
                    assert int(row["reps"]) >= 1
                    if mode == "train":
                        assert float(row["peak_mib"]) > 0
    for part in ("attention", "middle", "layer"):
        for section in ("bert-base", "lra"):
            variants = ["primal-all", "sdpa", "eager"] if part == "attention" else ["primal-all"]
            for variant in variants:
                assert float(by_key[(f"{part}:{section}", variant, 128, "train")]["time_ms"]) > 0

    summary = {r["name"]: r for r in _read(tmp_path / "benchmark_summary.csv")}
    check_ratios_and_summary(rows, summary, n_ref=128, fit_ns=(64, 128), sublayer_n=128)
    for variant in ("primal-all", "primal-last", "sdpa"):
        assert f"exponent lra {variant} train (N 64-128)" in summary
    assert "exponent lra eager train (N 64-128)" not in summary  # one point only: no fit
    share = summary["bert-base primal middle share of attention sub-layer fwd+bwd (N=128)"]
    # Its value is checked against the raw rows above (middle / sub-layer medians); no bound on it here: those are two
    # separately timed steps, and under load the middle alone took longer than the sub-layer (1.96 in one CI run).
    assert float(share["value"]) > 0 and share["target"] == "<= 0.2"
    assert share["met"] == str(float(share["value"]) <= 0.2)
    assert "lra primal-all train speedup vs sdpa (N=128)" in summary
    assert any(name.startswith("environment: torch") for name in summary)

    png = (tmp_path / "benchmark.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def _close(value, expected):
    return math.isclose(float(value), expected, rel_tol=1e-9)


def check_ratios_and_summary(rows, summary, n_ref, fit_ns, sublayer_n):
    """Recompute, from the CSV's own raw median timings of *different* rows, every ratio column and the summary's
    exponents, speedups, shares and verdicts. Also holds for a full run (scripts/benchmarks/results/benchmark.csv)."""
    ok = [r for r in rows if r["status"] == "ok"]
    time = {(r["section"], r["variant"], int(r["n"]), r["mode"]): float(r["time_ms"]) for r in ok}
    checked = 0
    for row in ok:
        for base in ("eager", "sdpa"):
            ref = next((r for r in ok if (r["section"], int(r["n"]), r["mode"], r["variant"])
                        == (row["section"], int(row["n"]), row["mode"], base)), None)
            if ref is None:
                assert row[f"speedup_vs_{base}"] == "", row  # e.g. eager skipped at this length: no ratio
                continue
            assert _close(row[f"speedup_vs_{base}"], float(ref["time_ms"]) / float(row["time_ms"])), (row, base)
            if row["peak_mib"] and ref["peak_mib"]:
                assert _close(row[f"mem_ratio_vs_{base}"], float(ref["peak_mib"]) / float(row["peak_mib"])), row
            checked += row["variant"] != base
    assert checked >= 8, checked  # ratios between different variants were really compared
    for section in ("lra", "bert-base"):
        for mode in ("train", "infer"):
            for variant in ("primal-all", "primal-last", "sdpa"):
                points = [(n, time[(section, variant, n, mode)]) for n in fit_ns if (section, variant, n, mode) in time]
                assert len(points) >= 2, (section, variant, mode)
                item = summary[f"exponent {section} {variant} {mode} (N {points[0][0]}-{points[-1][0]})"]
                slope = np.polyfit([math.log(n) for n, _ in points], [math.log(t) for _, t in points], 1)[0]
                assert math.isclose(float(item["value"]), slope, rel_tol=1e-7), (item, slope)
    for base in ("eager", "sdpa"):
        name = f"lra primal-all train speedup vs {base} (N={n_ref})"
        if (("lra", base, n_ref, "train")) in time:
            expected = time[("lra", base, n_ref, "train")] / time[("lra", "primal-all", n_ref, "train")]
            assert _close(summary[name]["value"], expected), summary[name]
        else:
            assert name not in summary
    n = sublayer_n
    for section in ("bert-base", "lra"):
        att = time[(f"attention:{section}", "primal-all", n, "train")]
        for base in ("sdpa", "eager"):
            item = summary[f"{section} attention sub-layer train speedup vs {base} (N={n})"]
            assert _close(item["value"], time[(f"attention:{section}", base, n, "train")] / att), item
        middle = time[(f"middle:{section}", "primal-all", n, "train")]
        share = summary[f"{section} primal middle share of attention sub-layer fwd+bwd (N={n})"]
        assert _close(share["value"], middle / att), share
        layer_share = summary[f"{section} primal middle share of transformer layer fwd+bwd (N={n})"]
        assert _close(layer_share["value"], middle / time[(f"layer:{section}", "primal-all", n, "train")]), layer_share
    for item in summary.values():  # every verdict follows from its value and target
        if item["target"]:
            op, bound = item["target"].split()
            met = float(item["value"]) <= float(bound) if op == "<=" else float(item["value"]) >= float(bound)
            assert item["met"] == str(met), item
