"""Sharing primal models: Auto-class registration, remote code, model cards, saving converted folders."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import transformers
from torch import nn
from transformers import AutoConfig
from transformers.models.auto import modeling_auto
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from ..modeling.config import VERSION
from ..modeling.model_card import model_card
from ..models import ARCHITECTURES, BY_NAME, SOURCE_FILES, find_architecture, shareable_class

# The remote code of every shared folder: the whole `hf_primal.modeling` package, whose modules import only torch,
# transformers and each other (`from .x import`, which is what transformers' remote-code loader resolves).
_MODELING_DIR = Path(__file__).resolve().parents[1] / "modeling"
REMOTE_CODE_FILES = tuple(sorted(p.name for p in _MODELING_DIR.glob("*.py") if p.name != "__init__.py"))

# Auto classes whose mapping names a stock class of a registered architecture; the primal subclass is registered
# beside it.
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

_UNSET = object()


def _mapped_names(auto_name: str, arch: str) -> tuple[str, ...]:
    value = getattr(modeling_auto, _AUTO_MAPPINGS[auto_name], {}).get(arch)
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def hub_heads(arch: str) -> dict[str, type]:
    """Auto class name -> shareable primal class, for every Auto head transformers has for `arch` ("bert", ...).

    Derived from transformers' own Auto tables and the architecture's shareable classes, so a head transformers
    maps is never missed.
    """
    heads = {}
    by_name = {stock.__name__: primal for stock, primal in BY_NAME[arch].shareable_models.items()}
    for auto_name in _AUTO_MAPPINGS:
        # Where transformers maps several classes (DeiT: DeiTForImageClassification and ...WithTeacher), the first
        # is the one its Auto class builds; registering a later one would load a different head.
        primal = next((by_name[name] for name in _mapped_names(auto_name, arch) if name in by_name), None)
        if primal is not None:
            heads[auto_name] = primal
    return heads


def remote_module(arch: str) -> str:
    """Name of the module holding `arch`'s shareable classes in a saved folder (``modeling_primal_<arch>``)."""
    return f"modeling_primal_{arch}"


def hub_auto_map(arch: str) -> dict[str, str]:
    """The ``auto_map`` of a shareable `arch` folder: AutoConfig plus every Auto head, pointing at the remote code."""
    classes = {"AutoConfig": BY_NAME[arch].shareable_config, **hub_heads(arch)}
    return {auto: f"{remote_module(arch)}.{cls.__name__}" for auto, cls in classes.items()}


def write_remote_code(save_directory: str | os.PathLike, arch: str) -> list[str]:
    """Copy the modeling code of `arch` into `save_directory`, flat, so the folder loads with trust_remote_code.

    transformers' remote-code loader imports ``<module>.<Class>`` from the folder and follows only ``from .x import``
    lines between files of the same folder, so the architecture's module (hf_primal/models/<arch>.py, which imports
    the modeling package with ``from ..modeling.x import``) is written as ``modeling_primal_<arch>.py`` importing
    them with ``from .x import``, next to copies of `REMOTE_CODE_FILES`. Returns the file names written.
    """
    folder = Path(save_directory)
    written = []
    for name in REMOTE_CODE_FILES:
        (folder / name).write_text((_MODELING_DIR / name).read_text(encoding="utf-8"), encoding="utf-8")
        written.append(name)
    source = Path(SOURCE_FILES[arch]).read_text(encoding="utf-8")
    entry = f"{remote_module(arch)}.py"
    flat = re.sub(r"^from \.\.modeling\.(\w+) import", r"from .\1 import", source, flags=re.MULTILINE)
    (folder / entry).write_text(flat, encoding="utf-8")
    return written + [entry]


def register_auto_classes() -> None:
    """Let the Auto classes resolve the "primal_*" model types to this package's classes (no remote code needed)."""
    for architecture in ARCHITECTURES:
        config_class = architecture.shareable_config
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, primal in hub_heads(architecture.name).items():
            getattr(transformers, auto_name).register(config_class, primal, exist_ok=True)


