"""The long-document task shared by the table (`long_documents`) and its study (`long_documents_study`): the
arguments, the data (BBC News articles as bytes) and one training run (`train_job`); the byte-level classifier with
each attention variant is in `long_documents_model`. What the task is and why: the docstring of `long_documents`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from . import bbc_news, checkpoints, harness
from .long_documents_model import NO_ATTENTION, PAD, DocumentClassifier, settings_text

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_CSV, SUMMARY_CSV, TARGETS_CSV = "long_documents.csv", "long_documents_summary.csv", "long_documents_targets.csv"
TIMING_CSV, PNG = "long_documents_timing.csv", "long_documents.png"
TRAINED = ("sdpa", "primal", "primal-last", NO_ATTENTION, "performer", "nystrom", "linformer")
RUNS = TRAINED + ("eager", "sdpa-dropout")  # what --variants chooses from: the trained ones and the two timed runs
TIMED = ("sdpa", "sdpa-dropout", "eager") + TRAINED[1:]
# Arguments that choose which runs to make or where results go, not what one run computes.
NOT_RUN_SETTINGS = {"lengths", "seeds", "long_seeds", "variants", "workers", "only", "out_dir", "timing_steps",
                    "eager_steps", "eager_limit_gib"}


def run_epochs(row: dict) -> Optional[float]:
    """The training budget a result row records (None for a row that records none): runs of different budgets are
    different runs."""
    return None if row.get("epochs") in (None, "") else float(row["epochs"])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048,4096", help="document lengths N in bytes (the first is the main table)")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the main table")
    p.add_argument("--long-seeds", default="0", help="seeds at the other lengths")
    p.add_argument("--variants", default=",".join(RUNS),
                   help="the runs to make, comma-separated (a part of the table at a time: a rerun resumes)")
    p.add_argument("--epochs", type=float, default=16.0, help="training budget (chosen on validation)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps with a linear warm-up")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon (the paper's LRA recipe: 1e-6)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--train-fraction", type=float, default=1.0,
                   help="share of the training articles used (stratified by topic); the step count stays that of "
                        "the whole training split, so a data-size curve compares equal budgets")
    p.add_argument("--rank-multi", type=int, default=1,
                   help="m of the primal variants (p = m s; chosen on validation, the paper's is 10)")
    p.add_argument("--sampling", default=None,
                   help="sampling rule of the primal variants (PrimalAttentionConfig.sampling; default: its default, "
                        "segment_mean; the paper's is even)")
    p.add_argument("--ksvd-reduction", choices=("batch", "sequence"), default="batch")
    p.add_argument("--eager-steps", type=int, default=4, help="timed training steps of eager attention")
    p.add_argument("--eager-limit-gib", type=float, default=8.0,
                   help="skip eager and sdpa-dropout where they would need more")
    p.add_argument("--landmarks", type=int, default=256, help="Nystromformer landmarks (library default)")
    p.add_argument("--linformer-k", type=int, default=256, help="Linformer k (library default)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--workers", type=int, default=2, help="runs side by side")
    p.add_argument("--timing-steps", type=int, default=3,
                   help="timed training steps per variant in the timing phase (after one warm-up step)")
    p.add_argument("--only", choices=("train", "timing", "report"), default=None,
                   help="one phase: train (the accuracy runs), timing (every variant's training step on real "
                        "batches, round-robin in one process, and its peak memory) or report")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny data, lengths and budgets, one seed")
    p.add_argument("--out-dir", default=str(RESULTS))
    harness.add_device_arguments(p)
    args = p.parse_args(argv)
    args.documents = None  # every article
    if args.quick:
        args.lengths, args.seeds, args.long_seeds, args.epochs, args.batch_size = "96,160", "0", "0", 1.0, 8
        args.eager_steps, args.landmarks, args.linformer_k, args.workers, args.documents = 2, 16, 16, 1, 24
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.long_seeds = [int(s) for s in args.long_seeds.split(",")]
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in args.variants if v not in RUNS]
    if unknown:
        p.error(f"--variants {','.join(unknown)}: not a variant; choose from {', '.join(RUNS)}")
    args.device, args.dtype = harness.resolve_device(args)
    return args


# ---------------------------------------------------------------------------------------------- data
def encode(documents: list[tuple[bytes, int]], n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, labels): each document's first `n` bytes as tokens byte + 1, padded with 0."""
    ids = torch.full((len(documents), n), PAD, dtype=torch.long)
    for row, (text, _) in enumerate(documents):
        chunk = torch.frombuffer(bytearray(text[:n]), dtype=torch.uint8).long() + 1
        ids[row, : len(chunk)] = chunk
    return ids, ids != PAD, torch.tensor([label for _, label in documents])


