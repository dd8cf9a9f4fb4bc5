"""Making attention layers primal, in place: what an architecture module declares and the converter that reads it.

Each file in hf_primal/models/ describes one transformers architecture with an `Architecture` record (a `Layout`,
often a shared preset, plus classes and rules); the registry (hf_primal/models/__init__.py) collects them.
`convert_layers` swaps the ``__class__`` of each selected stock attention module to the architecture's ``Primal*``
subclass, attaches a `PrimalCore` as ``.primal`` and deletes the value projection. q/k and output-projection
parameters keep their stock names, so ordinary checkpoints load into them unchanged.

Imports only torch, transformers and flat hf_primal modules: copied next to shared checkpoints as remote code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from .config import PrimalAttentionConfig, resolve_layer_indices
from .kep_svgp import KEPSVGPCore
from .primal import PrimalCore
from .sampling import num_sampled_tokens


@dataclass(frozen=True)
class Layout:
    """Where an architecture keeps its attention modules and what their parts are called.

    Architectures that share a module layout share one of the presets below (`BERT_LAYOUT`, `VIT_LAYOUT`).

    Attributes:
        blocks: where the transformer blocks are in the base model (``"encoder.layer"``: ``base.encoder.layer[i]``).
        attention: where the attention module is in a block (``"attention.self"``).
        heads_attr, head_dim_attr: the attention module's attributes holding the head count and head dimension.
        qk_names: the submodules that compute q and k (LoRA targets; fitted with ``convert(train_qk=True)``).
        out_name: the output projection the primal forward applies inside the attention module (None: it lives
            outside, as BERT's ``BertSelfOutput.dense``); kept from the stock layer.
        value_attr: the value projection that primal layers delete (None: kept, e.g. GPT-2's fused ``c_attn``).
        legacy_value_keys: regexes (``{i}`` = layer index) of older checkpoint names of the value projection, which a
            primal layer does not load either.
    """

    blocks: str
    attention: str
    heads_attr: str
    head_dim_attr: str
    qk_names: tuple
    out_name: Optional[str]
    value_attr: Optional[str]
    legacy_value_keys: tuple = ()


# BERT and RoBERTa: query / key / value linears in ``encoder.layer.N.attention.self``; the output projection
# (``BertSelfOutput.dense``) is a sibling module, outside the attention module.
BERT_LAYOUT = Layout(blocks="encoder.layer", attention="attention.self", heads_attr="num_attention_heads",
                     head_dim_attr="attention_head_size", qk_names=("query", "key"), out_name=None, value_attr="value")
# ViT and DeiT: q_proj / k_proj / v_proj / o_proj in ``layers.N.attention``. The legacy keys are checkpoints in
# transformers' older ViT naming, and a key every ViT renaming rule but the value one rewrites (that rule is dropped
# once every layer is primal, see models.drop_value_renamings).
VIT_LAYOUT = Layout(blocks="layers", attention="attention", heads_attr="num_attention_heads", head_dim_attr="head_dim",
                    qk_names=("q_proj", "k_proj"), out_name="o_proj", value_attr="v_proj",
                    legacy_value_keys=(r"encoder\.layer\.{i}\.attention\.attention\.value\.",
                                       r"layers\.{i}\.attention\.attention\.value\."))


def position_table(config: Any) -> int:
    """N_max of a text model whose position embeddings number its tokens from 0 (the `Architecture` default)."""
    return config.max_position_embeddings


def patch_tokens(config: object, extra: int) -> int:
    """Tokens a vision transformer sees at its configured image size: patches plus `extra` special tokens."""
    image = config.image_size if isinstance(config.image_size, int) else max(config.image_size)
    patch = config.patch_size if isinstance(config.patch_size, int) else min(config.patch_size)
    return (image // patch) ** 2 + extra


def never_causal(config: Any) -> bool:
    """Encoder-only attention (the `Architecture` default)."""
    return False


def cross_attention_when_added(config: Any) -> bool:
    """Softmax cross-attention beside the converted self-attention, as transformers adds it to BERT / GPT-2 decoders
    (``config.add_cross_attention``; the `Architecture` default)."""
    return bool(getattr(config, "add_cross_attention", False))


def causal_when_decoder(config: Any) -> bool:
    """BERT-like models: causal when built as a decoder (``config.is_decoder``)."""
    return bool(config.is_decoder)


@dataclass(frozen=True, kw_only=True)
class Architecture(Layout):
    """Everything hf_primal needs to know about one transformers architecture: its `Layout` and the fields below.

    Built by `shareable.define_architecture`, which also defines the classes it names; only `max_tokens`, `causal`,
    `lora_fan_in_fan_out`, `causal_lm_heads` and `cross_attention` have defaults, so an architecture module states
    just where it differs.

    Attributes:
        name: transformers' ``model_type`` ("bert"); the shareable form is saved as ``"primal_<name>"``.
        base_class: the architecture's ``*PreTrainedModel``; a model is of this architecture when it is an instance.
        attention_class: the stock attention module that becomes primal.
        primal_class: its ``Primal*`` subclass (usually `layers.PrimalProjectedAttention` first, no code of its own).
        shareable_config: the ``Primal*Config`` subclass with model_type ``primal_<name>`` (shareable.py).
        shareable_models: stock model class -> its shareable ``Primal*`` subclass, for every head.
        max_tokens: config -> N_max, the longest input (p = min(N_max, s * m), docs/method.md "Non-causal layer");
            by default the position table.
        causal: config -> whether the attention is causal (decoders: prefix means and a generation cache); by
            default never.
        lora_fan_in_fan_out: PEFT's flag for q/k modules that store their weights transposed (Conv1D).
        causal_lm_heads: names of the architecture's causal-LM head classes whose name transformers' loss table
            does not recognise (``GPT2LMHeadModel``), so their ``loss_type`` stays None although their loss is the
            causal-LM loss; `PrimalTrainer` declares it for them.
        cross_attention: config -> whether the model also has softmax attention that hf_primal never converts
            (cross-attention); by default ``config.add_cross_attention``.
    """

    name: str
    base_class: type
    attention_class: type
    primal_class: type
    shareable_config: type
    shareable_models: dict
    max_tokens: Callable[[Any], int] = position_table
    causal: Callable[[Any], bool] = never_causal
    lora_fan_in_fan_out: bool = False
    causal_lm_heads: tuple = ()
    cross_attention: Callable[[Any], bool] = cross_attention_when_added

    def __post_init__(self) -> None:
        # The shareable classes convert in their own post_init (also as remote code, without the registry), and the
        # primal attention forward reads its q/k/out names here, so each class knows its architecture.
        for cls in (self.primal_class, *self.shareable_models.values()):
            cls._primal_architecture = self

    def attends_only_through_primal(self, config: Any) -> bool:
        """Whether every attention module of a model built from `config` runs Primal-Attention: its
        ``primal_attention`` selects all ``config.num_hidden_layers`` layers and the model has no cross-attention.

        Such a model reads nothing from an attention mask but which tokens are real, so it can be given the (batch,
        keys) padding mask instead of a (batch, 1, queries, keys) one (hf_primal/integration/masks.py).
        """
        spec = getattr(config, "primal_attention", None)
        count = getattr(config, "num_hidden_layers", None)
        if spec is None or not isinstance(count, int) or self.cross_attention(config):
            return False
        # Read the stored selection as it is (a plain dict once hf_primal normalised the config): this runs at every
        # forward, also under torch.compile, which cannot trace building a PrimalAttentionConfig.
        layers = spec.get("layers") if isinstance(spec, dict) else getattr(spec, "layers", None)
        if layers != "all" and not isinstance(layers, (list, tuple)):
            return False
        try:
            return len(resolve_layer_indices(layers, count)) == count
        except (ValueError, TypeError):  # a selection the model refused when it was built: never guess here
            return False

    def list_blocks(self, base: nn.Module) -> list[nn.Module]:
        """The transformer blocks of the base model (BertLayer, ViTLayer, GPT2Block, ...), in order."""
        return list(base.get_submodule(self.blocks))

    def list_layers(self, base: nn.Module) -> list[tuple[str, nn.Module]]:
        """[(path relative to the base model, attention module)], one per transformer block."""
        return [(f"{self.blocks}.{i}.{self.attention}", block.get_submodule(self.attention))
                for i, block in enumerate(base.get_submodule(self.blocks))]

    def head_geometry(self, module: nn.Module) -> tuple[int, int]:
        """(number of heads, head dimension) of an attention module."""
        return int(getattr(module, self.heads_attr)), int(getattr(module, self.head_dim_attr))

    def value_checkpoint_patterns(self, index: int) -> list[str]:
        """Regexes of the checkpoint keys of layer `index`'s value projection (dropped by a primal layer)."""
        if self.value_attr is None:
            return []
        own = re.escape(f"{self.blocks}.{index}.{self.attention}.{self.value_attr}.")
        return [own, *(pattern.format(i=index) for pattern in self.legacy_value_keys)]


def ignore_on_load(model: nn.Module, patterns: list[str]) -> None:
    """Keep the checkpoint keys matching `patterns` (the value projections primal layers no longer have) out of
    `model`'s load report, beside what it already ignores."""
    if patterns:
        already = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        model._keys_to_ignore_on_load_unexpected = already | set(patterns)


def base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The model's base model (``model.bert`` of a BertForSequenceClassification; the model itself when it is one)
    and the prefix of its module names in `model` (``"bert."``, or ``""``)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, model) if prefix else model
    return base, (f"{prefix}." if base is not model else "")


def convert_layers(model: nn.Module, architecture: Architecture, primal_config: Any = None) -> list[str]:
    """Make the layers selected by ``model.config.primal_attention`` (or `primal_config`) primal, in place.

    Idempotent and duck-typed (a remote-code copy of these classes and the plugin may both run). Returns the
    regex patterns of checkpoint keys that primal layers no longer have (value projections).
    """
    config = model.config
    spec = primal_config if primal_config is not None else getattr(config, "primal_attention", None)
    if spec is None:
        return []
    spec = PrimalAttentionConfig.coerce(spec)
    inherit_weight_conversions(model)
    base, _ = base_model(model)
    layers = architecture.list_layers(base)
    selected = spec.resolve_layers(len(layers))
    causal = architecture.causal(config)
    hidden = config.hidden_size
    ignore: list[str] = []
    for index in selected:
        _, module = layers[index]
        ignore += architecture.value_checkpoint_patterns(index)
        if is_primal_attention(module):
            module._primal_crop_window = spec.crop_window
            module.primal.sampling, module.primal.causal_mixing = spec.sampling, spec.causal_mixing
            if isinstance(module.primal, KEPSVGPCore):
                module.primal.covariance = spec.covariance
            continue
        if not isinstance(module, architecture.attention_class):
            raise ValueError(
                f"Layer {index} of {type(model).__name__} is a {type(module).__name__}, not a stock "
                f"{architecture.attention_class.__name__}; hf_primal converts only stock attention modules."
            )
        heads, dim = architecture.head_geometry(module)
        if heads * dim != hidden:
            raise ValueError(
                f"Primal-Attention needs hidden_size == num_heads * head_dim (it splits the layer input into heads); "
                f"got hidden_size={hidden}, num_heads={heads}, head_dim={dim}."
            )
        samples = 0 if causal else num_sampled_tokens(architecture.max_tokens(config), spec.low_rank, spec.rank_multi)
        reference = getattr(module, architecture.qk_names[0]).weight
        if spec.variant == "kep_svgp":
            if causal:
                raise ValueError(
                    f"primal_attention variant='kep_svgp' is for encoders only; {type(model).__name__} runs its "
                    "attention causally. Use variant='primal' for decoders."
                )
            core = KEPSVGPCore(heads, dim, spec.low_rank, samples)
            core.covariance = spec.covariance
        else:
            core = PrimalCore(heads, dim, spec.low_rank, samples, causal)
        core.sampling, core.causal_mixing = spec.sampling, spec.causal_mixing
        module.__class__ = architecture.primal_class
        module.primal = core.to(device=reference.device, dtype=reference.dtype)
        module._primal_causal = causal
        module._primal_crop_window = spec.crop_window
        module.layer_idx = index
        if architecture.value_attr is not None and hasattr(module, architecture.value_attr):
            delattr(module, architecture.value_attr)
    return ignore


def is_primal_attention(module: nn.Module) -> bool:
    """Whether `module` runs Primal-Attention (every Primal*Attention class carries ``_is_primal_attention``)."""
    return bool(getattr(module, "_is_primal_attention", False))


def primal_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module of `model` that runs Primal-Attention, in module order."""
    return [(name, module) for name, module in model.named_modules() if is_primal_attention(module)]


def primal_layers(model: nn.Module) -> list[str]:
    """Module names of the attention layers of `model` that run Primal-Attention."""
    return [name for name, _ in primal_attention_modules(model)]


def inherit_weight_conversions(model: nn.Module) -> None:
    """Give a primal model class defined outside transformers the checkpoint renaming rules of its stock base.

    transformers keeps renaming rules per class name, then per model_type (``ViTModel``: checkpoint keys
    ``encoder.layer.N.attention.attention.query`` <-> module ``layers.N.attention.q_proj``, applied on load and
    reversed on save), and skips classes defined outside transformers unless their name was registered. The
    shareable ``PrimalViTModel`` (model_type ``primal_vit``, also as remote code) would otherwise load its own
    saved weights with every tensor missing.
    """
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # pragma: no cover - transformers without per-class weight conversions
        return
    cls = type(model)
    if cls.__module__.startswith("transformers.") or get_checkpoint_conversion_mapping(cls.__name__) is not None:
        return
    stock = next((base for base in cls.__mro__[1:] if base.__module__.startswith("transformers.")), None)
    rules = get_checkpoint_conversion_mapping(stock.__name__) if stock is not None else None
    if rules is not None:
        register_checkpoint_conversion_mapping(cls.__name__, rules, overwrite=True)
