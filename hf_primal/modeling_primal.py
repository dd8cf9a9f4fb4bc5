"""Primal-Attention layers for transformers' BERT, ViT and GPT-2, and the in-place converter.

This file and the flat modules it imports (`primal.py`, `cache.py`, `config.py`) import only torch and
transformers: they are copied next to exported checkpoints as remote code, so that
``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` works where hf_primal is not installed.

How a layer becomes primal: `apply_primal_attention(model)` swaps the ``__class__`` of each selected stock
attention module to the matching ``Primal*`` subclass below, attaches a `PrimalCore` as ``.primal`` and
deletes the value projection. q/k and output-projection parameters keep their stock names, so ordinary
checkpoints load into them unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from transformers import initialization as hf_init
from transformers.cache_utils import Cache
from transformers.models.bert.modeling_bert import BertPreTrainedModel, BertSelfAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2PreTrainedModel
from transformers.models.vit.modeling_vit import ViTAttention, ViTPreTrainedModel
from transformers.pytorch_utils import Conv1D

from .cache import DEFAULT_CROP_WINDOW, primal_cache_layer
from .config import PrimalAttentionConfig
from .layers import attentions_requested, packed_segments, pop_cache, run_primal, valid_tokens
from .primal import PrimalCore, num_sampled_tokens


# ---------------------------------------------------------------------------------------------- layers
class PrimalBertSelfAttention(BertSelfAttention):
    """BERT self-attention computed by Primal-Attention (causal when ``config.is_decoder``)."""

    _is_primal_attention = True

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        cache = pop_cache(cache, kwargs)
        hidden_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        q = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
        return run_primal(self, q, k, hidden_states, attention_mask, cache, **kwargs)


class PrimalViTAttention(ViTAttention):
    """ViT self-attention computed by non-causal Primal-Attention."""

    _is_primal_attention = True

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        out, attention = run_primal(self, q, k, hidden_states, attention_mask, **kwargs)
        return self.o_proj(out), attention


class PrimalGPT2Attention(GPT2Attention):
    """GPT-2 self-attention computed by causal Primal-Attention with a constant-size cache.

    The fused ``c_attn`` keeps its value third so that ordinary checkpoints and LoRA on ``c_attn`` load
    unchanged; the stock Conv1D path multiplies only the q/k two thirds.
    """

    _is_primal_attention = True

    def forward(
        self,
        hidden_states,
        cache=None,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        output_attentions=False,
        **kwargs,
    ):
        cache = pop_cache(cache, kwargs)
        if encoder_hidden_states is not None:
            raise ValueError("PrimalGPT2Attention is a self-attention layer; cross-attention stays canonical.")
        width = 2 * self.split_size
        if type(self.c_attn) is Conv1D:
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            qk = torch.addmm(self.c_attn.bias[:width], flat, self.c_attn.weight[:, :width])
            qk = qk.view(*hidden_states.shape[:-1], width)
        else:  # wrapped (e.g. LoRA): call the module so the wrapper takes part
            qk = self.c_attn(hidden_states)[..., :width]
        q, k = qk.split(self.split_size, dim=-1)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = q.view(shape).transpose(1, 2)
        k = k.view(shape).transpose(1, 2)
        out, attention = run_primal(
            self, q, k, hidden_states, attention_mask, cache, output_attentions=output_attentions, **kwargs
        )
        return self.resid_dropout(self.c_proj(out)), attention


# ---------------------------------------------------------------------------------------------- adapters
@dataclass(frozen=True)
class _Adapter:
    """Where one architecture keeps its attention modules and how they become primal."""

    name: str
    base_class: type
    attention_class: type
    primal_class: type
    list_layers: Callable[[nn.Module], list]  # base model -> [(module path relative to base, module)]
    value_attr: Optional[str]
    ignore_value_patterns: Callable[[int], list]
    max_tokens: Callable[[object], int]
    causal: Callable[[object], bool]


def _bert_layers(base):
    return [(f"encoder.layer.{i}.attention.self", layer.attention.self) for i, layer in enumerate(base.encoder.layer)]


def _vit_layers(base):
    return [(f"layers.{i}.attention", layer.attention) for i, layer in enumerate(base.layers)]


def _gpt2_layers(base):
    return [(f"h.{i}.attn", block.attn) for i, block in enumerate(base.h)]


def _vit_max_tokens(config) -> int:
    image = config.image_size if isinstance(config.image_size, int) else max(config.image_size)
    patch = config.patch_size if isinstance(config.patch_size, int) else min(config.patch_size)
    return (image // patch) ** 2 + 1


ADAPTERS = (
    _Adapter(
        name="bert",
        base_class=BertPreTrainedModel,
        attention_class=BertSelfAttention,
        primal_class=PrimalBertSelfAttention,
        list_layers=_bert_layers,
        value_attr="value",
        ignore_value_patterns=lambda i: [rf"encoder\.layer\.{i}\.attention\.self\.value\."],
        max_tokens=lambda c: c.max_position_embeddings,
        causal=lambda c: bool(c.is_decoder),
    ),
    _Adapter(
        name="vit",
        base_class=ViTPreTrainedModel,
        attention_class=ViTAttention,
        primal_class=PrimalViTAttention,
        list_layers=_vit_layers,
        value_attr="v_proj",
        ignore_value_patterns=lambda i: [
            rf"layers\.{i}\.attention\.v_proj\.",
            rf"encoder\.layer\.{i}\.attention\.attention\.value\.",
            # a legacy checkpoint key renamed by every ViT rule but the value one (dropped when all layers are primal)
            rf"layers\.{i}\.attention\.attention\.value\.",
        ],
        max_tokens=_vit_max_tokens,
        causal=lambda c: False,
    ),
    _Adapter(
        name="gpt2",
        base_class=GPT2PreTrainedModel,
        attention_class=GPT2Attention,
        primal_class=PrimalGPT2Attention,
        list_layers=_gpt2_layers,
        value_attr=None,
        ignore_value_patterns=lambda i: [],
        max_tokens=lambda c: c.n_positions,
        causal=lambda c: True,
    ),
)

SUPPORTED_ARCHITECTURES = "bert (BertModel, BertFor*, BertLMHeadModel), vit (ViTModel, ViTFor*), gpt2 (GPT2Model, GPT2LMHeadModel, GPT2For*, GPT2DoubleHeadsModel)"


def find_adapter(model: nn.Module) -> _Adapter:
    for adapter in ADAPTERS:
        if isinstance(model, adapter.base_class):
            return adapter
    config = getattr(model, "config", None)
    raise ValueError(
        f"Primal-Attention does not support {type(model).__name__} (model_type="
        f"{getattr(config, 'model_type', None)!r}); supported architectures: {SUPPORTED_ARCHITECTURES}."
    )


def _head_geometry(module: nn.Module) -> tuple[int, int]:
    heads = getattr(module, "num_attention_heads", None) or getattr(module, "num_heads")
    dim = getattr(module, "attention_head_size", None) or getattr(module, "head_dim")
    return int(heads), int(dim)


def _reference_weight(module: nn.Module) -> torch.Tensor:
    for name in ("query", "q_proj", "c_attn"):
        sub = getattr(module, name, None)
        if sub is not None:
            return sub.weight
    return next(module.parameters())


def apply_primal_attention(model: nn.Module, primal_config=None) -> list[str]:
    """Make the layers selected by ``model.config.primal_attention`` primal, in place.

    Idempotent and duck-typed (a remote-code copy of these classes and the plugin may both run). Returns the
    regex patterns of checkpoint keys that primal layers no longer have (value projections).
    """
    adapter = find_adapter(model)
    config = model.config
    spec = primal_config if primal_config is not None else getattr(config, "primal_attention", None)
    if spec is None:
        return []
    spec = PrimalAttentionConfig.coerce(spec)
    inherit_weight_conversions(model)
    base = getattr(model, model.base_model_prefix, model)
    layers = adapter.list_layers(base)
    selected = spec.resolve_layers(len(layers))
    causal = adapter.causal(config)
    hidden = config.hidden_size
    ignore: list[str] = []
    for index in selected:
        _, module = layers[index]
        ignore += adapter.ignore_value_patterns(index)
        if getattr(module, "_is_primal_attention", False):
            module._primal_crop_window = spec.crop_window
            continue
        if not isinstance(module, adapter.attention_class):
            raise ValueError(
                f"Layer {index} of {type(model).__name__} is a {type(module).__name__}, not a stock "
                f"{adapter.attention_class.__name__}; hf_primal converts only stock attention modules."
            )
        heads, dim = _head_geometry(module)
        if heads * dim != hidden:
            raise ValueError(
                f"Primal-Attention needs hidden_size == num_heads * head_dim (it splits the layer input into heads); "
                f"got hidden_size={hidden}, num_heads={heads}, head_dim={dim}."
            )
        samples = 0 if causal else num_sampled_tokens(adapter.max_tokens(config), spec.low_rank, spec.rank_multi)
        reference = _reference_weight(module)
        core = PrimalCore(heads, dim, spec.low_rank, samples, causal)
        core = core.to(device=reference.device, dtype=reference.dtype)
        module.__class__ = adapter.primal_class
        module.primal = core
        module._primal_causal = causal
        module._primal_crop_window = spec.crop_window
        module.layer_idx = index
        if adapter.value_attr is not None and hasattr(module, adapter.value_attr):
            delattr(module, adapter.value_attr)
    return ignore


def prepare_primal_cache(model: nn.Module, model_kwargs: dict, generation_config=None) -> None:
    """Put primal cache layers into the cache `generate` just prepared, before anything runs.

    Installing them up front (instead of at the first forward) lets ``cache.activate_past_recording()``, which
    transformers calls before the prefill of assisted / prompt-lookup decoding (and right after creating an
    assistant's cache), reach them, so they keep the per-token states that ``crop`` needs.
    """
    cache = model_kwargs.get("cache")
    if cache is None or not isinstance(cache, Cache):
        return
    layers = [
        m for m in model.modules()
        if getattr(m, "_is_primal_attention", False) and getattr(m, "_primal_causal", False)
        and getattr(m, "layer_idx", None) is not None
    ]
    installed = [primal_cache_layer(cache, m.layer_idx, getattr(m, "_primal_crop_window", DEFAULT_CROP_WINDOW))
                 for m in layers]
    if generation_config is not None and getattr(generation_config, "is_assistant", False):
        for layer in installed:
            layer.activate_past_recording()


@torch.no_grad()
def init_primal_core(core: nn.Module) -> None:
    """docs/method.md, "Initialisation" initialisation, skipping tensors a checkpoint already filled."""
    hf_init.orthogonal_(core.We)
    hf_init.orthogonal_(core.Wr)
    hf_init.uniform_(core.Lambda, 0.0, 1.0)


def primal_layers(model: nn.Module) -> list[str]:
    """Module names of the attention layers of `model` that run Primal-Attention."""
    return [name for name, module in model.named_modules() if getattr(module, "_is_primal_attention", False)]


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


_VALUE_ATTRS = {adapter.value_attr for adapter in ADAPTERS if adapter.value_attr}


def drop_value_renamings(model: nn.Module, conversions: list) -> list:
    """`conversions` without the renaming rules that target only value projections `model` does not have.

    Primal layers drop their value projections; once every layer of a ViT is primal, a rule such as
    ``attention.value -> v_proj`` renames nothing, on load or in reverse on save. transformers' check that each
    rule of a model matches one of its serialized keys (``test_reverse_loading_mapping``) would flag it, so it
    is left out for such a model only; with any softmax layer left the rule still applies.
    """
    if getattr(getattr(model, "config", None), "primal_attention", None) is None or not conversions:
        return conversions
    keys = None
    kept = []
    for transform in conversions:
        targets = list(getattr(transform, "target_patterns", None) or [])
        renames_values = type(transform).__name__ == "WeightRenaming" and targets and all(
            "\\" not in target and _VALUE_ATTRS & set(target.strip(".").split(".")) for target in targets
        )
        if renames_values:
            keys = list(model.state_dict()) if keys is None else keys
            if not any(target in key for target in targets for key in keys):
                continue
        kept.append(transform)
    return kept


def ignore_patterns(model: nn.Module) -> list[str]:
    """Regexes of checkpoint keys dropped from the primal layers of `model` (value projections)."""
    adapter = find_adapter(model)
    spec = getattr(model.config, "primal_attention", None)
    if spec is None:
        return []
    base = getattr(model, model.base_model_prefix, model)
    selected = PrimalAttentionConfig.coerce(spec).resolve_layers(len(adapter.list_layers(base)))
    return [p for i in selected for p in adapter.ignore_value_patterns(i)]


__all__ = [
    "PrimalBertSelfAttention",
    "PrimalViTAttention",
    "PrimalGPT2Attention",
    "apply_primal_attention",
    "attentions_requested",
    "drop_value_renamings",
    "inherit_weight_conversions",
    "init_primal_core",
    "prepare_primal_cache",
    "packed_segments",
    "primal_layers",
    "valid_tokens",
    "run_primal",
]


# ---------------------------------------------------------------------------------------------- hub classes
# Thin subclasses with their own model_type ("primal_bert", ...), used for checkpoints meant to be shared: their
# config.json carries an auto_map to this file, so `AutoModel*.from_pretrained(folder, trust_remote_code=True)`
# rebuilds the primal layers where hf_primal is not installed, and plain Auto loading without the plugin or
# trust_remote_code fails loudly (unknown model type) instead of producing a stock model with missing weights.
from transformers.models.bert import modeling_bert as _bert  # noqa: E402
from transformers.models.bert.configuration_bert import BertConfig  # noqa: E402
from transformers.models.gpt2 import modeling_gpt2 as _gpt2  # noqa: E402
from transformers.models.gpt2.configuration_gpt2 import GPT2Config  # noqa: E402
from transformers.models.vit import modeling_vit as _vit  # noqa: E402
from transformers.models.vit.configuration_vit import ViTConfig  # noqa: E402


class PrimalBertConfig(BertConfig):
    model_type = "primal_bert"
    primal_attention = None


class PrimalViTConfig(ViTConfig):
    model_type = "primal_vit"
    primal_attention = None


class PrimalGPT2Config(GPT2Config):
    model_type = "primal_gpt2"
    primal_attention = None


def _card_auto_class(model) -> str:
    """The Auto class that loads `model`'s own head, read from the auto_map (which lists every head)."""
    auto_map = getattr(model.config, "auto_map", None) or {}
    name = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    matches = [k for k, v in auto_map.items() if k != "AutoConfig" and str(v).rsplit(".", 1)[-1] == name]
    specific = [k for k in matches if k not in ("AutoModel", "AutoModelForPreTraining", "AutoModelForTextEncoding")]
    return (specific or matches or ["AutoModel"])[0]


def _hub_id(name: str) -> Optional[str]:
    """`name` if it reads as a Hub repository id and is not a local folder, else None (never show local paths)."""
    if not name or os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name):
        return None
    parts = name.split("/")
    return name if len(parts) <= 2 and all(part and part[0].isalnum() for part in parts) else None


