"""scripts/run_gpu_benchmarks.sh end to end on CPU with tiny settings: every step runs and writes its tables."""

import csv
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_gpu_script_runs_end_to_end_on_cpu(tmp_path):
    import sys

    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "run_gpu_benchmarks.sh")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for step in ("long_documents", "layers", "peers", "generation"):
        assert f"== {step} done in" in result.stdout, step
    tables = {
        "long_documents": tmp_path / "long_documents" / "long_documents.csv",
        "long_documents timing": tmp_path / "long_documents" / "long_documents_timing.csv",
        "layers": tmp_path / "layers" / "benchmark.csv",
        "peers": tmp_path / "peers" / "peers_benchmark.csv",
        "generation": tmp_path / "generation" / "generation_benchmark.csv",
    }
    for name, path in tables.items():
        rows = [r for r in _rows(path) if r.get("device")]
        assert rows, name
        # The device and precision the script was told, on every row it measured.
        assert {(r["device"], r["dtype"]) for r in rows} == {("cpu", "fp32")}, name
