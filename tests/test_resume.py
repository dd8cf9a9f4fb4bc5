"""Exact resume: a PrimalTrainer run SIGKILLed right after a checkpoint and resumed from it ends with the parameters
and logged losses of the uninterrupted run, bit for bit on CPU, in every mode (no teacher, teacher on logits or on
hidden states with an unlabeled distill_dataset, gradient accumulation, several epochs)."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import child_env

CHILD = Path(__file__).resolve().parent / "helpers" / "resume_child.py"


def _run(mode, phase, out):
    return subprocess.run([sys.executable, str(CHILD), mode, phase, str(out)], env=child_env(), capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("mode", ["plain", "logits", "hidden", "accumulation", "epochs"])
def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(tmp_path, mode):
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = _run(mode, "full", full)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = _run(mode, "killed", cut)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    assert sorted(p.name for p in cut.iterdir()) == ["checkpoint-3"]  # it died right after the first checkpoint
    resumed = _run(mode, "resume", cut)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = torch.load(full / "final.pt"), torch.load(cut / "final.pt")
    assert expected["params"].keys() == got["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(value, got["params"][name]), (name, (value - got["params"][name]).abs().max())
    # The losses logged after the checkpoint, distillation and KSVD terms included, are the uninterrupted run's.
    after = [entry for entry in expected["losses"] if entry[0] > 3]
    assert after and [entry for entry in got["losses"] if entry[0] > 3] == after
