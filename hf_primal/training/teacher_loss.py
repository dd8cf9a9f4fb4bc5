"""The student-teacher loss terms of distillation, shared by `distill` (conversion) and `PrimalTrainer`'s
``teacher=`` option: hidden-state and logit targets, the mean pooling they compare, and the checks that a student
and its teacher can be compared at all."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling.architecture import base_model
from .loss import primal_model

TARGETS = ("auto", "hidden", "logits")


def check_nonnegative(name: str, value: float, *, positive: bool = False) -> float:
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
    return "logits" if base_model(inner)[0] is not inner else "hidden"


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


def prepare_teacher(model: nn.Module, teacher: nn.Module, target: str, device: Any) -> str:
    """Check that `teacher` can teach `model` (same outputs, no shared parameters) and put it on `device` in eval
    mode, outside the model (so that no optimizer or checkpoint sees it); returns the resolved `target`.

    The teacher's ``requires_grad`` flags are left as they are: its forwards run under ``no_grad``, and freezing the
    caller's model in place would silently freeze every student later deep-copied from it."""
    target = resolve_target(model, target)
    check_compatible(model, teacher, target)
    if teacher is model or any(p is q for p in teacher.parameters() for q in model.parameters()):
        raise ValueError("PrimalTrainer: the teacher shares parameters with the model; pass a separate (frozen) copy.")
    teacher.to(device)
    teacher.eval()
    return target


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


def model_inputs(batch: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}


def needs_hidden_flag(model: nn.Module) -> bool:
    # Base models return last_hidden_state; models with a head need output_hidden_states=True to expose it.
    return resolve_target(model, "auto") == "logits"
