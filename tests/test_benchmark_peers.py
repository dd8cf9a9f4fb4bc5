"""scripts/benchmarks/peers.py --quick: every variant (hf_primal, SDPA, eager, Performer, Nystromformer, Linformer) at
every width, length and mode, with positive times and memory; the ratio columns and summary agree with the raw
timings (recomputed here); the short-input section has BERT-base-width and MiniLM rows."""

import csv
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["primal", "sdpa", "eager", "performer", "nystrom", "linformer"]


def _read(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_quick_peer_benchmark_writes_complete_results(tmp_path):
    result = subprocess.run([sys.executable, "-m", "scripts.benchmarks.peers", "--quick", "--out-dir",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _read(tmp_path / "peers_benchmark.csv")
    by_key = {(r["width"], r["variant"], int(r["n"]), r["mode"]): r for r in rows}
    assert len(by_key) == len(rows) == 2 * len(VARIANTS) * 2 * 2
    for width in ("C=16", "C=32"):
        for n in (64, 128):
            for mode in ("train", "infer"):
                peers = {}
                for variant in VARIANTS:
                    row = by_key[(width, variant, n, mode)]
                    assert row["status"] == "ok"
                    assert float(row["time_ms"]) > 0 and float(row["time_ms_min"]) > 0 and int(row["reps"]) >= 1
                    if mode == "train":
                        assert float(row["autograd_mib"]) > 0 and float(row["peak_mib"]) > 0
                    if variant in ("performer", "nystrom", "linformer"):
                        peers[variant] = float(row["time_ms"])
                        assert row["settings"]
                fastest = min(peers, key=peers.get)
                for variant in VARIANTS:
                    row = by_key[(width, variant, n, mode)]
                    sdpa = float(by_key[(width, "sdpa", n, mode)]["time_ms"])
                    assert math.isclose(float(row["speedup_vs_sdpa"]), sdpa / float(row["time_ms"]), rel_tol=1e-9)
                    assert row["fastest_peer"] == fastest
                    assert math.isclose(float(row["speedup_vs_fastest_peer"]), peers[fastest] / float(row["time_ms"]),
                                        rel_tol=1e-9)
    summary = {r["name"]: r for r in _read(tmp_path / "peers_summary.csv")}
    for width in ("C=16", "C=32"):
        primal = by_key[(width, "primal", 128, "train")]
        for peer in ("performer", "nystrom", "linformer"):
            item = summary[f"{width} autograd memory {peer} / primal (N=128)"]
            expected = float(by_key[(width, peer, 128, "train")]["autograd_mib"]) / float(primal["autograd_mib"])
            assert math.isclose(float(item["value"]), expected, rel_tol=1e-9)
            assert item["met"] == str(expected > 1)
    assert any(name.startswith("environment: torch") for name in summary)
    png = (tmp_path / "peers_benchmark.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    short = _read(tmp_path / "short_inputs.csv")
    timed = [r for r in short if r["time_ms"]]
    kinds = {(r["variant"], r["n"], r["mode"]) for r in timed if r["model"].startswith("bert-base-width")}
    assert kinds == {(v, n, m) for v in ("primal-all", "primal-last", "sdpa") for n in ("16", "32")
                     for m in ("train", "infer")}
    minilm = {r["variant"]: r for r in timed if r["model"].startswith("all-MiniLM-L6-v2")}
    assert set(minilm) == {"stock", "primal-last"}
    for row in minilm.values():
        sentences = int(row["model"].split("(")[1].split()[0])
        assert math.isclose(float(row["sentences_per_s"]), sentences / (float(row["time_ms"]) / 1e3), rel_tol=1e-9)
