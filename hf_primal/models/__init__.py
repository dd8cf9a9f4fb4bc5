"""The architecture registry: every architecture hf_primal supports, one module each.

To add one, write ``hf_primal/models/<model_type>.py`` (one `shareable.define_architecture` call naming the stock
classes, an `architecture.Layout` or a preset of it, and what differs from the record's defaults; see bert.py) and list
the module in `_MODULES` below. Everything else (model detection, conversion, LoRA targets, shareable classes and
Auto registration, remote code) reads the records; `swap_to_primal` is the in-place swap every conversion starts
with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..modeling.architecture import Architecture, base_model, convert_layers, ignore_on_load
from ..modeling.config import PrimalAttentionConfig
from . import bert, deit, distilbert, gpt2, roberta, vit

_MODULES = (bert, vit, gpt2, roberta, distilbert, deit)

ARCHITECTURES: tuple[Architecture, ...] = tuple(module.ARCHITECTURE for module in _MODULES)
BY_NAME: dict[str, Architecture] = {a.name: a for a in ARCHITECTURES}
# The module each architecture's record lives in (hf_primal/integration/hub.py copies it next to shared checkpoints).
SOURCE_FILES: dict[str, str] = {module.ARCHITECTURE.name: module.__file__ for module in _MODULES}

SUPPORTED_ARCHITECTURES = ", ".join(
    f"{a.name} ({', '.join(sorted(stock.__name__ for stock in a.shareable_models))})" for a in ARCHITECTURES
)


def find_architecture(model: nn.Module) -> Architecture:
    """The registered architecture of `model`; ValueError naming the supported ones otherwise."""
    for architecture in ARCHITECTURES:
        if isinstance(model, architecture.base_class):
            return architecture
    config = getattr(model, "config", None)
    raise ValueError(
        f"Primal-Attention does not support {type(model).__name__} (model_type="
        f"{getattr(config, 'model_type', None)!r}); supported architectures: {SUPPORTED_ARCHITECTURES}."
    )


def architecture_for_config(config: Any) -> Architecture | None:
    """The registered architecture of models built from `config` (by ``model_type``; a saved primal folder's
    ``primal_<name>`` included), or None."""
    model_type = getattr(config, "model_type", None) or ""
    return BY_NAME.get(model_type.removeprefix("primal_"))


def apply_primal_attention(model: nn.Module, primal_config: Any = None) -> list[str]:
    """Make the layers selected by ``model.config.primal_attention`` (or `primal_config`) primal, in place.

    Returns the regexes of checkpoint keys the primal layers no longer have (value projections).
    """
    return convert_layers(model, find_architecture(model), primal_config)


def swap_to_primal(model: nn.Module, spec: PrimalAttentionConfig) -> None:
    """Make the layers of `spec` primal in place, as a conversion does (value projections dropped).

    `PrimalCore` initialised W_e, W_r and Lambda when it was built (docs/method.md, "Initialisation"); its head map
    gets the model's own Linear initialisation, as the load-time hook `_init_weights` would give it.
    """
    model.config.primal_attention = spec.to_dict()
    ignore_on_load(model, apply_primal_attention(model))
    std = getattr(model.config, "initializer_range", 0.02)
    layers = find_architecture(model).list_layers(base_model(model)[0])
    for index in spec.resolve_layers(len(layers)):
        core = layers[index][1].primal
        with torch.no_grad():
            core.head_map.weight.normal_(0.0, std)
            core.head_map.bias.zero_()


def shareable_class(model_class: type) -> type | None:
    """The shareable ``Primal*`` class for `model_class` (a stock class, a subclass of one, or a shareable class)."""
    for cls in model_class.__mro__:
        for architecture in ARCHITECTURES:
            if cls in architecture.shareable_models:
                return architecture.shareable_models[cls]
    return None


def drop_value_renamings(model: nn.Module, conversions: list) -> list:
    """`conversions` without the renaming rules that target only value projections `model` does not have.

    Primal layers drop their value projections; once every layer of a ViT is primal, a rule such as
    ``attention.value -> v_proj`` renames nothing, on load or in reverse on save. transformers' check that each
    rule of a model matches one of its serialized keys (``test_reverse_loading_mapping``) would flag it, so it
    is left out for such a model only; with any softmax layer left the rule still applies.
    """
    spec = getattr(getattr(model, "config", None), "primal_attention", None)
    if spec is None or not conversions:
        return conversions
    try:
        own = find_architecture(model).value_attr  # this model's value projection, not every architecture's
    except ValueError:
        return conversions
    value_attrs = {own} if own else set()
    keys = None
    kept = []
    for transform in conversions:
        targets = list(getattr(transform, "target_patterns", None) or [])
        renames_values = type(transform).__name__ == "WeightRenaming" and targets and all(
            "\\" not in target and value_attrs & set(target.strip(".").split(".")) for target in targets
        )
        if renames_values:
            keys = list(model.state_dict()) if keys is None else keys
            if not any(target in key for target in targets for key in keys):
                continue
        kept.append(transform)
    return kept
