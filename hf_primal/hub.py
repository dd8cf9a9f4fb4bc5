"""Sharing primal models: Auto-class registration, remote code, model cards, saving converted folders."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from torch import nn
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

from .modeling_primal import HUB_CONFIGS, HUB_MODELS, find_adapter, model_card

# Auto classes whose mapping names a stock BERT / ViT / GPT-2 class; the primal subclass is registered beside it.
_AUTO_MAPPINGS = {
    "AutoModel": "MODEL_MAPPING_NAMES",
    "AutoModelForPreTraining": "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "AutoModelForMultipleChoice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
    "AutoModelForNextSentencePrediction": "MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES",
    "AutoModelForImageClassification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForMaskedImageModeling": "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES",
    "AutoModelForTextEncoding": "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES",
}

# Auto classes that also map a head class's base model; a head prefers any other match.
_GENERIC_AUTO = ("AutoModel", "AutoModelForPreTraining", "AutoModelForTextEncoding")

_UNSET = object()


def _mapped_names(auto_name: str, arch: str) -> tuple[str, ...]:
    value = getattr(modeling_auto, _AUTO_MAPPINGS[auto_name], {}).get(arch)
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def hub_heads(arch: str) -> dict[str, type]:
    """Auto class name -> shareable primal class, for every Auto head transformers has for `arch` ("bert", ...).

    Derived from transformers' own Auto tables and `HUB_MODELS`, so a head transformers maps is never missed.
    """
    config_class = HUB_CONFIGS[arch]
    heads = {}
    for auto_name in _AUTO_MAPPINGS:
        names = _mapped_names(auto_name, arch)
        for stock, primal in HUB_MODELS.items():
            if primal.config_class is config_class and stock.__name__ in names:
                heads[auto_name] = primal
    return heads


def hub_auto_map(arch: str) -> dict[str, str]:
    """The ``auto_map`` of a shareable `arch` folder: AutoConfig plus every Auto head, pointing at the remote code."""
    classes = {"AutoConfig": HUB_CONFIGS[arch], **hub_heads(arch)}
    return {auto: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}" for auto, cls in classes.items()}


def auto_class_name(stock_class: type) -> Optional[str]:
    """The most specific Auto class that maps to `stock_class` (e.g. AutoModelForSequenceClassification)."""
    found = None
    for auto_name, mapping_name in _AUTO_MAPPINGS.items():
        mapping = getattr(modeling_auto, mapping_name, {})
        if stock_class.__name__ in mapping.values():
            found = auto_name if found in (None, *_GENERIC_AUTO) else found
    return found


def register_auto_classes() -> None:
    """Let the Auto classes resolve the "primal_*" model types to this package's classes (no remote code needed)."""
    import transformers

    for arch, config_class in HUB_CONFIGS.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, primal in hub_heads(arch).items():
            getattr(transformers, auto_name).register(config_class, primal, exist_ok=True)


def _stock_ancestor(model_class: type) -> Optional[type]:
    return next((c for c in model_class.__mro__ if c in HUB_MODELS), None)


def enable_remote_code(model: nn.Module) -> nn.Module:
    """Give `model` the shareable primal classes, in place.

    Afterwards ``save_pretrained`` / ``push_to_hub`` write ``config.json`` with ``model_type="primal_<arch>"`` and an
    ``auto_map`` naming every Auto head of the architecture, the modeling files, and a model card, so the folder
    loads with ``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` where hf_primal is not installed.
    (Plain ``save_pretrained`` of any primal model writes the same folder; see `save_shareable`.)
    """
    adapter = find_adapter(model)
    if getattr(model.config, "primal_attention", None) is None:
        raise ValueError(f"enable_remote_code: {type(model).__name__} has no primal attention layers to share.")
    stock = _stock_ancestor(type(model))
    if stock is None:
        raise ValueError(
            f"enable_remote_code: no shareable primal class for {type(model).__name__}; supported: "
            + ", ".join(sorted(c.__name__ for c in HUB_MODELS))
        )
    primal = HUB_MODELS[stock]
    config_class = HUB_CONFIGS[adapter.name]
    model.__class__ = primal
    model.config.__class__ = config_class
    primal.register_for_auto_class(auto_class_name(stock) or "AutoModel")
    config_class.register_for_auto_class("AutoConfig")
    model.config.auto_map = hub_auto_map(adapter.name)
    return model


def _is_main_process(args: tuple, kwargs: dict) -> bool:
    # save_pretrained(save_directory, is_main_process=True, ...): the flag may come positionally.
    return bool(kwargs.get("is_main_process", args[0] if args else True))


def save_shareable(model: nn.Module, save: Callable[..., Any], save_directory: str | os.PathLike, *args: Any,
                   **kwargs: Any) -> Any:
    """Run transformers' `save` (the stock ``save_pretrained``) on a primal model so that it writes the shareable form.

    The folder gets ``model_type="primal_<arch>"``, an ``auto_map`` with every Auto head, the remote-code files,
    ``architectures`` naming the primal class and a model card. A copy loaded where hf_primal is not imported then
    either runs the primal layers (``trust_remote_code=True``) or fails: with a stock model type transformers
    would build a softmax model and silently re-initialise the dropped value projections.

    The model itself is left as it was (its class, config class and ``auto_map`` are restored afterwards), so
    saving a checkpoint in the middle of training changes nothing about the run.
    """
    adapter = find_adapter(model)
    config = model.config
    hub_config = HUB_CONFIGS[adapter.name]
    # The config class carries the remote code: its save_pretrained copies modeling_primal.py and the flat
    # modules it imports next to config.json.
    hub_config.register_for_auto_class("AutoConfig")
    saved_class, saved_map = type(config), config.__dict__.get("auto_map", _UNSET)
    is_hub_class = type(model) in HUB_MODELS.values()
    config.__class__ = hub_config
    config.auto_map = hub_auto_map(adapter.name)
    try:
        result = save(model, save_directory, *args, **kwargs)
        if not is_hub_class and _is_main_process(args, kwargs):
            # Name the primal class in `architectures`: pipelines fall back to the transformers class named there
            # when the Auto class refuses to run remote code, which would build a broken softmax model.
            stock = _stock_ancestor(type(model))
            architectures = config.architectures
            if stock is not None:
                config.architectures = [HUB_MODELS[stock].__name__]
            try:
                config.save_pretrained(save_directory)
                with open(os.path.join(save_directory, "README.md"), "w", encoding="utf-8") as handle:
                    handle.write(model_card(model))
            finally:
                config.architectures = architectures
    finally:
        config.__class__ = saved_class
        if saved_map is _UNSET:
            config.__dict__.pop("auto_map", None)
        else:
            config.__dict__["auto_map"] = saved_map
    return result


def save_converted(
    model: nn.Module,
    save_directory: str | os.PathLike,
    processor: Any = None,
    **save_kwargs: Any,
) -> str:
    """Save a primal model as a self-contained folder: weights, config, remote code, model card, processor.

    `processor` is the tokenizer / image processor to save beside the weights (optional).
    """
    enable_remote_code(model)
    os.makedirs(save_directory, exist_ok=True)
    model.save_pretrained(save_directory, **save_kwargs)
    if processor is not None:
        processor.save_pretrained(save_directory)
    report = getattr(model, "primal_conversion_report", None)
    if report:
        with open(os.path.join(save_directory, "primal_conversion.json"), "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return str(save_directory)
