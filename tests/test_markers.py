"""The suite's own machinery in tests/conftest.py: the `slow` marker table names tests that exist (a renamed test
would silently join the quick subset), and child processes compute with this process's thread count."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SESSION_THREADS, SLOW, child_env

TESTS = Path(__file__).parent


@pytest.mark.parametrize("entry", sorted(SLOW))
def test_slow_table_names_an_existing_test(entry):
    file, _, test = entry.partition("::")
    path = TESTS / file
    assert path.is_file(), entry
    if test:
        assert re.search(rf"^def {re.escape(test)}\(", path.read_text(encoding="utf-8"), re.MULTILINE), entry


def test_a_child_process_computes_with_this_process_thread_count():
    # Bit-for-bit comparisons between this process and a child (saved folders, remote code) hold only when both split
    # their kernels over the same number of threads, whatever an earlier test set.
    torch.set_num_threads(1)  # the autouse fixture restores the count afterwards
    code = "import torch; print(torch.get_num_threads())"
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.strip()) == 1
    assert child_env()["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in child_env()


def test_the_thread_count_is_back_after_a_test_that_changed_it():
    if os.environ.get("HF_PRIMAL_INNER_RUN"):  # the inner run below, right after the test that set 1 thread
        assert torch.get_num_threads() == SESSION_THREADS == 2
        return
    # Run alone this test would prove nothing, so it runs the pair in a fresh pytest with 2 threads: the test that
    # sets 1 thread, then this one, which must find 2 again.
    pair = [f"{Path(__file__).name}::{name}" for name in (
        "test_a_child_process_computes_with_this_process_thread_count",
        "test_the_thread_count_is_back_after_a_test_that_changed_it")]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pair],
                            cwd=TESTS, env=child_env(OMP_NUM_THREADS="2", HF_PRIMAL_INNER_RUN="1",
                                                     PYTHONPATH=str(TESTS.parent)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
