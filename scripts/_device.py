"""Device and precision options shared by the timing scripts: ``--device`` and ``--dtype``.

On CUDA a timed step runs under ``torch.autocast`` in the chosen half precision (the way mixed-precision training
and inference run there); on CPU the scripts time fp32, and ``--dtype bf16`` on CPU autocasts too (useful to check a
GPU table's settings on a laptop, not for CPU figures). Wall-clock times on CUDA need a synchronise before the
clock is read; `synchronize` does that and nothing on CPU. Peak memory on CUDA is the caching allocator's high-water
mark of tensor memory; on CPU the scripts read the resident set from /proc instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Iterator

# The scripts fork their workers: asking "is CUDA available?" through NVML leaves the parent without a CUDA context,
# so the forked children can still start one (a context made before a fork is unusable in the child).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="autocast precision of timed steps (default: bf16 on CUDA, fp32 on CPU)")


def resolve(args: argparse.Namespace) -> tuple[str, str]:
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
