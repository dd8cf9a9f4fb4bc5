"""What every benchmark shares: device and precision, timing, memory, worker processes, result tables.

* **Device and precision** (``--device``, ``--dtype``): on CUDA a timed step runs under ``torch.autocast`` in the
  chosen half precision; on CPU the benchmarks time fp32 (``--dtype bf16`` on CPU autocasts too: useful to check a
  GPU table's settings on a laptop, not for CPU figures). `synchronize` before a clock is read (CUDA runs kernels
  asynchronously).
* **Timing**: `time_round_robin` times several steps in randomised round-robin passes after one warm-up each, so
  that a slow phase of the machine hits every variant alike; ratios between variants come from one such call.
* **Memory**: on CUDA the caching allocator's high-water mark above the level at entry (`cuda_peak`); on CPU the
  resident set's high-water mark above the resident set at entry (`rss_peak`, Linux ``/proc``), after
  `quiet_allocator` made glibc hand freed tensors back at once.
* **Processes**: `in_child` runs one measurement in a forked child (its peak memory is its own, nothing leaks into
  the next); `run_jobs` runs training jobs in fresh one-job spawned workers (or here, with one worker) and yields
  each result as it finishes, with a progress bar.
* **Tables**: `read_rows` / `write_rows` (CSV, one row per run, written after every run so a rerun resumes),
  `lookup`, `fmt`, `machine_line` (what the figures were measured on, load average included), `cpu_name`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import multiprocessing
import os
import platform
import random
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

# The benchmarks fork their workers: asking "is CUDA available?" through NVML leaves the parent without a CUDA
# context, so the forked children can still start one (a context made before a fork is unusable in the child).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------- device
def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="autocast precision of timed steps (default: bf16 on CUDA, fp32 on CPU)")


def resolve_device(args: argparse.Namespace) -> tuple[str, str]:
    """(device, dtype name) after checking them; the device must exist on this machine."""
    device = str(torch.device(args.device))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
    if not (device == "cpu" or device.startswith("cuda")):
        raise SystemExit(f"--device {args.device}: use cpu, cuda or cuda:N")
    dtype = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    if dtype == "fp16" and device == "cpu":
        raise SystemExit("--dtype fp16 is for CUDA; on CPU use fp32 or bf16")
    return device, dtype


def autocast(device: str, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype])


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- timing
def time_round_robin(steps: dict[str, Callable[[], None]], repeats: int, budget_s: float,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, tuple[float, float, int]]:
    """name -> (median ms, min ms, timed repeats): one untimed warm-up call of each step, then randomised
    round-robin passes until each step has `repeats` timings or its share of `budget_s` (seconds) is spent."""
    first: dict[str, float] = {}
    for name, step in steps.items():
        start = clock()
        step()
        first[name] = clock() - start
    wanted = {name: max(1, min(repeats, int(budget_s / max(t, 1e-9)))) for name, t in first.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    rng = random.Random(0)
    while any(len(samples[name]) < wanted[name] for name in steps):
        order = [name for name in steps if len(samples[name]) < wanted[name]]
        rng.shuffle(order)
        for name in order:
            start = clock()
            steps[name]()
            samples[name].append(clock() - start)
    return {name: (statistics.median(v) * 1e3, min(v) * 1e3, len(v)) for name, v in samples.items()}


def backward_step(module: torch.nn.Module, forward: Callable[[], torch.Tensor], grad: torch.Tensor,
                  leaves: tuple[torch.Tensor, ...], device: str, dtype: str) -> Callable[[], None]:
    """A timed training step: clear the gradients of `module` and of the input `leaves`, run `forward` under
    autocast, back-propagate `grad` into its output, and synchronise (so a wall clock read after it is right)."""

    def step() -> None:
        module.zero_grad(set_to_none=True)
        for leaf in leaves:
            leaf.grad = None
        with autocast(device, dtype):
            out = forward()
        out.backward(grad.to(out.dtype))
        synchronize(device)

    return step


# ---------------------------------------------------------------------------------------------- memory
@contextlib.contextmanager
def cuda_peak(device: str) -> Iterator[dict]:
    """Yields a dict that holds ``peak_mib`` (allocated above the level at entry) once the block ends (CUDA only)."""
    out: dict = {}
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    yield out
    synchronize(device)
    out["peak_mib"] = (torch.cuda.max_memory_allocated(device) - start) / 2**20


def status_kib(key: str) -> int:
    """A field of /proc/self/status (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def quiet_allocator() -> None:
    """A fixed mmap threshold (glibc raises it dynamically otherwise): every freed tensor above 128 KiB goes back
    to the OS at once, so the resident set tracks live memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def release_free_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_rss_high_water() -> bool:
    """Restart the kernel's resident-set high-water mark at the current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def rss_peak() -> Iterator[dict]:
    """Yields a dict that holds ``peak_mib`` (the resident set's high-water mark above its level at entry) once
    the block ends (CPU, Linux)."""
    out: dict = {}
    release_free_memory()
    start = status_kib("VmRSS")
    reset_rss_high_water()
    yield out
    out["peak_mib"] = (status_kib("VmHWM") - start) / 1024


def peak_memory(device: str) -> contextlib.AbstractContextManager[dict]:
    """`cuda_peak` on CUDA (the resident set of a CUDA process says nothing about tensors), `rss_peak` on CPU."""
    return cuda_peak(device) if device.startswith("cuda") else rss_peak()


def start_worker(threads: int, device: str) -> None:
    """A measuring worker's first lines: its thread count and, on CPU, `quiet_allocator`."""
    torch.set_num_threads(threads)
    if not device.startswith("cuda"):
        quiet_allocator()


def step_peak_mib(step: Callable[[], Any], device: str) -> float:
    """The peak memory of one call of `step`, above the level before it (`peak_memory`)."""
    with peak_memory(device) as peak:
        step()
    return peak["peak_mib"]


# ---------------------------------------------------------------------------------------------- processes
def _child(conn: Any, fn: Callable, args: tuple) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # report instead of leaving the parent waiting
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def in_child(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` in a forked child process, so that its peak memory is its own and nothing leaks between runs."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(sender, fn, args))
    process.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"benchmark worker {fn.__name__} died with exit code {process.exitcode} "
                           "(out of memory?)") from None
    process.join()
    if status != "ok":
        raise RuntimeError(f"benchmark worker {fn.__name__} failed:\n{payload}")
    return payload


def run_jobs(fn: Callable[[Any], Any], jobs: list, workers: int, desc: str,
             separate: bool = False) -> Iterator[Any]:
    """Yield `fn(job)` for every job as it finishes, with a progress bar. With more than one worker (or
    `separate`), each job runs in a fresh spawned process of its own (nothing carries over between jobs); else
    here, one after another. `fn` must be importable by name (a module-level function)."""
    from tqdm.auto import tqdm

    use_pool = workers > 1 or separate
    pool = multiprocessing.get_context("spawn").Pool(max(1, workers), maxtasksperchild=1) if use_pool else None
    with pool or contextlib.nullcontext(), tqdm(total=len(jobs), desc=desc) as bar:
        for result in (pool.imap_unordered(fn, jobs) if pool else map(fn, jobs)):
            bar.update(1)
            yield result


# ---------------------------------------------------------------------------------------------- tables
def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV file as strings (none when it does not exist yet)."""
    if not Path(path).exists():
        return []
    with open(path, encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def write_rows(path: Path, rows: Iterable[dict], fields: Optional[list[str]] = None) -> None:
    """Write `rows` with `fields` (default: every key, in order of first appearance); keys not in `fields` are
    left out. No rows and no fields: nothing is written."""
    rows = list(rows)
    if not rows and not fields:
        return
    fields = fields or list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def replace_row(rows: list[dict], row: dict, key: Callable[[dict], tuple]) -> list[dict]:
    """`rows` with the row of the same `key` as `row` replaced by it (or `row` appended)."""
    return [r for r in rows if key(r) != key(row)] + [row]


def lookup(rows: list[dict], **match: Any) -> Optional[dict]:
    """The first row whose fields equal `match`."""
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def timing_parser(description: str, parts: list[str], budget_s: float, eager_limit_gib: float
                  ) -> argparse.ArgumentParser:
    """The command line the round-robin timing benchmarks (`layers`, `peers`) share; each adds its own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (for tests)")
    parser.add_argument("--only", action="append", choices=parts, help="run only these parts (repeatable)")
    parser.add_argument("--max-n", type=int, default=8192, help="longest sequence (full run)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory workers")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration at most")
    parser.add_argument("--budget-s", type=float, default=budget_s,
                        help="fewer repeats for configurations whose steps take longer than this / repeats")
    parser.add_argument("--eager-limit-gib", type=float, default=eager_limit_gib,
                        help="skip eager attention where it would need more")
    add_device_arguments(parser)
    return parser


def with_memory(timed: list[dict], lengths: Iterable[int], variants: Iterable[str],
                skip: Callable[[str, int], Optional[str]], row: Callable[[str, int, str], dict],
                memory: Optional[Callable[[str, int], float]]) -> list[dict]:
    """One group's timed rows (all of one width or section, measured round-robin) completed per (N, variant): two
    rows ("train", "infer") with the reason when `skip` gives one, else the training row's ``peak_mib`` from
    `memory` (None: not measured). `row(variant, n, mode)` gives a skipped row's identifying fields."""
    rows = list(timed)
    for n in lengths:
        for variant in variants:
            reason = skip(variant, n)
            if reason is not None:
                rows += [{**row(variant, n, mode), "status": reason} for mode in ("train", "infer")]
            elif memory is not None:
                lookup(rows, variant=variant, n=n, mode="train")["peak_mib"] = memory(variant, n)
    return rows


def run_phases(args: argparse.Namespace, phases: dict[str, Callable[[argparse.Namespace], Any]],
               report: Callable[[argparse.Namespace], Any]) -> int:
    """A benchmark's main: the output folder, each phase `--only` selects (all by default), then the report."""
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for name, phase in phases.items():
        if args.only in (None, name):
            phase(args)
    report(args)
    return 0


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows: speed ratios between kernels differ between CPUs."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_line(device: str, dtype: str, threads: int) -> str:
    """What the figures were measured on, with the load average (more than `threads` means competition)."""
    # The device by name only: asking CUDA for its GPU's name would initialise it in the parent before it forks.
    return (f"torch {torch.__version__}, {device} {dtype}, {threads} threads, {os.cpu_count()} CPUs ({cpu_name()}), "
            f"load average {load_average()}")