def model_card(model) -> str:
    """README.md for a shared primal checkpoint: what was converted, with what settings, and how to load it."""
    spec = PrimalAttentionConfig.coerce(model.config.primal_attention)
    layers = [name for name, m in model.named_modules() if getattr(m, "_is_primal_attention", False)]
    report = getattr(model, "primal_conversion_report", None) or {}
    base = report.get("base_model") or _hub_id(getattr(model.config, "_name_or_path", "") or "")
    auto = _card_auto_class(model)
    lines = ["---", "library_name: transformers"]
    if base:
        lines.append(f"base_model: {base}")
    lines += [
        "tags:",
        "- primal-attention",
        "- hf_primal",
        "---",
        "",
        f"# {type(model).__name__} (Primal-Attention)",
        "",
        "Self-attention in the layers below runs Primal-Attention (Chen et al., NeurIPS 2023: asymmetric kernel SVD in",
        "the primal), converted with hf_primal.",
        "",
        f"- base model: `{base}`" if base else "- base model: a local checkpoint",
        f"- primal layers ({len(layers)}): " + ", ".join(f"`{n}`" for n in layers),
        f"- low_rank s = {spec.low_rank}, rank_multi m = {spec.rank_multi}, eta = {spec.eta}, KSVD reduction = {spec.ksvd_reduction}",
    ]
    if report:
        lines += ["", "## Conversion", "", f"- method: {report.get('method', 'none')}",
                  f"- calibration data: {report.get('calibration', 'none')}"]
        distilled = report.get("distillation")
        if distilled:
            lines.append(f"- held-out distillation loss: {distilled['loss_before']:.4f} -> {distilled['loss_after']:.4f}")
            if distilled.get("cosine_after") is not None:
                lines.append("- held-out mean-pooled embedding cosine vs the original: "
                             f"{distilled['cosine_before']:.4f} -> {distilled['cosine_after']:.4f}")
            lines.append(f"- kept step {distilled['best_step']} of {distilled['steps']} ({distilled['seconds']:.0f} s)")
        per_layer = report.get("layers", [])
        if per_layer:
            lines += ["", "| layer | relative output error before | after |", "|---|---|---|"]
            lines += [f"| `{r['layer']}` | {r['error_before']:.4f} | {r['error_after']:.4f} |" for r in per_layer]
        if report.get("verdict"):
            lines += ["", f"Verdict: {report['verdict']}."]
        for key, value in report.get("metrics", {}).items():
            lines.append(f"- {key}: {value}")
    lines += [
        "",
        "## Loading",
        "",
        "Without hf_primal (the modeling code ships in this repository):",
        "",
        "```python",
        "from transformers import " + auto,
        f"model = {auto}.from_pretrained(\"<this folder or repo id>\", trust_remote_code=True)",
        "```",
        "",
        "Every Auto class listed in the `auto_map` of config.json loads it the same way (a head the checkpoint does",
        "not have is initialised as usual), and so do pipelines: `pipeline(task, model=..., trust_remote_code=True)`.",
        "",
        "With hf_primal installed, `import hf_primal` first and `trust_remote_code` is not needed (also not for",
        "`AutoTokenizer`, which reads config.json and would otherwise ask whether to run the custom code).",
        "Loading through the Auto classes with neither fails on the unknown model type instead of silently",
        "building a stock model. Do not load it with a stock class such as `BertModel` directly: transformers",
        "would only warn about the model type and leave the primal layers without their weights.",
        "",
    ]
    return "\n".join(lines)