def enable_remote_code(model: nn.Module) -> nn.Module:
    """Give `model` the shareable primal classes, in place.

    Afterwards ``save_pretrained`` / ``push_to_hub`` write ``config.json`` with ``model_type="primal_<arch>"`` and an
    ``auto_map`` naming every Auto head of the architecture, the modeling files, and a model card, so the folder
    loads with ``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` where hf_primal is not installed.
    (Plain ``save_pretrained`` of any primal model writes the same folder; see `save_shareable`.)
    """
    architecture = find_architecture(model)
    if getattr(model.config, "primal_attention", None) is None:
        raise ValueError(f"enable_remote_code: {type(model).__name__} has no primal attention layers to share.")
    primal = shareable_class(type(model))
    if primal is None:
        raise ValueError(
            f"enable_remote_code: no shareable primal class for {type(model).__name__}; supported: "
            + ", ".join(sorted(c.__name__ for c in architecture.shareable_models))
        )
    # No register_for_auto_class: transformers would copy the class's own module, which imports its siblings from
    # the parent package; `save_shareable` writes the flattened remote code instead.
    model.__class__ = primal
    model.config.__class__ = architecture.shareable_config
    model.config.auto_map = hub_auto_map(architecture.name)
    # transformers looks up which outputs (attentions, hidden states) a model can record by its class, registered
    # when a model is constructed; a class swapped in afterwards must be registered too, or output_attentions=True
    # returns no attentions.
    _CAN_RECORD_REGISTRY[model] = model._can_record_outputs
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
    architecture = find_architecture(model)
    config = model.config
    saved_class, saved_map = type(config), config.__dict__.get("auto_map", _UNSET)
    primal = shareable_class(type(model))
    # A spec that reached the model through a class-level default (e.g. `BertConfig.primal_attention = {...}`) must
    # be written and survive the class swap below (the shareable config class defaults it to None).
    config.__dict__["primal_attention"] = config.primal_attention
    config.__class__ = architecture.shareable_config
    config.auto_map = hub_auto_map(architecture.name)
    try:
        if not _is_main_process(args, kwargs):  # other ranks write nothing of their own
            return save(model, save_directory, *args, **kwargs)
        return _save_staged(model, save, save_directory, primal, args, kwargs)
    finally:
        config.__class__ = saved_class
        if saved_map is _UNSET:
            config.__dict__.pop("auto_map", None)
        else:
            config.__dict__["auto_map"] = saved_map


def _stamp_version(config_file: Path) -> None:
    """Record the writing hf_primal's version in config.json (`folder_check` names it when an older one refuses)."""
    data = json.loads(config_file.read_text(encoding="utf-8"))
    data["hf_primal_version"] = VERSION
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# Weight files a save replaces: what a previous save left of them is removed, as transformers' own save does.
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def _save_staged(model: nn.Module, save: Callable[..., Any], save_directory: str | os.PathLike, primal: Any,
                 args: tuple, kwargs: dict) -> Any:
    """Write the whole shareable folder into a staging folder beside `save_directory`, then move it in with
    config.json last: a save that fails part-way leaves the previous folder as it was (or no config.json, which
    loads as nothing), never a config that promises what the files do not hold."""
    target = Path(save_directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    config = model.config
    try:
        result = save(model, staging, *args, **kwargs)
        write_remote_code(staging, find_architecture(model).name)
        if type(model) is not primal:
            # Name the primal class in `architectures`: pipelines fall back to the transformers class named there
            # when the Auto class refuses to run remote code, which would build a broken softmax model.
            architectures = config.architectures
            if primal is not None:
                config.architectures = [primal.__name__]
            try:
                config.save_pretrained(staging)
                with open(staging / "README.md", "w", encoding="utf-8") as handle:
                    handle.write(model_card(model))
            finally:
                config.architectures = architectures
        _stamp_version(staging / "config.json")
        target.mkdir(exist_ok=True)
        written = {p.name for p in staging.iterdir()}
        for stale in target.iterdir():
            if stale.is_file() and _WEIGHT_FILE.match(stale.name) and stale.name not in written:
                stale.unlink()
        for name in sorted(written, key=lambda n: n == "config.json"):
            os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result
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
