"""Scale-out through accelerate.

2 CPU processes (gloo DDP, FSDP2) train exactly like 1 process with the same global batch.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "helpers" / "ddp_train.py"


def _run(cmd, cwd, **extra_env):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1]), **extra_env}
    subprocess.run(cmd, check=True, cwd=cwd, env=env, timeout=600, stdout=subprocess.DEVNULL)


FSDP2_FLAGS = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
               "--fsdp_transformer_layer_cls_to_wrap", "BertLayer", "--fsdp_reshard_after_forward", "true",
               "--fsdp_state_dict_type", "FULL_STATE_DICT"]


def _launch(out, per_device_batch, eta, find_unused="default", flags=("--multi_gpu",), **extra_env):
    # --multi_gpu selects accelerate's torchrun launcher; without CUDA the processes use gloo on the CPU.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--num_cpu_threads_per_process", "1", "--main_process_port", "29517",
           str(SCRIPT), str(out), str(per_device_batch), str(eta), find_unused]
    # A gloo rank intermittently aborts at teardown on CPU ("terminate called without an active exception", about
    # 1 launch in 4 on the 2-core CI machine) after training finished; relaunch rather than fail on it. The
    # assertions below still compare the run that completed with the single-process run.
    for attempt in range(3):
        try:
            _run(cmd, cwd=out, **extra_env)
            break
        except subprocess.CalledProcessError:
            if attempt == 2:
                raise
    return json.loads((out / "result.json").read_text())


def _single(tmp_path, eta, find_unused="default"):
    single = tmp_path / "one"
    single.mkdir()
    _run([sys.executable, str(SCRIPT), str(single), "8", str(eta), find_unused], cwd=single)
    return json.loads((single / "result.json").read_text())


@pytest.mark.parametrize("eta,find_unused", [(0.1, "default"), (0.0, "true")])
def test_two_processes_match_one(tmp_path, eta, find_unused):
    double = tmp_path / "two"
    double.mkdir()
    one = _single(tmp_path, eta, find_unused)
    two = _launch(double, 4, eta, find_unused)
    assert two["distributed_type"] == "DistributedType.MULTI_CPU" and not two["sharded"]
    assert one["world"] == 1 and two["world"] == 2
    assert abs(one["final_loss"] - two["final_loss"]) <= 1e-4
    assert abs(one["final_ksvd"] - two["final_ksvd"]) <= 1e-4
    assert len(two["logs"]) == 6 and all("ksvd_loss" in h for h in two["logs"])


def test_fsdp2_two_processes_match_one(tmp_path):
    """`accelerate launch --use_fsdp --fsdp_version 2`: parameters sharded as DTensors over 2 gloo processes.

    accelerate 1.x turns FSDP on only for accelerator devices (on CPU it silently runs DDP: see the next test), so
    the helper lifts that single check (HF_PRIMAL_TEST_CPU_FSDP=1); wrapping, sharding and the training loop are
    accelerate's and transformers' own. On GPUs the same command runs without it (README, "Scaling out").
    """
    fsdp = tmp_path / "fsdp"
    fsdp.mkdir()
    one = _single(tmp_path, 0.1)
    two = _launch(fsdp, 4, 0.1, flags=FSDP2_FLAGS, HF_PRIMAL_TEST_CPU_FSDP="1")
    assert two["world"] == 2 and two["distributed_type"] == "DistributedType.FSDP" and two["fsdp_version"] == 2
    assert two["sharded"]  # the model the Trainer trained is fully_shard-wrapped
    assert abs(one["final_loss"] - two["final_loss"]) <= 1e-4
    assert abs(one["final_ksvd"] - two["final_ksvd"]) <= 1e-4
    assert len(two["logs"]) == 6 and all("ksvd_loss" in h for h in two["logs"])
    for a, b in zip(one["logs"], two["logs"]):
        assert abs(a["ksvd_loss"] - b["ksvd_loss"]) <= 1e-4 * max(1.0, abs(a["ksvd_loss"]))


def test_accelerate_runs_ddp_when_fsdp_is_asked_on_cpu(tmp_path):
    # Why the FSDP test needs its shim: if a later accelerate enables FSDP on CPU, this fails and the shim can go.
    out = tmp_path / "asked"
    out.mkdir()
    two = _launch(out, 4, 0.1, flags=FSDP2_FLAGS)
    assert two["distributed_type"] == "DistributedType.MULTI_CPU" and not two["sharded"]
