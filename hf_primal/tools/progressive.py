"""`progressive_conversion`: convert a model's attention layers a few at a time, with training in between.

Converting every layer at once leaves no softmax layer to make up for the others. Converted in stages, each stage
starts from a network that has already adapted to the stages before it; on all-MiniLM-L6-v2 with every layer primal
it tied for the best validation accuracy of the options measured (docs/conversion.md).
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

from torch import nn

from ..modeling.architecture import base_model
from ..modeling.config import PrimalAttentionConfig
from .conversion_arguments import ConversionArguments
from .convert import _check_model, convert

Stage = Union[int, Sequence[int]]


def _stages(count: int, order: Sequence[Stage]) -> list[list[int]]:
    """`order` as lists of non-negative indices of `count` layers; refuses an empty order or stage, a bad index, a
    repeat."""
    if isinstance(order, (int, str)) or not isinstance(order, Sequence) or not order:
        raise ValueError(f"progressive_conversion: order={order!r} is not allowed: give a non-empty list of layer "
                         f"indices or lists of them (the model has {count} layers, 0..{count - 1} or -1..-{count}).")
    stages, seen = [], set()
    for stage in order:
        indices = list(stage) if isinstance(stage, Sequence) and not isinstance(stage, str) else [stage]
        resolved = []
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, numbers.Integral):
                raise ValueError(f"progressive_conversion: {index!r} in order={list(order)!r} is not allowed: a "
                                 "stage is a layer index (int) or a list of them.")
            index = int(index)
            if not -count <= index < count:
                raise ValueError(f"progressive_conversion: layer {index} in order={list(order)!r} is not allowed: "
                                 f"the model has {count} layers (0..{count - 1} or -1..-{count}).")
            if index % count in seen:
                raise ValueError(f"progressive_conversion: layer {index!r} appears twice in order={list(order)!r}; "
                                 "each layer is converted once.")
            seen.add(index % count)
            resolved.append(index % count)
        if not resolved:
            raise ValueError(f"progressive_conversion: order={list(order)!r} has an empty stage.")
        stages.append(resolved)
    return stages


def progressive_conversion(
    model: nn.Module,
    config: Union[PrimalAttentionConfig, Mapping[str, Any], None] = None,
    *,
    order: Sequence[Stage],
    calibration_data: Any = None,
    args: Optional[ConversionArguments] = None,
    progress: bool = True,
    **options: Any,
) -> Iterator[nn.Module]:
    """Yield copies of `model` with more of its layers primal at each stage; train each before asking for the next.

    Stage i converts a fresh copy of `model` at the layers of stages 0..i (with `convert`), then loads into it every
    weight of the model yielded at stage i - 1, as the caller left it: everything trained so far carries over, and
    only the primal weights of the newly converted layers start as `convert` makes them. `model` itself is never
    changed, so it can be the teacher throughout. The last model yielded is the result: train it to the end (for
    instance under a stopping rule), then save or share it like any converted model; its conversion report
    records the stages under ``"progressive"``.

    Args:
        model: a loaded stock model of a registered architecture (a fine-tuned task model, typically).
        config: the primal layers' settings (`PrimalAttentionConfig` or dict) without `layers`: `order` gives them.
        order: the stages, first converted first: layer indices (negative counts from the top), or lists of them
            for several layers in one stage; each layer at most once. For instance the ranking of
            `layer_sensitivity` (cheapest first), or ``range(n - 1, -1, -1)`` for the top layer first.
        calibration_data, args, progress, **options: as for `convert`, applied at each stage (not `layers` or
            `num_primal_layers`). With calibration data each stage's fresh copy is adapted before the weights of the
            stage before are loaded into it, so only the new layers' primal weights keep what it fitted: a warm
            start of the new layers (``method="transfer"`` fits each to its softmax layer's outputs). The
            conversion report keeps the method and the data, not the figures of that copy.

    Example:
        >>> import torch, hf_primal
        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> teacher = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=3,
        ...     num_attention_heads=4, intermediate_size=64, vocab_size=100)).eval()
        >>> for student in hf_primal.progressive_conversion(teacher, {"low_rank": 4}, order=[2, 1, 0],
        ...                                                  progress=False):
        ...     pass  # train `student` here, e.g. with PrimalTrainer(model=student, teacher=teacher, ...)
        >>> student.config.primal_attention["layers"], student.primal_conversion_report["progressive"]
        ([0, 1, 2], [[2], [1], [0]])
    """
    arguments = ConversionArguments.from_keywords(args, options)  # a bad option fails here, at the call
    for name in ("layers", "num_primal_layers"):
        if getattr(arguments, name) is not None:
            raise ValueError(f"progressive_conversion: {name}={getattr(arguments, name)!r} is not allowed here: the "
                             "layers come from `order`.")
    spec, architecture = _check_model(model, config)  # convert's refusals (unsupported, already primal), at the call
    if isinstance(config, Mapping) and "layers" in config or spec.layers != PrimalAttentionConfig().layers:
        raise ValueError(f"progressive_conversion: config layers={spec.layers!r} is not allowed: the layers come "
                         "from `order`; leave them out of the config.")
    stages = _stages(len(architecture.list_layers(base_model(model)[0])), order)
    return _converted_stages(model, spec, stages, dict(calibration_data=calibration_data, args=arguments,
                                                       progress=progress))


def _converted_stages(model: nn.Module, spec: PrimalAttentionConfig, stages: list[list[int]],
                      convert_options: dict[str, Any]) -> Iterator[nn.Module]:
    previous, done = None, []
    for i, stage in enumerate(stages):
        done += stage
        current = convert(copy.deepcopy(model), dataclasses.replace(spec, layers=sorted(done)), **convert_options)
        if previous is not None:
            missing, _ = current.load_state_dict(previous.state_dict(), strict=False)
            fresh = [name for name in missing if ".primal." not in name]
            if fresh:  # anything but the new layers' primal weights must come from the stage before
                raise RuntimeError(f"progressive_conversion: weights not carried over from the previous stage: "
                                   f"{fresh[:5]}")
        # The adapted copy's figures do not describe the model yielded (its weights were replaced): keep what was done.
        report = {key: value for key, value in (getattr(current, "primal_conversion_report", None) or {}).items()
                  if key in ("method", "calibration")}
        report["progressive"] = [list(s) for s in stages[: i + 1]]
        current.primal_conversion_report = report
        previous = current
        yield current
