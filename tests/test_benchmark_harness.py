"""scripts/benchmarks/harness.py against known answers: a fake clock and steps of known cost for the round-robin
timer, an allocation of known size for the memory probe, child processes and worker pools that must return exactly
what the jobs compute, and CSV tables that round-trip."""

import os

import pytest
import torch

from scripts.benchmarks import harness


class FakeClock:
    """A clock that only moves when a step says how long it took."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def step(self, name: str, seconds: float):
        def run() -> None:
            self.calls.append(name)
            self.now += seconds

        return run


def test_round_robin_reports_the_known_costs_and_interleaves_the_steps():
    clock = FakeClock()
    steps = {"fast": clock.step("fast", 0.002), "slow": clock.step("slow", 0.005)}
    times = harness.time_round_robin(steps, repeats=4, budget_s=1e9, clock=clock)
    assert times == {"fast": pytest.approx((2.0, 2.0, 4)), "slow": pytest.approx((5.0, 5.0, 4))}
    assert clock.calls[:2] == ["fast", "slow"]  # one warm-up each, untimed
    passes = [sorted(clock.calls[2 + 2 * i: 4 + 2 * i]) for i in range(4)]
    assert passes == [["fast", "slow"]] * 4  # every timed pass runs each step once


def test_round_robin_gives_slow_steps_fewer_repeats_within_the_budget():
    clock = FakeClock()
    steps = {"fast": clock.step("fast", 0.001), "slow": clock.step("slow", 0.004)}
    times = harness.time_round_robin(steps, repeats=5, budget_s=0.010, clock=clock)
    assert times["fast"][2] == 5 and times["slow"][2] == 2  # int(0.010 / 0.004) = 2


def test_round_robin_median_and_minimum_of_varying_costs():
    clock = FakeClock()
    costs = iter([0.0, 0.004, 0.001, 0.002])  # warm-up, then three timed calls (mean 2.33, median 2)

    def varying() -> None:
        clock.now += next(costs)

    times = harness.time_round_robin({"v": varying}, repeats=3, budget_s=1e9, clock=clock)
    assert times["v"] == pytest.approx((2.0, 1.0, 3))


def test_rss_peak_measures_a_known_allocation():
    harness.quiet_allocator()
    torch.ones(200 * 2**20 // 4).sum()  # an earlier, larger peak: the probe must measure from its own start
    with harness.rss_peak() as peak:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del block
    assert 60 <= peak["peak_mib"] <= 80
    assert 60 <= harness.step_peak_mib(lambda: torch.ones(64 * 2**20 // 4).sum(), "cpu") <= 80


def _pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def _fails(x: int) -> None:
    raise ValueError(f"job {x} failed on purpose")


def test_in_child_returns_the_childs_result_and_reports_its_error():
    pid, value = harness.in_child(_pid_and_square, 7)
    assert value == 49 and pid != os.getpid()
    with pytest.raises(RuntimeError, match="job 3 failed on purpose"):
        harness.in_child(_fails, 3)


@pytest.mark.parametrize("workers", [1, 2])
def test_run_jobs_yields_every_result_once(workers):
    results = list(harness.run_jobs(_pid_and_square, [1, 2, 3], workers, "test"))
    assert sorted(v for _, v in results) == [1, 4, 9]
    assert ({pid for pid, _ in results} == {os.getpid()}) == (workers == 1)  # a pool runs them elsewhere


def test_tables_round_trip_and_replace_rows(tmp_path):
    path = tmp_path / "t.csv"
    assert harness.read_rows(path) == []
    rows = [{"variant": "sdpa", "n": 512, "ms": 1.5}, {"variant": "primal", "n": 512, "ms": None, "extra": "x"}]
    harness.write_rows(path, rows)
    assert harness.read_rows(path) == [{"variant": "sdpa", "n": "512", "ms": "1.5", "extra": ""},
                                       {"variant": "primal", "n": "512", "ms": "", "extra": "x"}]
    harness.write_rows(path, rows, fields=["variant", "ms"])
    assert harness.read_rows(path) == [{"variant": "sdpa", "ms": "1.5"}, {"variant": "primal", "ms": ""}]
    replaced = harness.replace_row(rows, {"variant": "sdpa", "n": 512, "ms": 9.0}, key=lambda r: r["variant"])
    assert [(r["variant"], r["ms"]) for r in replaced] == [("primal", None), ("sdpa", 9.0)]
    assert harness.lookup(rows, variant="primal", n=512) is rows[1] and harness.lookup(rows, variant="eager") is None


def test_with_memory_adds_skipped_rows_and_training_peaks():
    timed = [{"variant": v, "n": n, "mode": m, "time_ms": 1.0} for v in ("sdpa", "eager") for n in (64, 128)
             for m in ("train", "infer") if not (v == "eager" and n == 128)]
    measured = []

    def memory(variant, n):
        measured.append((variant, n))
        return 10.0 * n + (1 if variant == "eager" else 0)

    rows = harness.with_memory(timed, (64, 128), ("sdpa", "eager"),
                               lambda v, n: "skipped: too big" if (v, n) == ("eager", 128) else None,
                               lambda v, n, mode: {"variant": v, "n": n, "mode": mode}, memory)
    assert measured == [("sdpa", 64), ("eager", 64), ("sdpa", 128)]  # never the skipped one
    peaks = {(r["variant"], r["n"], r["mode"]): r.get("peak_mib") for r in rows}
    assert peaks[("sdpa", 128, "train")] == 1280.0 and peaks[("eager", 64, "train")] == 641.0
    assert peaks[("sdpa", 64, "infer")] is None  # inference rows get no peak
    assert [r["status"] for r in rows if r.get("status")] == ["skipped: too big"] * 2
    assert harness.with_memory(timed, (64,), ("sdpa",), lambda v, n: None, dict, None) == timed  # not measured
