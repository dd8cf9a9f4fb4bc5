"""Knowledge distillation from the original model into its primal conversion.

A primal layer cannot reproduce a softmax layer on its own (another token reaches token n only through two scalars
per head; docs/method.md, "Capacity of one layer"), so the rest of the network has to adapt around it. This module
holds the pieces that make that happen: the student-teacher loss terms (shared with `PrimalTrainer`'s
``teacher=`` option) and `distill`, the loop behind ``convert(..., method="distill")``.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..modeling.config import PrimalAttentionConfig
from .calibration import HELDOUT_EVERY, heldout_indices
from .loss import ksvd_loss, primal_model

TARGETS = ("auto", "hidden", "logits")


def _check_nonnegative(name: str, value: float, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not allowed: it must be a finite number.")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r} is not allowed: it must be {'> 0' if positive else '>= 0'}.")
    return float(value)


# ---------------------------------------------------------------------------------------------- loss terms
def masked_mean_pool(hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean over valid tokens: (B, N, C) -> (B, C) (sentence-transformers' mean pooling)."""
    if mask is None:
        return hidden.mean(dim=1)
    weights = mask[..., None].to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def hidden_state_loss(
    student: torch.Tensor, teacher: torch.Tensor, mask: Optional[torch.Tensor], pooled_weight: float = 1.0
) -> torch.Tensor:
    """Token-level relative squared error plus ``pooled_weight * (1 - cosine)`` of mean-pooled states, fp32.

    The token term is ||h_s - h_t||^2 / ||h_t||^2 per valid token, averaged; it is scale-free, so it means the same
    for any hidden size. The pooled term is what embedding models serve.
    """
    student, teacher = student.float(), teacher.float()
    err = (student - teacher).square().sum(-1) / teacher.square().sum(-1).clamp(min=1e-12)
    if mask is not None:
        weights = mask.to(err.dtype)
        token = (err * weights).sum() / weights.sum().clamp(min=1.0)
    else:
        token = err.mean()
    if pooled_weight == 0:
        return token
    cosine = F.cosine_similarity(masked_mean_pool(student, mask), masked_mean_pool(teacher, mask), dim=-1)
    return token + pooled_weight * (1.0 - cosine).mean()


def logits_kl_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """KL(teacher || student) of temperature-softened distributions, times T^2 (Hinton et al.), fp32.

    Logits of shape (B, K) are averaged over sequences; (B, N, K) (token-level heads, LMs) over valid tokens.
    """
    t = temperature
    log_p_student = F.log_softmax(student.float() / t, dim=-1)
    log_p_teacher = F.log_softmax(teacher.float() / t, dim=-1)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1)  # (B,) or (B, N)
    if kl.dim() == 2 and mask is not None and mask.shape == kl.shape:
        weights = mask.to(kl.dtype)
        return (kl * weights).sum() / weights.sum().clamp(min=1.0) * t * t
    return kl.mean() * t * t


def last_hidden(outputs: Any) -> torch.Tensor:
    hidden = getattr(outputs, "last_hidden_state", None)
    if hidden is None:
        states = getattr(outputs, "hidden_states", None)
        if not states:
            raise ValueError(
                "distillation needs the final hidden states: call the model with output_hidden_states=True"
            )
        hidden = states[-1]
    return hidden


def resolve_target(model: nn.Module, target: str) -> str:
    """``"auto"``: match logits when the model has a head that produces them, else the final hidden states."""
    if target not in TARGETS:
        raise ValueError(f"distill target={target!r} is not allowed: use one of {list(TARGETS)}.")
    if target != "auto":
        return target
    inner = primal_model(model)
    base = getattr(inner, "base_model_prefix", None)
    has_head = base is not None and hasattr(inner, base) and getattr(inner, base) is not inner
    return "logits" if has_head else "hidden"


def check_compatible(student: nn.Module, teacher: nn.Module, target: str) -> None:
    """Clear errors for a teacher whose outputs cannot be compared with the student's."""
    s_cfg = getattr(primal_model(student), "config", None)
    t_cfg = getattr(teacher, "config", None)
    if s_cfg is None or t_cfg is None:
        return
    s_vocab, t_vocab = getattr(s_cfg, "vocab_size", None), getattr(t_cfg, "vocab_size", None)
    if s_vocab is not None and t_vocab is not None and s_vocab != t_vocab:
        raise ValueError(
            f"teacher vocab_size={t_vocab} differs from the student's vocab_size={s_vocab}: the two models would read "
            "the same input_ids as different tokens. Use a teacher with the student's tokenizer."
        )
    if target == "hidden":
        s_hidden, t_hidden = getattr(s_cfg, "hidden_size", None), getattr(t_cfg, "hidden_size", None)
        if s_hidden != t_hidden:
            raise ValueError(
                f"teacher hidden_size={t_hidden} differs from the student's hidden_size={s_hidden}: hidden states can "
                "only be matched between models of the same width (use target='logits' for heads of equal size)."
            )


