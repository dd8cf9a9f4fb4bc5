"""The transformers hooks a primal model needs, each written once.

Two kinds of caller run them. hf_primal's global patches of ``PreTrainedModel`` / ``GenerationMixin``
(`hf_primal.integration.patching`) act on every model whose config asks for primal attention; the shareable
``Primal*`` classes (`shareable.PrimalModelMixin`) carry the same hooks as methods, so that a shared folder runs
them where hf_primal is not installed. Where hf_primal *is* imported, those methods leave the work to the global
patches (`global_hook_installed`), so a ``Primal*`` class, hf_primal's own or one loaded from a folder's remote
code, is converted, initialised and given its generation cache exactly once, by the same code as a stock class
(and with the same layer and cache classes, never a mix of two copies).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from transformers import initialization as hf_init
from transformers.cache_utils import Cache

from .architecture import Architecture, convert_layers, ignore_on_load, primal_attention_modules
from .cache import attention_cache_layer
from .cache_layers import cache_kwarg

# The attribute hf_primal's patched methods carry. A string, not an identity check: the shareable classes compare
# it on whatever transformers method is in place, from any copy of this module.
GLOBAL_HOOK = "_hf_primal_global_hook"


def global_hook_installed(method: Any) -> bool:
    """Whether `method` (e.g. ``PreTrainedModel.post_init``) is hf_primal's global patch."""
    return bool(getattr(method, GLOBAL_HOOK, False))


def mark_global_hook(original: Callable) -> Callable[[Callable], Callable]:
    """Decorator for hf_primal's patch of `original`: marks it, and keeps `original` as ``__wrapped__``."""

    def mark(function: Callable) -> Callable:
        setattr(function, GLOBAL_HOOK, True)
        function.__wrapped__ = original
        return function

    return mark


def post_init(model: nn.Module, architecture: Architecture, stock_post_init: Callable[[], None]) -> None:
    """Make the selected layers primal *before* transformers initialises and loads weights (so the loader reports
    exactly the new primal tensors as missing and fills q/k/out), then run transformers' ``post_init``."""
    ignore = convert_layers(model, architecture)
    stock_post_init()
    ignore_on_load(model, ignore)


def init_weights(module: nn.Module) -> None:
    """After transformers' ``_init_weights(module)``: initialise a primal core's own parameters."""
    if getattr(module, "_is_primal_core", False):
        init_primal_core(module)


def prepare_cache(model: nn.Module, model_kwargs: dict, generation_config: Any) -> None:
    """After transformers' ``_prepare_cache_for_generation``: put primal cache layers into the new cache."""
    prepare_primal_cache(model, model_kwargs, generation_config)


def prepare_primal_cache(model: nn.Module, model_kwargs: dict, generation_config: Any = None) -> None:
    """Put primal cache layers into the cache `generate` just prepared, before anything runs.

    Installing them up front (instead of at the first forward) lets ``cache.activate_past_recording()``, which
    transformers calls before the prefill of assisted / prompt-lookup decoding (and right after creating an
    assistant's cache), reach them, so they keep the per-token states that ``crop`` needs.
    """
    cache = model_kwargs.get(cache_kwarg())
    if cache is None or not isinstance(cache, Cache):
        return
    layers = [m for _, m in primal_attention_modules(model)
              if getattr(m, "_primal_causal", False) and getattr(m, "layer_idx", None) is not None]
    installed = [attention_cache_layer(cache, m) for m in layers]
    if generation_config is not None and getattr(generation_config, "is_assistant", False):
        for layer in installed:
            layer.activate_past_recording()


@torch.no_grad()
def init_primal_core(core: nn.Module) -> None:
    """The core's own initialisation, through transformers' init helpers (which skip tensors a checkpoint filled)."""
    core.reset_parameters(hf_init)
