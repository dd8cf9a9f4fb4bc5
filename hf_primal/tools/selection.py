"""Which layers to make primal: a measured ranking of what each layer costs.

Converting a layer throws away what its softmax attention computed, and layers differ in how much the rest of the
network then has to make up for. `layer_sensitivity` measures it: for each attention layer alone, it makes that
layer primal in a copy of the model, distils the copy from the original for a few steps on calibration batches, and
records the held-out student-teacher loss. The cheapest layers are the ones to convert
(``convert(..., layers="auto", num_primal_layers=K)``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from ..modeling.architecture import base_model
from ..modeling.config import PrimalAttentionConfig
from ..models import find_architecture, swap_to_primal
from ..training.calibration import collect_batches
from ..training.distill import distill, frozen_copy

LAYER_CHOICES = ("auto", "last")


@dataclass(frozen=True)
class LayerCost:
    """What making one layer primal (alone) cost after a short distillation, on held-out calibration batches."""

    index: int
    layer: str
    loss_before: float  # right after the swap
    loss_after: float  # after the distillation steps (the ranking key)
    cosine_after: Optional[float]  # mean-pooled embedding cosine with the original, where measured


@dataclass(frozen=True)
class LayerSensitivity:
    """The measured cost of each attention layer, in layer order; `ranking` orders them cheapest first."""

    costs: tuple[LayerCost, ...]
    steps: int
    calibration_batches: int

    @property
    def ranking(self) -> list[int]:
        """Layer indices from the cheapest to convert to the most expensive (ties: the lower index first)."""
        return [c.index for c in sorted(self.costs, key=lambda c: (c.loss_after, c.index))]

    def cheapest(self, k: int) -> list[int]:
        """The `k` cheapest layers, in layer order."""
        check_num_layers(k, len(self.costs))
        return sorted(self.ranking[:k])

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "calibration_batches": self.calibration_batches, "ranking": self.ranking,
                "costs": [dataclasses.asdict(c) for c in self.costs]}


def check_num_layers(k: Any, num_layers: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_layers:
        raise ValueError(f"num_primal_layers={k!r} is not allowed: the model has {num_layers} attention layers, so "
                         f"it must be an integer in 1 .. {num_layers}.")
    return k


def layer_sensitivity(
    model: nn.Module,
    calibration_data: Any,
    config: Union[PrimalAttentionConfig, dict, None] = None,
    *,
    steps: int = 50,
    learning_rate: float = 5e-4,
    primal_learning_rate: float = 3e-3,
    distill_target: str = "hidden",
    pooled_weight: float = 10.0,
    batch_size: int = 8,
    max_batches: Optional[int] = None,
    seed: int = 0,
    progress: bool = True,
) -> LayerSensitivity:
    """Measure, for every attention layer of a stock `model`, what making that layer alone primal costs.

    Each layer in turn is made primal in a copy of `model` (with `config`'s s, m and eta; its ``layers`` are
    ignored) and distilled from the original for `steps` steps on the training part of `calibration_data`, exactly
    as ``convert(..., method="distill")`` does; the cost is the held-out distillation loss afterwards (every fifth
    batch is held out). `model` itself is not changed.

    Example::

        sensitivity = hf_primal.layer_sensitivity(model, hf_primal.text_batches(tokenizer, texts))
        sensitivity.ranking        # e.g. [0, 1, 2, 5, 3, 4]: layer 0 is the cheapest to convert
        sensitivity.cheapest(3)    # the three layers `convert(..., layers="auto", num_primal_layers=3)` picks
    """
    if getattr(model.config, "primal_attention", None) is not None:
        raise ValueError("layer_sensitivity: the model already has primal layers; measure a stock model.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"layer_sensitivity: steps={steps!r} is not allowed: it must be an integer >= 1.")
    spec = PrimalAttentionConfig.coerce(config if config is not None else PrimalAttentionConfig())
    architecture = find_architecture(model)
    base, prefix = base_model(model)
    names = [prefix + name for name, _ in architecture.list_layers(base)]
    batches = collect_batches(calibration_data, batch_size, max_batches)
    teacher = frozen_copy(model)
    causal = architecture.causal(model.config)
    costs = []
    for index in tqdm(range(len(names)), desc="layer sensitivity", disable=not progress):
        torch.manual_seed(seed)  # the same primal initialisation draw for every layer
        candidate = copy.deepcopy(model)
        swap_to_primal(candidate, dataclasses.replace(spec, layers=[index]))
        # Held out once before and once after (not along the way): the cost of a layer is where its short
        # distillation ends, and a ranking of L layers stays L short distillations.
        result = distill(candidate, teacher, batches, steps=steps, learning_rate=learning_rate,
                         primal_learning_rate=primal_learning_rate, target=distill_target,
                         pooled_weight=pooled_weight, seed=seed, progress=False, causal=causal, eval_every=steps)
        costs.append(LayerCost(index, names[index], result.loss_before, result.loss_after, result.cosine_after))
        del candidate
    return LayerSensitivity(tuple(costs), steps, len(batches))


def choose_layers(
    model: nn.Module,
    spec: PrimalAttentionConfig,
    calibration_data: Any,
    layers: Union[str, list, None],
    num_primal_layers: Optional[int],
    **sensitivity_kwargs: Any,
) -> tuple[PrimalAttentionConfig, Optional[LayerSensitivity]]:
    """`convert`'s ``layers=`` / ``num_primal_layers=`` options: the spec with the layers to convert.

    ``"auto"`` converts the `num_primal_layers` cheapest layers by `layer_sensitivity` on `calibration_data`;
    ``"last"`` the last `num_primal_layers`; a list or ``"all"`` is used as given. None keeps ``spec.layers``.
    """
    if layers is None and num_primal_layers is None:
        return spec, None
    num_layers = len(find_architecture(model).list_layers(base_model(model)[0]))
    if isinstance(layers, str) and layers in LAYER_CHOICES:
        k = check_num_layers(num_primal_layers, num_layers)
        if layers == "last":
            return dataclasses.replace(spec, layers=list(range(num_layers - k, num_layers))), None
        if calibration_data is None:
            raise ValueError("convert: layers='auto' measures each layer on calibration_data; none was given.")
        sensitivity = layer_sensitivity(model, calibration_data, spec, **sensitivity_kwargs)
        return dataclasses.replace(spec, layers=sensitivity.cheapest(k)), sensitivity
    if num_primal_layers is not None:
        raise ValueError(f"convert: num_primal_layers={num_primal_layers!r} needs layers='auto' or 'last'; got "
                         f"layers={layers!r}.")
    if layers is None:
        return spec, None
    if isinstance(layers, str) and layers != "all":
        raise ValueError(f"convert: layers={layers!r} is not allowed: use 'auto' or 'last' (with num_primal_layers), "
                         "'all', or a list of layer indices.")
    return dataclasses.replace(spec, layers=layers), None
