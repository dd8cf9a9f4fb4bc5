"""`PrimalTrainer`: `transformers.Trainer` plus eta * KSVD loss (docs/method.md, "The KSVD loss"), eta_kl * KL for
KEP-SVGP layers, an optional knowledge-distillation term from a teacher model, and a learning rate of its own for the
new primal parameters."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn
from transformers import Trainer

from ..integration.compat import check_trainer_instance
from ..modeling.architecture import primal_attention_modules
from ..modeling.config import PrimalAttentionConfig, loss_weight
from ..models import find_architecture
from .calibration import input_columns
from .loss import REDUCTIONS, clear_ksvd_terms, collect_ksvd_terms, kl_from_model, ksvd_from_terms, primal_model
from .resume import PrimalStateCallback, checkpoint_folder, restore_state
from .running_losses import LossSums
from .teacher_agreement import AgreementSums, StoppingRecord, top1_agreement
from .teacher_loss import check_nonnegative, model_inputs, prepare_teacher, resolve_target, student_teacher_loss

# Chosen by measurement: fine-tuning all-MiniLM-L6-v2 with its last layer primal on BBC News sentences (1 epoch,
# lr 1e-4) gave 81.49% accuracy with the primal parameters at 1x the learning rate and 81.40% at 10x, so the default
# keeps one learning rate (what Trainer users expect); `primal_learning_rate` sets another. Distillation, where the
# new parameters start from scratch against a fixed target, does better with its own higher rate (convert()).
PRIMAL_LR_MULTIPLIER = 1.0


def is_primal_parameter(name: str) -> bool:
    """Whether a parameter name belongs to a `PrimalCore` (W_e, W_r, Lambda, the head map), PEFT-wrapped or not."""
    return ".primal." in f".{name}"


@torch.no_grad()
def _loss_honours_num_items(model: nn.Module, inputs: dict) -> bool:
    """Whether `model`'s loss on `inputs` is divided by ``num_items_in_batch`` (transformers' ``self.loss_function``).

    Heads such as BertForSequenceClassification accept **kwargs (so Trainer believes their loss is already
    normalised over the accumulated batch) yet compute a plain per-batch mean; gradient accumulation then
    over-weights them by the number of accumulation steps. Measured, not read from the source: the loss with
    1 and with 2 items, in eval mode (no dropout); an honoured count halves it.
    """
    was_training = model.training
    model.eval()
    try:
        one, two = (model(**inputs, num_items_in_batch=n)["loss"].float() for n in (1, 2))
    finally:
        model.train(was_training)
        clear_ksvd_terms(model)
    return bool(torch.isfinite(one) and torch.allclose(one, 2 * two, rtol=1e-4, atol=1e-6)
                and not torch.allclose(one, two, rtol=1e-4, atol=1e-6))


def _declare_causal_lm_loss(model: Optional[nn.Module]) -> None:
    """Give ``*LMHeadModel`` heads (GPT-2, BERT as decoder) the ``loss_type`` their loss already is.

    Their class names match no entry of transformers' loss table, so ``loss_type`` stays None while
    ``loss_function`` falls back to the causal-LM loss. Trainer decides from ``loss_type`` whether labels are shifted
    when it counts ``num_items_in_batch``; with None it counts all N labels of a row although N - 1 are predicted,
    so a stock Trainer reports eval loss (and perplexity) too low by a factor (N - 1) / N.
    """
    if model is None:
        return
    inner = primal_model(model)
    if getattr(inner, "loss_type", "") is not None:
        return
    try:
        heads = find_architecture(inner).causal_lm_heads
    except ValueError:  # not a registered architecture: PrimalTrainer's own check reports it
        return
    if any(cls.__name__ in heads for cls in type(inner).__mro__):
        inner.loss_type = "ForCausalLM"


def _primal_spec(inner: nn.Module) -> dict:
    """The model's ``config.primal_attention``; refuses a model without primal attention layers."""
    spec = getattr(getattr(inner, "config", None), "primal_attention", None)
    if spec is None:
        raise ValueError(
            f"PrimalTrainer needs a model with primal attention layers; {type(inner).__name__} has no "
            "config.primal_attention. Build or load it with primal_attention=... first."
        )
    return spec


def _ksvd_settings(spec: dict, ksvd_weight: Optional[float], ksvd_reduction: Optional[str]) -> tuple[float, str]:
    """(eta, reduction) of the KSVD term: the arguments, else the model's defaults; each refused by name."""
    eta = PrimalAttentionConfig.coerce(spec).eta if ksvd_weight is None else ksvd_weight
    eta = loss_weight(eta, "PrimalTrainer: ksvd_weight")
    reduction = ksvd_reduction or spec.get("ksvd_reduction", "sequence")
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"PrimalTrainer: ksvd_reduction={reduction!r} is not allowed: use one of {list(REDUCTIONS)}."
        )
    return float(eta), reduction


def _refuse_reentrant_checkpointing(args: Any) -> None:
    """Refuse reentrant activation checkpointing: its no_grad forward would cut the KSVD term's gradient."""
    checkpointing = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    gc_kwargs = (
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    if checkpointing and gc_kwargs.get("use_reentrant", False):
        raise ValueError(
            "PrimalTrainer: activation (gradient) checkpointing with {'use_reentrant': True} is not supported: "
            "reentrant checkpointing runs the forward under no_grad, so the KSVD term would silently get no "
            "gradient. Use the default non-reentrant checkpointing."
        )


def _checked_primal_learning_rate(primal_learning_rate: Optional[float], learning_rate: float) -> float:
    """`primal_learning_rate` if given (a finite number > 0), else ``PRIMAL_LR_MULTIPLIER * learning_rate``."""
    if primal_learning_rate is None:
        return PRIMAL_LR_MULTIPLIER * learning_rate
    return check_nonnegative("PrimalTrainer: primal_learning_rate", primal_learning_rate, positive=True)


class PrimalTrainer(Trainer):
    """A `Trainer` that adds ``eta * ksvd_loss(model)`` to the task loss of models with primal layers.

    Args:
        ksvd_weight: eta; defaults to the model's ``primal_attention["eta"]``. ``0`` keeps the term in the graph
            (zero gradients) so that distributed training sees every parameter used.
        ksvd_reduction: ``"sequence"`` or ``"batch"``; defaults to the model's ``primal_attention["ksvd_reduction"]``.
        teacher: optional model to distil from while training (e.g. the stock model the primal one was converted
            from, or a stock model fine-tuned on the task). It runs in eval mode under ``no_grad`` on the same inputs,
            gets no gradient and is never saved in checkpoints; its ``requires_grad`` flags are left as they are, so
            a student deep-copied from it later trains like the first.
        distill_weight: weight of the distillation term (default 1.0 when a teacher is given).
        distill_temperature: softmax temperature of the logits KL term (the term is multiplied by T^2).
        distill_target: ``"logits"`` (KL between the heads' distributions), ``"hidden"`` (final hidden states and
            mean-pooled embeddings, for base / embedding models) or ``"auto"`` (logits when the model has a head).
        distill_dataset: optional unlabeled inputs (a `datasets.Dataset` with ``input_ids`` etc.; other columns are
            ignored) for the teacher: every training step also distils on one batch of it (same batch size and
            collator as training), which lets a few hundred labels go much further (docs/conversion.md).
        primal_learning_rate: learning rate of the new primal parameters (W_e, W_r, Lambda, head map), in a parameter
            group of their own; the default is ``args.learning_rate`` (measured: 10x gave no gain when fine-tuning a
            converted model). Override `create_optimizer` as with any Trainer for other groupings.
        All other arguments are those of `transformers.Trainer`.

    Models with KEP-SVGP layers (``variant="kep_svgp"``) also get ``eta_kl * KL`` (``primal_attention["eta_kl"]``), once
    per optimizer step whatever the gradient accumulation.

    Logs ``ksvd_loss``, ``task_loss`` (and ``distill_loss`` with a teacher, ``kl_loss`` with KEP-SVGP layers) at every
    logging step (so they reach ``state.log_history``, the progress bar and reporters such as TensorBoard) and
    ``eval_ksvd_loss`` at evaluation; with a teacher also ``eval_distill_loss`` and ``eval_teacher_agreement``
    (`teacher_agreement`), so that ``metric_for_best_model="teacher_agreement"``, ``load_best_model_at_end=True`` and
    ``EarlyStoppingCallback`` stop a conversion when the student stops getting closer to its teacher on held-out
    (even unlabeled) inputs; the kept step goes into ``model.primal_conversion_report["training"]`` and the card.
    """

    def __init__(
        self,
        *args: Any,
        ksvd_weight: Optional[float] = None,
        ksvd_reduction: Optional[str] = None,
        teacher: Optional[nn.Module] = None,
        distill_weight: Optional[float] = None,
        distill_temperature: float = 2.0,
        distill_target: str = "auto",
        primal_learning_rate: Optional[float] = None,
        distill_dataset: Any = None,
        **kwargs: Any,
    ):
        _declare_causal_lm_loss(kwargs["model"] if "model" in kwargs else (args[0] if args else None))
        super().__init__(*args, **kwargs)
        check_trainer_instance(self)
        spec = _primal_spec(primal_model(self.model))
        self.ksvd_weight, self.ksvd_reduction = _ksvd_settings(spec, ksvd_weight, ksvd_reduction)
        self.kl_weight = PrimalAttentionConfig.coerce(spec).eta_kl
        self._has_kl = PrimalAttentionConfig.coerce(spec).variant == "kep_svgp"
        _refuse_reentrant_checkpointing(self.args)
        self._num_items_checked = False
        if self.args.ddp_find_unused_parameters is None:
            # Every parameter gets a gradient each step (the KSVD term reaches Lambda even when eta == 0), so DDP
            # need not search the graph for unused ones.
            self.args.ddp_find_unused_parameters = False
        self._setup_teacher(teacher, distill_weight, distill_temperature, distill_target)
        if distill_dataset is not None and teacher is None:
            raise ValueError("PrimalTrainer: distill_dataset=... needs a teacher=... model to distil from.")
        self.distill_dataset = distill_dataset
        self._distill_loader = None
        self._distill_batches = iter(())
        self._distill_consumed = self._distill_skip = 0  # batches drawn; to draw again on resume (resume.py)
        self.add_callback(PrimalStateCallback(self))
        self.primal_learning_rate = _checked_primal_learning_rate(primal_learning_rate, self.args.learning_rate)
        self._loss_sums = LossSums()
        self._eval_ksvd: list[torch.Tensor] = []
        self._agreement = AgreementSums()
        if teacher is not None:
            self.add_callback(StoppingRecord())

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        restore_state(self, checkpoint_folder(resume_from_checkpoint, self.args.output_dir))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------ teacher and optimizer
    def _setup_teacher(self, teacher, weight, temperature, target) -> None:
        self.teacher = teacher
        if teacher is None:
            if weight not in (None, 0, 0.0):
                raise ValueError(f"PrimalTrainer: distill_weight={weight!r} needs a teacher=... model to distil from.")
            self.distill_weight = 0.0
            return
        weight = 1.0 if weight is None else weight
        self.distill_weight = check_nonnegative("PrimalTrainer: distill_weight", weight)
        self.distill_temperature = check_nonnegative("PrimalTrainer: distill_temperature", temperature, positive=True)
        self.distill_target = prepare_teacher(self.model, teacher, target, self.args.device)

    def create_optimizer(self, model=None):
        """Trainer's optimizer with one more parameter group: the primal parameters at `primal_learning_rate`."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        if not any(is_primal_parameter(n) for n, _ in named):
            return super().create_optimizer(model)
        decay = set(self.get_decay_parameter_names(opt_model))
        groups = [
            {"params": [p for n, p in named if not is_primal_parameter(n) and n in decay],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if not is_primal_parameter(n) and n not in decay], "weight_decay": 0.0},
            {"params": [p for n, p in named if is_primal_parameter(n)], "weight_decay": 0.0,
             "lr": self.primal_learning_rate},
        ]
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        own_groups = any(key in optimizer_kwargs for key in ("params", "model", "optimizer_dict"))
        if own_groups or not isinstance(optimizer_cls, type):
            raise ValueError(
                f"PrimalTrainer: optim={self.args.optim!r} builds its own parameter groups, "
                "so the primal learning rate cannot be applied; pass optimizers=(...) or override create_optimizer."
            )
        self.optimizer = optimizer_cls([g for g in groups if g["params"]], **optimizer_kwargs)
        return self.optimizer

    def _distill_term(self, model, inputs, outputs) -> torch.Tensor:
        teacher_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        with torch.no_grad():
            self.teacher.eval()
            teacher_out = self.teacher(**teacher_inputs, **self._student_extra(self.teacher))
        return student_teacher_loss(
            outputs, teacher_out, inputs.get("attention_mask"), self.distill_target, self.distill_temperature
        )

    def _student_extra(self, model) -> dict[str, bool]:
        # Models with a head (student or teacher) expose their final hidden states only on request.
        wants = self.distill_target == "hidden" and resolve_target(model, "auto") == "logits"
        return {"output_hidden_states": True} if wants else {}

    def _next_distill_batch(self) -> dict[str, torch.Tensor]:
        """The next batch of `distill_dataset` (reshuffled each pass, sharded across processes like training)."""
        if self._distill_loader is None:
            data = self.distill_dataset
            names = getattr(data, "column_names", None)
            if names is not None:
                keep = input_columns(names, "PrimalTrainer: distill_dataset")
                data = data.remove_columns([c for c in names if c not in keep])
            generator = torch.Generator().manual_seed(self.args.seed)
            loader = torch.utils.data.DataLoader(data, batch_size=self.args.per_device_train_batch_size, shuffle=True,
                                                 generator=generator, collate_fn=self.data_collator, drop_last=False)
            self._distill_loader = self.accelerator.prepare(loader)
        while True:
            batch = next(self._distill_batches, None)
            if batch is None:  # a new pass (the first, or after the last batch)
                self._distill_batches = iter(self._distill_loader)
                batch = next(self._distill_batches)
            self._distill_consumed += 1
            if self._distill_consumed > self._distill_skip:  # drawn before the checkpoint a run resumed from
                break
        return {k: v.to(self.args.device) for k, v in batch.items() if k not in ("labels", "label")}

    def _unlabeled_terms(self, model) -> tuple[torch.Tensor, torch.Tensor]:
        """(distillation, KSVD) terms of one `distill_dataset` batch: the student against the teacher."""
        inputs = self._next_distill_batch()
        outputs = model(**inputs, **self._student_extra(model))
        distill = self._distill_term(model, inputs, outputs)
        ksvd = ksvd_from_terms(collect_ksvd_terms(model), self.ksvd_reduction)
        clear_ksvd_terms(model)
        return distill, ksvd

    # ------------------------------------------------------------------ loss
    def _loss_is_scaled(self, num_items_in_batch) -> bool:
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool(
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._num_items_checked and model.training and num_items_in_batch is not None:
            # Once, at the first training step: Trainer passes num_items_in_batch to any head that takes **kwargs.
            self._num_items_checked = True
            if (self.model_accepts_loss_kwargs and self.loss_is_scaled_for_ga is None and "labels" in inputs
                    and not _loss_honours_num_items(model, inputs)):
                self.model_accepts_loss_kwargs = False
        distilling = self.teacher is not None and model.training
        if distilling:
            inputs = {**inputs, **self._student_extra(model)}
        task_loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        if not model.training:
            return (task_loss, outputs) if return_outputs else task_loss
        if distilling:
            inputs.pop("output_hidden_states", None)
            distill = self._distill_term(model, inputs, outputs)
        ksvd = ksvd_from_terms(collect_ksvd_terms(model), self.ksvd_reduction)
        if self.ksvd_weight > 0 and not ksvd.requires_grad and torch.is_grad_enabled() and task_loss.requires_grad:
            raise RuntimeError(
                "PrimalTrainer: the KSVD term has no gradient although the task loss has one (was the forward run "
                "under reentrant gradient checkpointing or no_grad?); refusing to train without the regulariser."
            )
        kl = kl_from_model(model)  # KEP-SVGP layers: parameters only, once per micro-batch (None without them)
        clear_ksvd_terms(model)
        # Trainer divides the returned loss by the accumulation steps unless it believes the loss is already
        # normalised over the accumulated batch; the KSVD term is a per-micro-batch mean, so scale it to match.
        scaled = self._loss_is_scaled(num_items_in_batch)
        steps = max(int(getattr(self, "current_gradient_accumulation_steps", 1) or 1), 1)
        factor = 1.0 / steps if scaled else 1.0
        loss = task_loss + (self.ksvd_weight * factor) * ksvd.to(task_loss.dtype)
        if kl is not None:
            loss = loss + (self.kl_weight * factor) * kl.to(task_loss.dtype)
            self._loss_sums.add("kl", kl)
        if distilling and self.distill_dataset is not None:
            unlabeled, unlabeled_ksvd = self._unlabeled_terms(model)
            distill, ksvd = distill + unlabeled, ksvd + unlabeled_ksvd
            loss = loss + (self.ksvd_weight * factor) * unlabeled_ksvd.to(task_loss.dtype)
        if distilling:
            loss = loss + (self.distill_weight * factor) * distill.to(task_loss.dtype)
            self._loss_sums.add("distill", distill)
        self._loss_sums.add("ksvd", ksvd)
        # What this micro-batch adds to the optimizer step's task loss, in the units Trainer logs "loss" in.
        self._loss_sums.add("task", task_loss * (1.0 if scaled else 1.0 / steps))
        self._loss_sums.micro_batches += 1
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        result = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        terms = [getattr(m, "ksvd_terms", None) for _, m in primal_attention_modules(model)]
        if terms and all(t is not None for t in terms):
            self._eval_ksvd.append(ksvd_from_terms(terms, self.ksvd_reduction).detach().float())
            clear_ksvd_terms(model)
        if self.teacher is not None:
            self._compare_with_teacher(model, inputs)
        return result

    @torch.no_grad()
    def _compare_with_teacher(self, model, inputs) -> None:
        """The held-out distillation term and top-1 agreement of one evaluation batch (`teacher_agreement`)."""
        inputs = model_inputs(inputs, self.args.device)
        student = model(**inputs, **self._student_extra(model))
        clear_ksvd_terms(model)
        self.teacher.eval()
        teacher = self.teacher(**inputs, **self._student_extra(self.teacher))
        distill = student_teacher_loss(student, teacher, inputs.get("attention_mask"), self.distill_target,
                                       self.distill_temperature)
        s_logits, t_logits = getattr(student, "logits", None), getattr(teacher, "logits", None)
        logits = self.distill_target == "logits" and s_logits is not None and t_logits is not None
        self._agreement.add(distill, top1_agreement(s_logits, t_logits, inputs.get("attention_mask")) if logits
                            else None)

    def evaluation_loop(self, *args, **kwargs):
        self._eval_ksvd, _ = [], self._agreement.reset()
        output = super().evaluation_loop(*args, **kwargs)
        # The caller's metric prefix, however it was passed (compat checks the parameter's name).
        bound = inspect.signature(Trainer.evaluation_loop).bind_partial(self, *args, **kwargs).arguments
        prefix = bound.get("metric_key_prefix", "eval")
        local = torch.stack(self._eval_ksvd).mean() if self._eval_ksvd else torch.tensor(float("nan"))
        value = self.accelerator.gather(local.to(self.args.device).reshape(1)).nanmean().item()
        if value == value:  # not NaN: at least one process saw primal layers run
            output.metrics[f"{prefix}_ksvd_loss"] = value
        if self.teacher is not None:
            output.metrics.update(self._agreement.metrics(self.accelerator.gather, self.args.device, prefix))
        self._eval_ksvd, _ = [], self._agreement.reset()
        return output

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs and self._loss_sums.micro_batches > 0:
            steps = max(int(getattr(self, "current_gradient_accumulation_steps", 1) or 1), 1)
            local = self._loss_sums.means(steps, self.args.device)
            ksvd, task, distill, kl = self.accelerator.gather(local[None]).mean(dim=0).tolist()
            logs["ksvd_loss"], logs["task_loss"] = round(ksvd, 6), round(task, 6)
            if self.teacher is not None:
                logs["distill_loss"] = round(distill, 6)
            if self._has_kl:
                logs["kl_loss"] = round(kl, 6)
            self._loss_sums.reset()
        super().log(logs, start_time)