class PrimalModelMixin:
    """Converts in `post_init` (the plugin's hook does the same when it is installed; conversion is idempotent),
    and writes a model card next to the weights."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            import os

            with open(os.path.join(save_directory, "README.md"), "w", encoding="utf-8") as handle:
                handle.write(model_card(self))
        return result

    def push_to_hub(self, repo_id: str, *, commit_message=None, private=None, token=None, revision=None,
                    create_pr: bool = False, max_shard_size="50GB", commit_description=None, **kwargs):
        # Same upload path as transformers' push_to_hub, but keeps the model card written by save_pretrained
        # (transformers would replace it with a generic one).
        import tempfile

        from transformers.utils.hub import hf_api

        repo_id = hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp_dir:
            self.save_pretrained(tmp_dir, max_shard_size=max_shard_size)
            return self._upload_modified_files(
                tmp_dir, repo_id, files_timestamps={}, commit_message=commit_message, token=token,
                create_pr=create_pr, revision=revision, commit_description=commit_description,
            )

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        prepare_primal_cache(self, model_kwargs, generation_config)
        return result

    def post_init(self):
        ignore = apply_primal_attention(self)
        super().post_init()
        if ignore:
            self._keys_to_ignore_on_load_unexpected = set(self._keys_to_ignore_on_load_unexpected or ()) | set(ignore)

    def _init_weights(self, module):
        super()._init_weights(module)
        if getattr(module, "_is_primal_core", False):
            init_primal_core(module)


class PrimalBertModel(PrimalModelMixin, _bert.BertModel):
    config_class = PrimalBertConfig


class PrimalBertForPreTraining(PrimalModelMixin, _bert.BertForPreTraining):
    config_class = PrimalBertConfig


class PrimalBertLMHeadModel(PrimalModelMixin, _bert.BertLMHeadModel):
    config_class = PrimalBertConfig


class PrimalBertForMaskedLM(PrimalModelMixin, _bert.BertForMaskedLM):
    config_class = PrimalBertConfig


class PrimalBertForNextSentencePrediction(PrimalModelMixin, _bert.BertForNextSentencePrediction):
    config_class = PrimalBertConfig


class PrimalBertForSequenceClassification(PrimalModelMixin, _bert.BertForSequenceClassification):
    config_class = PrimalBertConfig


class PrimalBertForMultipleChoice(PrimalModelMixin, _bert.BertForMultipleChoice):
    config_class = PrimalBertConfig


class PrimalBertForTokenClassification(PrimalModelMixin, _bert.BertForTokenClassification):
    config_class = PrimalBertConfig


class PrimalBertForQuestionAnswering(PrimalModelMixin, _bert.BertForQuestionAnswering):
    config_class = PrimalBertConfig


class PrimalViTModel(PrimalModelMixin, _vit.ViTModel):
    config_class = PrimalViTConfig


class PrimalViTForImageClassification(PrimalModelMixin, _vit.ViTForImageClassification):
    config_class = PrimalViTConfig


class PrimalViTForMaskedImageModeling(PrimalModelMixin, _vit.ViTForMaskedImageModeling):
    config_class = PrimalViTConfig


class PrimalGPT2Model(PrimalModelMixin, _gpt2.GPT2Model):
    config_class = PrimalGPT2Config


class PrimalGPT2LMHeadModel(PrimalModelMixin, _gpt2.GPT2LMHeadModel):
    config_class = PrimalGPT2Config


class PrimalGPT2DoubleHeadsModel(PrimalModelMixin, _gpt2.GPT2DoubleHeadsModel):
    config_class = PrimalGPT2Config


class PrimalGPT2ForSequenceClassification(PrimalModelMixin, _gpt2.GPT2ForSequenceClassification):
    config_class = PrimalGPT2Config


class PrimalGPT2ForTokenClassification(PrimalModelMixin, _gpt2.GPT2ForTokenClassification):
    config_class = PrimalGPT2Config


class PrimalGPT2ForQuestionAnswering(PrimalModelMixin, _gpt2.GPT2ForQuestionAnswering):
    config_class = PrimalGPT2Config


HUB_CONFIGS = {"bert": PrimalBertConfig, "vit": PrimalViTConfig, "gpt2": PrimalGPT2Config}
HUB_MODELS = {
    cls.__mro__[2]: cls
    for cls in (
        PrimalBertModel, PrimalBertForPreTraining, PrimalBertLMHeadModel, PrimalBertForMaskedLM,
        PrimalBertForNextSentencePrediction, PrimalBertForSequenceClassification, PrimalBertForMultipleChoice,
        PrimalBertForTokenClassification, PrimalBertForQuestionAnswering, PrimalViTModel,
        PrimalViTForImageClassification, PrimalViTForMaskedImageModeling, PrimalGPT2Model, PrimalGPT2LMHeadModel,
        PrimalGPT2DoubleHeadsModel, PrimalGPT2ForSequenceClassification, PrimalGPT2ForTokenClassification,
        PrimalGPT2ForQuestionAnswering,
    )
}
