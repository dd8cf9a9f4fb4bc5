"""What the peer benchmark measures, each part in a forked child: the attention sub-layer of every variant (hf_primal,
SDPA, eager and the packaged peers) timed round-robin, its autograd and peak memory, and the short-input and MiniLM
steps. The task and the table: peers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from . import encoder, harness

PEERS = ("performer", "nystrom", "linformer")


VARIANTS = ("primal", "sdpa", "eager") + PEERS


@dataclass(frozen=True)
class Width(encoder.Shape):
    """A width of the sub-layer table: the one-layer encoder shape hf_primal's and the stock sub-layers are cut
    from, and the peers' own settings."""

    landmarks: int = 256  # library defaults; --quick shrinks them with the shapes
    linformer_k: int = 256


@dataclass
class Options:
    threads: int
    repeats: int
    budget_s: float
    eager_limit_gib: float
    widths: tuple[Width, ...]
    short_lengths: tuple[int, ...]
    short_batch: int
    short_shape: encoder.Shape
    minilm_sentences: int
    minilm_batch: int
    quick: bool
    device: str = "cpu"
    dtype: str = "fp32"  # autocast precision of the timed steps (`harness.DTYPES`)


class Residual(torch.nn.Module):
    """LayerNorm(x + attention(x)): what BertAttention adds around its attention, so every variant does the same."""

    def __init__(self, attention: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.attention = attention
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attention(x))


class Stock(torch.nn.Module):
    """transformers' BertAttention (stock or primal) returning its output tensor only."""

    def __init__(self, attention: torch.nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x)[0]


def peer_settings(width: Width, variant: str) -> str:
    d = width.hidden // width.heads
    if variant == "performer":
        import math

        return f"nb_features={int(d * math.log(d))} (default int(d ln d)), softmax kernel"
    if variant == "nystrom":
        return f"num_landmarks={width.landmarks}, pinv_iterations=6, residual conv 33 (defaults)"
    if variant == "linformer":
        return f"k={width.linformer_k} (default), separate key/value projections"
    if variant == "primal":
        return f"s={width.low_rank}, m={width.rank_multi}"
    return ""


def sublayer(width: Width, variant: str, n: int, device: str = "cpu") -> torch.nn.Module:
    """The attention sub-layer of `variant` at width `width` for sequences of length `n`, in train mode."""
    torch.manual_seed(0)
    d = width.hidden // width.heads
    if variant in ("primal", "sdpa", "eager"):
        name = "primal-all" if variant == "primal" else variant
        return Stock(encoder.sublayer_module(width, name, n).attention).train().to(device)
    if variant == "performer":
        from performer_pytorch import SelfAttention

        attention = SelfAttention(dim=width.hidden, heads=width.heads, dim_head=d)
    elif variant == "nystrom":
        from nystrom_attention import NystromAttention

        attention = NystromAttention(dim=width.hidden, dim_head=d, heads=width.heads, num_landmarks=width.landmarks)
    elif variant == "linformer":
        from linformer import LinformerSelfAttention

        attention = LinformerSelfAttention(dim=width.hidden, seq_len=n, k=width.linformer_k, heads=width.heads,
                                           dim_head=d)
    else:
        raise ValueError(variant)
    return Residual(attention, width.hidden).train().to(device)


def eager_estimate_gib(width: Width, n: int) -> float:
    return 3 * width.heads * n * n * 4 / 2**30  # scores, probabilities and their gradient


def skip_reason(opts: Options, width: Width, variant: str, n: int) -> Optional[str]:
    if variant == "eager" and eager_estimate_gib(width, n) > opts.eager_limit_gib:
        return f"skipped: eager attention needs ~{eager_estimate_gib(width, n):.0f} GiB > {opts.eager_limit_gib:g} GiB"
    return None


def _inputs(width: Width, n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)  # drawn on the CPU, so every device gets the same inputs
    x, grad = torch.randn(1, n, width.hidden), torch.randn(1, n, width.hidden)
    return x.to(device).requires_grad_(), grad.to(device)


def make_steps(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, device: str = "cpu",
               dtype: str = "fp32") -> dict[str, Callable[[], None]]:
    """Training and inference step; each synchronises at its end, so that a wall clock read after it is right."""
    backward = harness.backward_step(module, lambda: module(x), grad, (x,), device, dtype)

    def train() -> None:
        module.train()
        backward()

    def infer() -> None:
        module.eval()
        with torch.inference_mode(), harness.autocast(device, dtype):
            module(x)
        harness.synchronize(device)

    return {"train": train, "infer": infer}


def autograd_mib(module: torch.nn.Module, x: torch.Tensor, device: str = "cpu", dtype: str = "fp32") -> float:
    """MiB of the distinct storages the forward saves for backward, parameters and the input excluded."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), harness.autocast(device, dtype):
        # In the timed steps' precision: half-precision activations save half the bytes (under autocast the
        # weights' half-precision copies are saved too; they do not grow with N).
        out = module(x)
    del out
    return sum(seen.values()) / 2**20


def peers_timing_job(opts: Options, width: Width) -> list[dict[str, Any]]:
    torch.set_num_threads(opts.threads)
    rows = []
    for n in width.lengths:
        x, grad = _inputs(width, n, opts.device)
        built = {v: sublayer(width, v, n, opts.device) for v in VARIANTS if skip_reason(opts, width, v, n) is None}
        saved = {v: autograd_mib(m, x, opts.device, opts.dtype) for v, m in built.items()}
        for mode in ("train", "infer"):
            steps = {v: make_steps(m, x, grad, opts.device, opts.dtype)[mode] for v, m in built.items()}
            times = harness.time_round_robin(steps, opts.repeats, opts.budget_s)
            load = os.getloadavg()[0]
            for variant, (median, low, reps) in times.items():
                rows.append({"width": width.name, "hidden": width.hidden, "heads": width.heads, "variant": variant,
                             "n": n, "mode": mode, "time_ms": median, "time_ms_min": low, "reps": reps,
                             "autograd_mib": saved[variant] if mode == "train" else None, "load1": load,
                             "settings": peer_settings(width, variant)})
        print(f"  [{width.name}] N={n} timed (load {os.getloadavg()[0]:.1f})", flush=True)
        del built
    return rows


def peers_memory_job(opts: Options, width: Width, variant: str, n: int) -> dict[str, float]:
    device, dtype = opts.device, opts.dtype
    harness.start_worker(opts.threads, device)
    module = sublayer(width, variant, n, device)
    x, grad = _inputs(width, n, device)
    if variant != "linformer":  # warm-up (Linformer takes exactly N tokens)
        m = min(n, 128)
        make_steps(module, x[:, :m].detach().requires_grad_(), grad[:, :m], device, dtype)["train"]()
    step = make_steps(module, x, grad, device, dtype)["train"]
    module.zero_grad(set_to_none=True)
    return {"peak_mib": harness.step_peak_mib(step, device)}


def short_timing_job(opts: Options) -> list[dict[str, Any]]:
    """BERT-base-width encoder, short sequences: primal-all / primal-last vs SDPA, train and inference."""
    torch.set_num_threads(opts.threads)
    rows = []
    shape = replace(opts.short_shape, lengths=opts.short_lengths)
    for n in shape.lengths:
        built = {}
        for variant in ("primal-all", "primal-last", "sdpa"):
            torch.manual_seed(0)
            model = encoder.Classifier(encoder.bert_config(shape, variant, max(shape.lengths))).to(opts.device)
            ids = torch.randint(1, shape.vocab, (shape.batch, n)).to(opts.device)
            labels = torch.randint(0, encoder.NUM_CLASSES, (shape.batch,)).to(opts.device)
            built[variant] = (model, ids, labels)
        for mode in ("train", "infer"):
            steps = {v: encoder.make_step(m, ids, labels, mode, opts.device, opts.dtype)
                     for v, (m, ids, labels) in built.items()}
            # short steps are cheap: more repeats (3x the budget) tighten the medians the 5% target is read from
            times = harness.time_round_robin(steps, opts.repeats * 2, opts.budget_s * 3)
            load = os.getloadavg()[0]
            for variant, (median, low, reps) in times.items():
                rows.append({"model": f"bert-base-width {shape.layers} layers", "variant": variant, "n": n,
                             "batch": shape.batch, "mode": mode, "time_ms": median, "time_ms_min": low, "reps": reps,
                             "sentences_per_s": None, "load1": load})
        print(f"  [short] N={n} timed", flush=True)
    return rows


def minilm_job(opts: Options) -> list[dict[str, Any]]:
    """all-MiniLM-L6-v2, stock vs last layer primal, embedding real sentences: sentences per second."""
    torch.set_num_threads(opts.threads)
    from transformers import AutoTokenizer, BertModel
    from transformers.utils import logging as hf_logging

    from hf_primal import PrimalAttentionConfig, convert
    from hf_primal.tools.data import minilm_path
    from hf_primal.training.teacher_loss import masked_mean_pool

    from . import bbc_news

    hf_logging.set_verbosity_error()
    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    _, test, _ = bbc_news.load()
    texts = test.texts[: opts.minilm_sentences]
    batches = [tokenizer(texts[i:i + opts.minilm_batch], padding=True, truncation=True, max_length=128,
                         return_tensors="pt") for i in range(0, len(texts), opts.minilm_batch)]
    batches = [{k: v.to(opts.device) for k, v in batch.items()} for batch in batches]
    models = {"stock": BertModel.from_pretrained(path).eval().to(opts.device),
              "primal-last": convert(BertModel.from_pretrained(path), PrimalAttentionConfig(layers=[-1]),
                                     progress=False).eval().to(opts.device)}

    def embed(model) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode(), harness.autocast(opts.device, opts.dtype):
                for batch in batches:
                    masked_mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
            harness.synchronize(opts.device)  # before the wall clock is read
        return run

    times = harness.time_round_robin({v: embed(m) for v, m in models.items()}, opts.repeats * 2, opts.budget_s * 6)
    load = os.getloadavg()[0]
    mean_tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(texts)
    rows = []
    for variant, (median, low, reps) in times.items():
        rows.append({"model": f"all-MiniLM-L6-v2 ({len(texts)} BBC sentences, {mean_tokens:.0f} tokens on average)",
                     "variant": variant, "n": max(b["input_ids"].shape[1] for b in batches),
                     "batch": opts.minilm_batch, "mode": "infer", "time_ms": median, "time_ms_min": low, "reps": reps,
                     "sentences_per_s": len(texts) / (median / 1e3), "load1": load})
    return rows
