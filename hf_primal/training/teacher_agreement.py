"""How close a student is to its teacher on held-out inputs, measured at every evaluation of `PrimalTrainer`.

With a teacher, each evaluation also runs the teacher on the evaluation inputs (labels are not needed, so held-out
*unlabeled* text works) and reports

* ``eval_distill_loss``: the distillation term the trainer minimises, on held-out inputs (lower is better);
* ``eval_teacher_agreement``: with logit targets, the share of predictions (one per example for sequence and image
  classification, one per real token for token-level heads) where the student's top class is the teacher's.

Either one is a stopping rule in the way transformers users already stop training: ``metric_for_best_model``,
``load_best_model_at_end=True`` and ``EarlyStoppingCallback``. `StoppingRecord` then writes the step that was kept
into ``model.primal_conversion_report["training"]``, which the model card shows.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import TrainerCallback

AGREEMENT, DISTILL = "teacher_agreement", "distill_loss"


def top1_agreement(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                   mask: Optional[torch.Tensor]) -> tuple[float, float]:
    """(agreeing predictions, predictions): per example for (B, C) logits, per real token for (B, N, V) logits."""
    same = (student_logits.argmax(-1) == teacher_logits.argmax(-1)).float()
    if same.dim() == 2 and mask is not None and mask.shape == same.shape:
        weights = mask.to(same.dtype)
        return float((same * weights).sum()), float(weights.sum())
    return float(same.sum()), float(same.numel())


class AgreementSums:
    """Sums over one evaluation, per process: distillation loss per batch, agreeing and all predictions."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.values = torch.zeros(4, dtype=torch.float64)  # distill sum, batches, agreeing, predictions

    def add(self, distill: torch.Tensor, agreement: Optional[tuple[float, float]]) -> None:
        agree, total = agreement if agreement is not None else (0.0, 0.0)
        self.values += torch.tensor([float(distill), 1.0, agree, total], dtype=torch.float64)

    def metrics(self, gather: Any, device: torch.device, prefix: str) -> dict[str, float]:
        """The metrics over every process (`gather` is the accelerator's), named with the caller's `prefix`."""
        total = gather(self.values.to(device=device, dtype=torch.float32)[None]).sum(dim=0).tolist()
        distill, batches, agree, predictions = total
        out = {}
        if batches > 0:
            out[f"{prefix}_{DISTILL}"] = distill / batches
        if predictions > 0:
            out[f"{prefix}_{AGREEMENT}"] = agree / predictions
        return out


class StoppingRecord(TrainerCallback):
    """At the end of training: which step `load_best_model_at_end` kept, by which metric, out of how many steps, in
    ``model.primal_conversion_report["training"]`` (the model card's "Conversion" section)."""

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            return
        record = {"steps_run": state.global_step, "best_step": None, "metric": None, "best_value": None}
        if args.load_best_model_at_end and getattr(state, "best_global_step", None):
            record.update(best_step=state.best_global_step, metric=args.metric_for_best_model,
                          best_value=state.best_metric)
        report = dict(getattr(model, "primal_conversion_report", None) or {})
        report["training"] = record
        model.primal_conversion_report = report