def load_data(args: argparse.Namespace, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    splits = bbc_news.load_articles(seed=0)
    if args.documents:
        splits = {name: rows[: args.documents] for name, rows in splits.items()}
    return {name: encode(rows, n) for name, rows in splits.items()}


# ---------------------------------------------------------------------------------------------- one run
def train_step(model: DocumentClassifier, optimizer, batch, args) -> float:
    ids, mask, labels = (t.to(args.device) for t in batch)
    harness.synchronize(args.device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with harness.autocast(args.device, args.dtype):
        loss = model.loss(ids, mask, labels)
    loss.backward()
    optimizer.step()
    harness.synchronize(args.device)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"training loss {loss.item()} is not finite")
    return time.perf_counter() - start


def evaluate(model: DocumentClassifier, split, args, batch_size: int = 64) -> tuple[float, float]:
    """(accuracy, macro-F1) of `model` on one encoded split."""
    from sklearn.metrics import f1_score

    ids, mask, labels = split
    model.eval()
    predicted = []
    with torch.inference_mode(), harness.autocast(args.device, args.dtype):
        for i in range(0, len(ids), batch_size):
            logits = model(ids[i:i + batch_size].to(args.device), mask[i:i + batch_size].to(args.device))
            predicted.append(logits.argmax(-1).cpu())
    model.train()
    predicted_all = torch.cat(predicted)
    return (float((predicted_all == labels).float().mean()),
            float(f1_score(labels.numpy(), predicted_all.numpy(), average="macro")))


def setup(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    harness.quiet_allocator()


def subset(split: tuple[torch.Tensor, ...], fraction: float) -> tuple[torch.Tensor, ...]:
    """The first `fraction` of each topic's articles in a fixed shuffled order (the same for every run and seed), so
    a smaller subset is part of every larger one."""
    if fraction >= 1.0:
        return split
    labels = split[-1]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    keep = []
    for label in labels.unique().tolist():
        rows = order[labels[order] == label]
        keep.append(rows[: max(1, round(fraction * len(rows)))])
    index = torch.cat(keep).sort().values
    return tuple(t[index] for t in split)


def run_settings(args: argparse.Namespace, variant: str, n: int, seed: int) -> dict[str, Any]:
    """Everything that decides one training run's result (its checkpoint is resumed only under the same)."""
    return {"variant": variant, "n": n, "seed": seed,
            **{k: v for k, v in sorted(vars(args).items()) if k not in NOT_RUN_SETTINGS}}


def train_job(args: argparse.Namespace, variant: str, n: int, seed: int) -> dict[str, Any]:
    """Train `variant` from scratch at length `n` with `seed`; its row of the CSV (with the training accuracy in eval
    mode and the validation accuracy after every epoch, `val_curve`, as "step:accuracy" pairs). The run saves a
    checkpoint after every epoch (`checkpoints`) and, started again with the same settings, resumes from it."""
    setup(args)
    data = load_data(args, n)
    steps_per_epoch = -(-len(data["train"][0]) // args.batch_size)
    total = max(1, round(args.epochs * steps_per_epoch))
    train = subset(data["train"], getattr(args, "train_fraction", 1.0))
    warmup = max(1, int(args.warmup * total))
    settings = run_settings(args, variant, n, seed)
    saved_at = checkpoints.path_for(args.out_dir, f"{variant}-n{n}-seed{seed}", settings)
    with harness.peak_memory(args.device) as memory:
        torch.manual_seed(seed)
        model = DocumentClassifier(variant, n, args).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                      weight_decay=getattr(args, "weight_decay", 0.0),
                                      eps=getattr(args, "adam_eps", 1e-8))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: (i + 1) / warmup if i < warmup else max(0.0, (total - i) / max(1, total - warmup)))
        order = torch.Generator().manual_seed(seed)
        times: list[float] = []
        curve: list[str] = []
        permutation, position, before = None, 0, 0.0
        if (state := checkpoints.load(saved_at, settings)) is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            order.set_state(state["order"])
            torch.set_rng_state(state["rng"])
            times, curve, before = state["times"], state["curve"], state["seconds"]
            permutation, position = state["permutation"], state["position"]
        started = time.perf_counter()
        while len(times) < total:
            if permutation is None or position >= len(permutation):
                permutation, position = torch.randperm(len(train[0]), generator=order), 0
            index = permutation[position:position + args.batch_size]
            position += args.batch_size
            times.append(train_step(model, optimizer, [t[index] for t in train], args))
            schedule.step()
            if len(times) % steps_per_epoch == 0 or len(times) == total:
                pause = time.perf_counter()
                curve.append(f"{len(times)}:{evaluate(model, data['validation'], args)[0]:.4f}")
                if len(times) < total:
                    checkpoints.save(saved_at, settings, {
                        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "order": order.get_state(), "rng": torch.get_rng_state(),
                        "times": times, "curve": curve, "seconds": before + pause - started,
                        "permutation": permutation, "position": position})
                started += time.perf_counter() - pause  # the curve and the checkpoint are not training time
        seconds = before + time.perf_counter() - started
    train_accuracy, _ = evaluate(model, train, args)
    val_accuracy, val_f1 = evaluate(model, data["validation"], args)
    accuracy, f1 = evaluate(model, data["test"], args)
    checkpoints.remove(saved_at)
    return {"n": n, "variant": variant, "seed": seed, "status": "ok", "epochs": args.epochs, "steps": total,
            "batch": args.batch_size, "train_seconds": round(seconds, 2),
            "step_ms_median": round(1e3 * statistics.median(times), 2), "peak_mib": round(memory["peak_mib"], 1),
            "train_accuracy": train_accuracy, "val_accuracy": val_accuracy, "val_macro_f1": val_f1,
            "accuracy": accuracy, "macro_f1": f1, "val_curve": " ".join(curve),
            "load1": round(os.getloadavg()[0], 2), "device": args.device, "dtype": args.dtype,
            "threads": args.threads, "settings": settings_text(variant, args)}


def eager_estimate_gib(n: int, args: argparse.Namespace, variant: str = "eager", layers: int = 2,
                       heads: int = 2) -> float:
    """Memory of the (batch, heads, N, N) fp32 buffers one training step of `variant` keeps: eager keeps each layer's
    probabilities plus two in backward; dropout on them also keeps each layer's dropped copy and its mask, and the
    padding mask becomes a float bias (both counts match the peaks measured at N = 2048 within 3%)."""
    buffers = {"eager": layers + 2, "sdpa-dropout": 2 * layers + 3}[variant]
    return buffers * args.batch_size * heads * n * n * 4 / 2**30


def eager_job(args: argparse.Namespace, variant: str, n: int, seed: int) -> dict[str, Any]:
    """Time `--eager-steps` training steps of eager attention (same math as sdpa, so not trained)."""
    row = {"n": n, "variant": variant, "seed": seed, "batch": args.batch_size, "device": args.device,
           "dtype": args.dtype, "threads": args.threads, "settings": "the same math as sdpa; timed, not trained"}
    need = eager_estimate_gib(n, args, variant)
    if need > args.eager_limit_gib:
        return {**row, "status": f"skipped: needs ~{need:.0f} GiB > --eager-limit-gib {args.eager_limit_gib:g}"}
    setup(args)
    train = load_data(args, n)["train"]
    with harness.peak_memory(args.device) as memory:
        torch.manual_seed(seed)
        model = DocumentClassifier(variant, n, args).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
        times = [train_step(model, optimizer, [t[i:i + args.batch_size] for t in train], args)
                 for i in range(0, args.eager_steps * args.batch_size, args.batch_size)]
    return {**row, "status": "ok", "steps": len(times), "step_ms_median": round(1e3 * statistics.median(times[1:]
            or times), 2), "peak_mib": round(memory["peak_mib"], 1), "load1": round(os.getloadavg()[0], 2)}


