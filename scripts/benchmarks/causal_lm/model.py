"""The GPT-2 of each row of the causal-LM benchmark, its training loop and its evaluation.

Rows (`VARIANTS`): ``softmax`` (stock GPT-2, SDPA), ``primal-last`` (Primal.+: the last layer primal), ``primal``
(Primal.: every layer, hf_primal's defaults), ``primal-<mixing>`` (every layer, each other ``causal_mixing``), and
``no-mixing`` (every attention block outputs zero, so no token sees another: what the rest of the network learns
alone). Every row has the same shape, data order, optimiser and seed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import hf_primal
from hf_primal.modeling.config import CAUSAL_MIXING, PrimalAttentionConfig

from .corpus import evaluation_windows, training_windows

VARIANTS: dict[str, Optional[dict]] = {
    "softmax": None,
    "primal-last": {"layers": [-1]},
    "primal": {"layers": "all"},
    **{f"primal-{mixing}": {"layers": "all", "causal_mixing": mixing} for mixing in CAUSAL_MIXING
       if mixing != PrimalAttentionConfig.causal_mixing},
    "no-mixing": None,
}


@dataclass(frozen=True)
class Recipe:
    """Shape and training budget (the same for every row)."""

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    context: int = 256
    n_positions: int = 4096  # positions past `context` are never trained; they let decoding be timed to 4,096
    batch: int = 16
    steps: int = 1200
    eval_every: int = 200  # steps between validation scores (the curves)
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.05  # share of the steps
    eval_tokens: int = 200_000  # validation tokens scored at each point of the curves
    final_tokens: int = 10**9  # tokens of each split scored at the end (default: all of them)
    low_rank: int = 30


class NoMixing(nn.Module):
    """An attention block that outputs zero: the token sees no other token through it."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


def build(variant: str, vocab_size: int, recipe: Recipe, seed: int) -> GPT2LMHeadModel:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not allowed: use one of {list(VARIANTS)}.")
    torch.manual_seed(seed)
    spec = VARIANTS[variant]
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=recipe.n_positions, n_embd=recipe.n_embd, n_layer=recipe.n_layer,
        n_head=recipe.n_head, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
        primal_attention=None if spec is None else {**spec, "low_rank": recipe.low_rank},
        attn_pdrop=0.0,  # keeps PyTorch's fused SDPA kernel for the softmax layers (primal layers have no dropout)
    )
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    if variant == "no-mixing":
        for block in model.transformer.h:
            block.attn = NoMixing()
    return model


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def perplexity(model: GPT2LMHeadModel, stream: torch.Tensor, context: int, limit: int, batch: int = 32) -> float:
    """exp(mean next-token NLL) over the first `limit` tokens of `stream` (`evaluation_windows`)."""
    model.eval()
    windows = evaluation_windows(stream, context, limit)
    total, count = 0.0, 0
    for begin in range(0, len(windows), batch):
        rows = windows[begin:begin + batch]
        logits = model(input_ids=rows[:, :-1]).logits.float()
        nll = nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        total, count = total + float(nll), count + rows[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def train(model: GPT2LMHeadModel, train_stream: torch.Tensor, valid_stream: torch.Tensor, recipe: Recipe,
          seed: int, on_epoch: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """AdamW with warm-up and cosine decay to 10%; loss = cross-entropy + eta * KSVD (hf_primal.ksvd_loss; zero
    for models without primal layers). Returns a row every `eval_every` steps: training perplexity (of the batches
    since the last row), validation perplexity, steps, epochs (passes over the training tokens) and seconds so far
    (the training loop alone)."""
    steps_per_epoch = max(1, train_stream.numel() // (recipe.batch * recipe.context))
    total = recipe.steps
    windows = training_windows(train_stream, recipe.context, recipe.batch, total, seed)
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        (no_decay if parameter.dim() < 2 or "ln_" in name else decay).append(parameter)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _schedule(step, total, max(1, int(recipe.warmup * total))))
    eta = PrimalAttentionConfig.coerce(model.config.primal_attention).eta \
        if getattr(model.config, "primal_attention", None) else 0.0
    model.train()
    history, epoch_nll, epoch_tokens, began, scoring = [], 0.0, 0, time.perf_counter(), 0.0
    for step in range(total):
        rows = windows[step]
        logits = model(input_ids=rows[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        objective = loss + eta * hf_primal.ksvd_loss(model) if eta else loss
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss became {value} at step {step}")
        epoch_nll, epoch_tokens = epoch_nll + value * rows[:, 1:].numel(), epoch_tokens + rows[:, 1:].numel()
        if (step + 1) % recipe.eval_every == 0 or step + 1 == total:
            scored = time.perf_counter()
            valid_ppl = perplexity(model, valid_stream, recipe.context, recipe.eval_tokens)
            scoring += time.perf_counter() - scored
            row = {"step": step + 1, "epoch": round((step + 1) / steps_per_epoch, 3),
                   "train_ppl": math.exp(epoch_nll / epoch_tokens), "valid_ppl": valid_ppl,
                   "train_seconds": time.perf_counter() - began - scoring}
            history.append(row)
            if on_epoch is not None:
                on_epoch(row)
            epoch_nll, epoch_tokens = 0.0, 0
    return history