def student_teacher_loss(
    student_out: Any,
    teacher_out: Any,
    mask: Optional[torch.Tensor],
    target: str,
    temperature: float = 2.0,
    pooled_weight: float = 1.0,
) -> torch.Tensor:
    """The distillation term for one batch: hidden-state matching or logits KL (`target` already resolved)."""
    if target == "hidden":
        return hidden_state_loss(last_hidden(student_out), last_hidden(teacher_out), mask, pooled_weight)
    s_logits, t_logits = getattr(student_out, "logits", None), getattr(teacher_out, "logits", None)
    if s_logits is None or t_logits is None:
        raise ValueError("target='logits' needs models whose outputs have logits; use target='hidden'.")
    if s_logits.shape != t_logits.shape:
        raise ValueError(
            f"teacher logits {tuple(t_logits.shape)} and student logits {tuple(s_logits.shape)} differ in shape: the "
            "teacher must have the same head (same labels / vocabulary) as the student."
        )
    return logits_kl_loss(s_logits, t_logits, temperature, mask)


# ---------------------------------------------------------------------------------------------- the loop
@dataclass
class DistillResult:
    """What `distill` measured: held-out figures before/after and the held-out curve."""

    loss_before: float
    loss_after: float
    cosine_before: Optional[float]
    cosine_after: Optional[float]
    best_step: int
    steps: int
    curve: list[dict]
    seconds: float

    def to_dict(self) -> dict:
        return dict(vars(self))


def model_inputs(batch: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}


def _forward_pair(student, teacher, inputs, target, causal):
    extra = {"use_cache": False} if causal else {}
    want_hidden = target == "hidden" and needs_hidden_flag(student)
    kwargs = {**inputs, **extra, **({"output_hidden_states": True} if want_hidden else {})}
    with torch.no_grad():
        t_out = teacher(**kwargs)
    return student(**kwargs), t_out


def needs_hidden_flag(model: nn.Module) -> bool:
    # Base models return last_hidden_state; models with a head need output_hidden_states=True to expose it.
    return resolve_target(model, "auto") == "logits"


def _pooled_cosine(student_out, teacher_out, mask) -> torch.Tensor:
    return F.cosine_similarity(
        masked_mean_pool(last_hidden(student_out).float(), mask),
        masked_mean_pool(last_hidden(teacher_out).float(), mask),
        dim=-1,
    )


def _checked_settings(student, steps, learning_rate, primal_learning_rate, temperature, pooled_weight, ksvd_weight):
    """`distill`'s numeric settings, each refused by name when out of range; eta defaults to the model's."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"distill: steps={steps} is not allowed: it must be >= 1.")
    if ksvd_weight is None:  # the model's eta; a student without primal layers has no KSVD term
        spec = getattr(primal_model(student).config, "primal_attention", None)
        ksvd_weight = PrimalAttentionConfig.coerce(spec).eta if spec is not None else 0.0
    return (_check_nonnegative("learning_rate", learning_rate, positive=True),
            _check_nonnegative("primal_learning_rate", primal_learning_rate, positive=True),
            _check_nonnegative("temperature", temperature, positive=True),
            _check_nonnegative("pooled_weight", pooled_weight),
            _check_nonnegative("ksvd_weight", ksvd_weight))


def _optimizer(named, learning_rate, primal_learning_rate, weight_decay, warmup_ratio, steps):
    """AdamW with the new primal parameters in a group of their own; linear warm-up, then cosine decay."""
    primal = [p for n, p in named if ".primal." in f".{n}"]
    decay = [p for n, p in named if ".primal." not in f".{n}" and p.dim() >= 2]
    no_decay = [p for n, p in named if ".primal." not in f".{n}" and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "lr": learning_rate, "weight_decay": weight_decay},
            {"params": no_decay, "lr": learning_rate, "weight_decay": 0.0},
            {"params": primal, "lr": primal_learning_rate, "weight_decay": 0.0},
        ]
    )
    warmup = max(1, int(warmup_ratio * steps))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _heldout_figures(student, teacher, held, device, target, temperature, pooled_weight, causal
                     ) -> tuple[float, Optional[float]]:
    """(mean distillation loss, mean pooled cosine or None) of the student on the held-out batches, in eval mode."""
    was = student.training
    student.eval()
    total = count = 0.0
    cos_sum, cos_n = 0.0, 0
    with torch.no_grad():
        for batch in held:
            inputs = model_inputs(batch, device)
            s_out, t_out = _forward_pair(student, teacher, inputs, target, causal)
            mask = inputs.get("attention_mask")
            n = next(iter(inputs.values())).shape[0]
            total += float(student_teacher_loss(s_out, t_out, mask, target, temperature, pooled_weight)) * n
            count += n
            if target == "hidden" or getattr(s_out, "hidden_states", None) is not None:
                cos = _pooled_cosine(s_out, t_out, mask)
                cos_sum, cos_n = cos_sum + float(cos.sum()), cos_n + cos.numel()
    student.train(was)
    return total / max(count, 1.0), (cos_sum / cos_n if cos_n else None)


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    steps: int,
    learning_rate: float = 1e-4,
    primal_learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
    warmup_ratio: float = 0.06,
    target: str = "auto",
    temperature: float = 2.0,
    pooled_weight: float = 1.0,
    ksvd_weight: Optional[float] = None,
    heldout_every: int = HELDOUT_EVERY,
    eval_every: Optional[int] = None,
    seed: int = 0,
    progress: bool = True,
    causal: bool = False,
    train_all: bool = True,
) -> DistillResult:
    """Train every parameter of `student` so that its outputs match `teacher`'s on `batches`; keep the best state.

    Every `heldout_every`-th batch (counting from the last) is held out: it is never trained on, and the kept
    parameters are those with the lowest held-out distillation loss. New primal parameters train at
    `primal_learning_rate`, everything else at `learning_rate` (AdamW, linear warm-up then cosine decay).
    The student's KSVD term (weight `ksvd_weight`, default the model's eta) is added as in training.
    With ``train_all=False`` only parameters that already require grad train (e.g. a PEFT-wrapped student: LoRA
    weights plus the primal parameters).
    """
    import time

    started = time.time()
    learning_rate, primal_learning_rate, temperature, pooled_weight, eta = _checked_settings(
        student, steps, learning_rate, primal_learning_rate, temperature, pooled_weight, ksvd_weight)
    target = resolve_target(student, target)
    check_compatible(student, teacher, target)
    batches = list(batches)
    if len(batches) < 2:
        raise ValueError(
            f"distill: got {len(batches)} batch(es); at least 2 are needed (one is held out to choose the kept step)."
        )
    held_idx = heldout_indices(len(batches), heldout_every)
    held = [b for i, b in enumerate(batches) if i in held_idx]
    train = [b for i, b in enumerate(batches) if i not in held_idx]
    device = next(student.parameters()).device
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    named = [
        (n, p) for n, p in student.named_parameters() if p.dtype.is_floating_point and (train_all or p.requires_grad)
    ]
    if not named:
        raise ValueError("distill: the student has no trainable parameter (train_all=False and nothing requires grad).")
    for _, p in named:
        p.requires_grad_(True)
    optimizer, scheduler = _optimizer(named, learning_rate, primal_learning_rate, weight_decay, warmup_ratio, steps)

    def evaluate() -> tuple[float, Optional[float]]:
        return _heldout_figures(student, teacher, held, device, target, temperature, pooled_weight, causal)

    eval_every = eval_every or max(1, min(100, steps // 12))
    loss_before, cos_before = evaluate()
    best = (loss_before, 0, cos_before)
    best_state = {n: p.detach().clone() for n, p in named}
    curve = [{"step": 0, "heldout_loss": loss_before, "heldout_cosine": cos_before}]
    rng = random.Random(seed)
    order: list[int] = []
    student.train()
    bar = tqdm(range(steps), desc="distillation", disable=not progress)
    for step in bar:
        if not order:
            order = list(range(len(train)))
            rng.shuffle(order)
        inputs = model_inputs(train[order.pop()], device)
        s_out, t_out = _forward_pair(student, teacher, inputs, target, causal)
        loss = student_teacher_loss(s_out, t_out, inputs.get("attention_mask"), target, temperature, pooled_weight)
        if eta > 0:
            loss = loss + eta * ksvd_loss(student)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        optimizer.step()
        scheduler.step()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            held_loss, held_cos = evaluate()
            curve.append({"step": step + 1, "heldout_loss": held_loss, "heldout_cosine": held_cos})
            if held_loss < best[0]:
                best = (held_loss, step + 1, held_cos)
                best_state = {n: p.detach().clone() for n, p in named}
            bar.set_postfix({"train": f"{loss.item():.4f}", "heldout": f"{held_loss:.4f}",
                             **({"heldout_cos": f"{held_cos:.4f}"} if held_cos is not None else {})})
    with torch.no_grad():
        for n, p in named:
            p.copy_(best_state[n])
    student.eval()
    for module in student.modules():
        if getattr(module, "_is_primal_attention", False):
            module.ksvd_terms = None
    return DistillResult(
        loss_before=loss_before,
        loss_after=best[0],
        cosine_before=cos_before,
        cosine_after=best[2],
        best_step=best[1],
        steps=steps,
        curve=curve,
        seconds=round(time.time() - started, 1),
    )


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy of `model` to serve as the teacher."""
    teacher = copy.deepcopy(model)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher
