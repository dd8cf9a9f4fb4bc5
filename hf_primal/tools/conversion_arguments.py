"""`ConversionArguments`: every option of `convert()` in one documented, validated object.

Grouped the way transformers groups `TrainingArguments`: build it once, check it once, pass it around; `convert`
still takes each option as a keyword (``convert(model, spec, data, steps=150)``), which builds the same object.

    from hf_primal import ConversionArguments, convert

    options = ConversionArguments(method="distill", steps=150, layers="auto", num_primal_layers=2)
    model = convert(model, {"low_rank": 30}, batches, options)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..training.teacher_loss import TARGETS as DISTILL_TARGETS

METHODS = ("transfer", "distill")
TARGETS = ("layer", "attention")
# The learning rate of the pretrained weights when none is given, per method.
DEFAULT_LEARNING_RATE = {"distill": 5e-4, "transfer": 3e-3}


@dataclass(frozen=True)
class ConversionArguments:
    """How `convert()` chooses the layers and adapts the converted model.

    Args:
        method: ``"distill"`` (distillation of the whole model from a frozen copy of the original; recommended) or
            ``"transfer"`` (layer-wise attention transfer).
        steps: optimizer steps: of distillation in all (default: 4 passes over the training batches), or of
            attention transfer per converted layer (default 300).
        learning_rate: AdamW learning rate of the pretrained weights in distillation, or Adam learning rate of
            attention transfer (default: `DEFAULT_LEARNING_RATE` of the method, 5e-4 / 3e-3).
        primal_learning_rate: learning rate of the new primal parameters in distillation.
        pooled_weight: with ``distill_target="hidden"``, weight of ``1 - cosine`` of the mean-pooled embeddings next to
            the token-level relative error (weight 1). The defaults were chosen on held-out data
            (scripts/benchmarks/conversion.py).
        distill_target: what distillation matches: ``"hidden"`` (the final hidden states and mean-pooled embeddings,
            which fixes what any head computes from them, including a head that was just initialised), ``"logits"``
            (KL of the head's softened distributions, with `temperature`; for pretrained heads) or ``"auto"`` (logits
            for models with a head, hidden states for base models).
        temperature: softmax temperature of the logits KL term.
        layers: which layers to convert, overriding the config's ``layers``: ``"auto"`` (the `num_primal_layers`
            cheapest, ranked by `hf_primal.layer_sensitivity` on the calibration data with `sensitivity_steps`
            distillation steps per layer; the ranking goes into the report and the model card), ``"last"`` (the last
            `num_primal_layers`), ``"all"`` or a list of indices; None keeps the config's (checked against the
            model's layers by `convert`).
        num_primal_layers: with ``layers="auto"`` or ``"last"``, how many layers to convert.
        sensitivity_steps: distillation steps per layer when ``layers="auto"`` measures the layers.
        batch_size: batch size when the calibration data is a `datasets.Dataset`.
        max_batches: use at most this many calibration batches.
        train_qk: with ``target="attention"``, also fit the q/k projections.
        target: ``"layer"`` fits each converted transformer block (attention + MLP + norms) to the stock block's
            output; ``"attention"`` only the primal attention module (plus q/k) to the softmax module's output.
    """

    method: str = "distill"
    steps: Optional[int] = None
    learning_rate: Optional[float] = None
    primal_learning_rate: float = 3e-3
    pooled_weight: float = 10.0
    distill_target: str = "hidden"
    temperature: float = 2.0
    layers: Union[str, list[int], None] = None
    num_primal_layers: Optional[int] = None
    sensitivity_steps: int = 50
    batch_size: int = 8
    max_batches: Optional[int] = None
    train_qk: bool = True
    target: str = "layer"

    def __post_init__(self) -> None:
        for name, allowed in (("method", METHODS), ("target", TARGETS), ("distill_target", DISTILL_TARGETS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"convert: {name}={getattr(self, name)!r} is not allowed: use one of {list(allowed)}.")
        # num_primal_layers is checked against the model's layer count where the layers are chosen (selection.py).
        for name in ("steps", "max_batches", "batch_size", "sensitivity_steps"):
            value, least = getattr(self, name), 0 if name in ("steps", "sensitivity_steps") else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"convert: {name}={value!r} must be an integer >= {least}.")
        for name in ("learning_rate", "primal_learning_rate", "pooled_weight", "temperature"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < float("inf") or (value == 0 and name != "pooled_weight")):
                raise ValueError(f"convert: {name}={value!r} must be a finite number > 0"
                                 f"{' (or 0)' if name == 'pooled_weight' else ''}.")

    @property
    def adapt_learning_rate(self) -> float:
        """`learning_rate`, or the method's default."""
        return self.learning_rate if self.learning_rate is not None else DEFAULT_LEARNING_RATE[self.method]

    @classmethod
    def from_keywords(cls, options: Optional[ConversionArguments], keywords: dict[str, Any]) -> ConversionArguments:
        """`options` with `keywords` (convert's keyword form) applied; unknown names are refused, naming the known."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise TypeError(f"convert() got unexpected keyword argument(s) {unknown}; the options are "
                            f"{sorted(known)} (hf_primal.ConversionArguments)")
        return dataclasses.replace(options or cls(), **keywords)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
