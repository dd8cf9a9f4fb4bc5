"""Knowledge distillation from the original model into its primal conversion.

A primal layer cannot reproduce a softmax layer on its own (another token reaches token n only through two scalars
per head; docs/method.md, "Capacity of one layer"), so the rest of the network has to adapt around it. This module
holds `distill`, the loop behind ``convert(..., method="distill")``; the loss terms it minimises are in
`teacher_loss` (shared with `PrimalTrainer`'s ``teacher=`` option).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..modeling.config import PrimalAttentionConfig
from .calibration import HELDOUT_EVERY, heldout_indices
from .loss import clear_ksvd_terms, ksvd_loss, primal_model
from .teacher_loss import (
    check_compatible,
    check_nonnegative,
    last_hidden,
    masked_mean_pool,
    model_inputs,
    needs_hidden_flag,
    resolve_target,
    student_teacher_loss,
)


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


def _forward_pair(student, teacher, inputs, target, causal):
    extra = {"use_cache": False} if causal else {}
    want_hidden = target == "hidden" and needs_hidden_flag(student)
    kwargs = {**inputs, **extra, **({"output_hidden_states": True} if want_hidden else {})}
    with torch.no_grad():
        t_out = teacher(**kwargs)
    return student(**kwargs), t_out


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
    return (check_nonnegative("learning_rate", learning_rate, positive=True),
            check_nonnegative("primal_learning_rate", primal_learning_rate, positive=True),
            check_nonnegative("temperature", temperature, positive=True),
            check_nonnegative("pooled_weight", pooled_weight),
            check_nonnegative("ksvd_weight", ksvd_weight))


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


def _split_heldout(batches: list, heldout_every: int) -> tuple[list, list]:
    """(held-out, training) batches; refuses fewer than two batches."""
    if len(batches) < 2:
        raise ValueError(
            f"distill: got {len(batches)} batch(es); at least 2 are needed (one is held out to choose the kept step)."
        )
    held_idx = heldout_indices(len(batches), heldout_every)
    held = [b for i, b in enumerate(batches) if i in held_idx]
    train = [b for i, b in enumerate(batches) if i not in held_idx]
    return held, train


def _trainable_parameters(student: nn.Module, train_all: bool) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs `distill` trains, set to require grad; refuses an empty selection."""
    named = [
        (n, p) for n, p in student.named_parameters() if p.dtype.is_floating_point and (train_all or p.requires_grad)
    ]
    if not named:
        raise ValueError("distill: the student has no trainable parameter (train_all=False and nothing requires grad).")
    for _, p in named:
        p.requires_grad_(True)
    return named


def _step_loss(
    student: nn.Module, teacher: nn.Module, inputs: dict[str, torch.Tensor], target: str, causal: bool,
    temperature: float, pooled_weight: float, eta: float,
) -> torch.Tensor:
    """The training loss of one batch: the distillation term plus ``eta * ksvd_loss(student)``."""
    s_out, t_out = _forward_pair(student, teacher, inputs, target, causal)
    loss = student_teacher_loss(s_out, t_out, inputs.get("attention_mask"), target, temperature, pooled_weight)
    if eta > 0:
        loss = loss + eta * ksvd_loss(student)
    return loss


def _optimizer_step(
    loss: torch.Tensor, named: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Backpropagate `loss`, clip the gradient norm of `named` to 1, and step the optimizer and the schedule."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
    optimizer.step()
    scheduler.step()


def _train_keeping_best(
    student: nn.Module,
    named: list[tuple[str, nn.Parameter]],
    train: list,
    loss_of: Callable[[Mapping[str, Any]], torch.Tensor],
    evaluate: Callable[[], tuple[float, Optional[float]]],
    optimizers: tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler],
    before: tuple[float, Optional[float]],
    *,
    steps: int,
    eval_every: int,
    seed: int,
    progress: bool,
) -> tuple[list[dict], tuple[float, int, Optional[float]]]:
    """Train for `steps` steps on shuffled passes over `train`, then load the parameters of the best held-out step.

    Returns the held-out curve and (best held-out loss, its step, its held-out cosine).
    """
    optimizer, scheduler = optimizers
    best = (before[0], 0, before[1])
    best_state = {n: p.detach().clone() for n, p in named}
    curve = [{"step": 0, "heldout_loss": before[0], "heldout_cosine": before[1]}]
    rng = random.Random(seed)
    order: list[int] = []
    student.train()
    bar = tqdm(range(steps), desc="distillation", disable=not progress)
    for step in bar:
        if not order:
            order = list(range(len(train)))
            rng.shuffle(order)
        loss = loss_of(train[order.pop()])
        _optimizer_step(loss, named, optimizer, scheduler)
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
    return curve, best


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
    held, train = _split_heldout(list(batches), heldout_every)
    device = next(student.parameters()).device
    teacher.eval()  # its forwards run under no_grad; its requires_grad flags stay the caller's
    named = _trainable_parameters(student, train_all)
    optimizers = _optimizer(named, learning_rate, primal_learning_rate, weight_decay, warmup_ratio, steps)

    def evaluate() -> tuple[float, Optional[float]]:
        return _heldout_figures(student, teacher, held, device, target, temperature, pooled_weight, causal)

    def loss_of(batch: Mapping[str, Any]) -> torch.Tensor:
        inputs = model_inputs(batch, device)
        return _step_loss(student, teacher, inputs, target, causal, temperature, pooled_weight, eta)

    eval_every = eval_every or max(1, min(100, steps // 12))
    loss_before, cos_before = evaluate()
    curve, best = _train_keeping_best(student, named, train, loss_of, evaluate, optimizers, (loss_before, cos_before),
                                      steps=steps, eval_every=eval_every, seed=seed, progress=progress)
    student.eval()
    clear_ksvd_terms(student)
    return DistillResult(loss_before=loss_before, loss_after=best[0], cosine_before=cos_before, cosine_after=best[2],
                         best_step=best[1], steps=steps, curve=curve, seconds=round(time.time() - started, 1))


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy of `model` to serve as the teacher."""
    teacher = copy.deepcopy(model)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher
