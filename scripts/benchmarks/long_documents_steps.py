"""What the long-document timing phase measures, each in a forked child of `long_documents`: the median training
step of every variant, round-robin on the same batch of real documents, and the peak memory of one step above the
process's baseline (data loaded first, so that only the model, its optimiser and the step count).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch

from . import harness
from .long_documents_model import DocumentClassifier
from .long_documents_task import TIMED, eager_estimate_gib, load_data, setup, train_step


def first_batch(args: argparse.Namespace, n: int) -> list[torch.Tensor]:
    return [t[: args.batch_size] for t in load_data(args, n)["train"]]


def training_step(args: argparse.Namespace, variant: str, n: int, batch: list[torch.Tensor]) -> Callable[[], Any]:
    """A fresh `variant` model (seed 0) and its optimiser, as one training step on `batch`."""
    torch.manual_seed(0)
    model = DocumentClassifier(variant, n, args).to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    return lambda: train_step(model, optimizer, batch, args)


def timing_job(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    setup(args)
    batch = first_batch(args, n)
    # Both form the (B, H, N, N) probabilities; the others never do.
    skipped = [v for v in ("eager", "sdpa-dropout") if eager_estimate_gib(n, args, v) > args.eager_limit_gib]
    times = harness.time_round_robin({v: training_step(args, v, n, batch) for v in TIMED if v not in skipped},
                                     args.timing_steps, 1e9)
    load, cpu = round(os.getloadavg()[0], 2), harness.cpu_name()
    rows = [{"n": n, "variant": v, "batch": args.batch_size, "step_ms": round(median, 2), "step_ms_min": round(low, 2),
             "reps": reps, "load1": load, "device": args.device, "dtype": args.dtype, "threads": args.threads,
             "cpu": cpu, "status": "ok"} for v, (median, low, reps) in times.items()]
    rows += [{"n": n, "variant": v, "status": f"skipped: needs ~{eager_estimate_gib(n, args, v):.0f} GiB"}
             for v in skipped]
    return rows


def memory_job(args: argparse.Namespace, variant: str, n: int) -> float:
    setup(args)
    batch = first_batch(args, n)
    with harness.peak_memory(args.device) as memory:
        training_step(args, variant, n, batch)()
    return memory["peak_mib"]
