"""Scale-out through accelerate: 2 CPU processes (gloo DDP) train exactly like 1 process with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "helpers" / "ddp_train.py"


def _run(cmd, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    subprocess.run(cmd, check=True, cwd=cwd, env=env, timeout=600, stdout=subprocess.DEVNULL)


def _launch(out, per_device_batch, eta, find_unused="default"):
    # --multi_gpu selects accelerate's torchrun launcher; without CUDA the processes use gloo on the CPU.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--num_cpu_threads_per_process", "1", "--main_process_port", "29517",
           str(SCRIPT), str(out), str(per_device_batch), str(eta), find_unused]
    # A gloo rank intermittently aborts at teardown on CPU ("terminate called without an active exception", about
    # 1 launch in 4 on the 2-core CI machine) after training finished; relaunch rather than fail on it. The
    # assertions below still compare the run that completed with the single-process run.
    for attempt in range(3):
        try:
            _run(cmd, cwd=out)
            break
        except subprocess.CalledProcessError:
            if attempt == 2:
                raise
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("eta,find_unused", [(0.1, "default"), (0.0, "true")])
def test_two_processes_match_one(tmp_path, eta, find_unused):
    single, double = tmp_path / "one", tmp_path / "two"
    single.mkdir()
    double.mkdir()
    _run([sys.executable, str(SCRIPT), str(single), "8", str(eta), find_unused], cwd=single)
    one = json.loads((single / "result.json").read_text())
    two = _launch(double, 4, eta, find_unused)
    assert one["world"] == 1 and two["world"] == 2
    assert abs(one["final_loss"] - two["final_loss"]) <= 1e-4
    assert abs(one["final_ksvd"] - two["final_ksvd"]) <= 1e-4
    assert len(two["logs"]) == 6 and all("ksvd_loss" in h for h in two["logs"])
