"""Sharing primal models: Auto-class registration, remote code, model cards, saving converted folders."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from torch import nn
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

from .modeling_primal import HUB_CONFIGS, HUB_MODELS, find_adapter

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
}


_BASE_MODELS = {"bert": "PrimalBertModel", "vit": "PrimalViTModel", "gpt2": "PrimalGPT2Model"}


def auto_class_name(stock_class: type) -> Optional[str]:
    """The most specific Auto class that maps to `stock_class` (e.g. AutoModelForSequenceClassification)."""
    found = None
    for auto_name, mapping_name in _AUTO_MAPPINGS.items():
        mapping = getattr(modeling_auto, mapping_name, {})
        if stock_class.__name__ in mapping.values():
            found = auto_name if found in (None, "AutoModel", "AutoModelForPreTraining") else found
    return found


def register_auto_classes() -> None:
    """Let the Auto classes resolve the "primal_*" model types to this package's classes (no remote code needed)."""
    import transformers

    for arch, config_class in HUB_CONFIGS.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for stock, primal in HUB_MODELS.items():
        config_class = primal.config_class
        for auto_name, mapping_name in _AUTO_MAPPINGS.items():
            if stock.__name__ in getattr(modeling_auto, mapping_name, {}).values():
                getattr(transformers, auto_name).register(config_class, primal, exist_ok=True)


def enable_remote_code(model: nn.Module) -> nn.Module:
    """Give `model` the shareable primal classes, in place.

    Afterwards ``save_pretrained`` / ``push_to_hub`` write ``config.json`` with ``model_type="primal_<arch>"`` and an
    ``auto_map``, the modeling files, and a model card, so the folder loads with
    ``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` where hf_primal is not installed.
    """
    adapter = find_adapter(model)
    if getattr(model.config, "primal_attention", None) is None:
        raise ValueError(f"enable_remote_code: {type(model).__name__} has no primal attention layers to share.")
    stock = next((c for c in type(model).__mro__ if c in HUB_MODELS), None)
    if stock is None:
        raise ValueError(
            f"enable_remote_code: no shareable primal class for {type(model).__name__}; supported: "
            + ", ".join(sorted(c.__name__ for c in HUB_MODELS))
        )
    primal = HUB_MODELS[stock]
    config_class = HUB_CONFIGS[adapter.name]
    model.__class__ = primal
    model.config.__class__ = config_class
    auto_name = auto_class_name(stock) or "AutoModel"
    primal.register_for_auto_class(auto_name)
    config_class.register_for_auto_class("AutoConfig")
    auto_map = dict(getattr(model.config, "auto_map", None) or {})
    auto_map.setdefault("AutoModel", f"modeling_primal.{_BASE_MODELS[adapter.name]}")
    model.config.auto_map = auto_map
    return model


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
