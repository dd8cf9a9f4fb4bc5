"""Constant-size generation state for causal primal layers, as a transformers cache layer.

A causal primal layer needs only the running sums of its q and k and the number of valid tokens seen
(docs/method.md, "Causal layer"), so its slot in a `DynamicCache` holds a `CausalState` of shape (B, H, d) instead of
keys and values that grow with the context. Canonical layers of the same model keep their KV layers.

The layers live in `cache_layers` (`PrimalCacheLayer`, the default dynamic cache, and
`PrimalStaticCacheLayer`); this module puts them into transformers caches (`primal_cache_layer`), measures caches
(`cache_nbytes`) and is where the rest of hf_primal and its users import them from.
"""

from __future__ import annotations

import types

import torch
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache, StaticLayer

from .cache_layers import DEFAULT_CROP_WINDOW, PrimalCacheLayer, PrimalStaticCacheLayer, cache_kwarg

__all__ = [
    "DEFAULT_CROP_WINDOW",
    "PrimalCacheLayer",
    "PrimalStaticCacheLayer",
    "attention_cache_layer",
    "cache_kwarg",
    "cache_nbytes",
    "primal_cache_layer",
]


def _validated_crop(self: Cache, tokens_to_remove: int) -> None:
    """``Cache.crop`` that checks every primal layer before any layer is cropped (no half-cropped cache)."""
    for layer in self.layers:
        if isinstance(layer, PrimalStaticCacheLayer):
            layer.crop(tokens_to_remove)  # refuses (or does nothing for 0) before anything is cropped
        elif isinstance(layer, PrimalCacheLayer):
            layer.check_crop(tokens_to_remove)
    type(self).crop(self, tokens_to_remove)


def _install(cache: Cache, layer_idx: int, layer: PrimalCacheLayer) -> PrimalCacheLayer:
    cache.layers[layer_idx] = layer
    bound = cache.__dict__.get("crop")
    if getattr(bound, "__func__", None) is not _validated_crop:
        # A bound method, so that copy.deepcopy(cache) rebinds it to the copy.
        cache.crop = types.MethodType(_validated_crop, cache)
    return layer


def attention_cache_layer(cache: Cache, module: torch.nn.Module) -> PrimalCacheLayer:
    """The `PrimalCacheLayer` of the causal primal attention `module` (its ``layer_idx`` and crop window)."""
    return primal_cache_layer(cache, module.layer_idx, getattr(module, "_primal_crop_window", DEFAULT_CROP_WINDOW))


def primal_cache_layer(cache: Cache, layer_idx: int, crop_window: int = DEFAULT_CROP_WINDOW) -> PrimalCacheLayer:
    """The `PrimalCacheLayer` at `layer_idx` of `cache`, installing it on first use.

    A `DynamicLayer` slot becomes a `PrimalCacheLayer`, a `StaticLayer` slot a `PrimalStaticCacheLayer` (before
    either holds tokens). Raises a clear error for other layer kinds (quantized, sliding, ...) instead of letting
    stock KV layers produce wrong tokens.
    """
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    layers = cache.layers
    if layer_idx < len(layers) and isinstance(layers[layer_idx], PrimalCacheLayer):
        return layers[layer_idx]
    if layer_idx < len(layers):
        current = layers[layer_idx]
        if type(current) is StaticLayer:
            if current.is_initialized and int(current.cumulative_length) != 0:
                raise ValueError(
                    f"Primal-Attention layer {layer_idx} cannot use a {type(cache).__name__} whose StaticLayer already "
                    "holds keys and values; primal layers keep running sums: start from a fresh cache."
                )
            return _install(cache, layer_idx, PrimalStaticCacheLayer(current.max_cache_len, crop_window=crop_window))
        if type(current) is not DynamicLayer:
            raise ValueError(
                f"Primal-Attention layer {layer_idx} cannot use a {type(cache).__name__} whose layer is a "
                f"{type(current).__name__}: primal layers keep a constant-size running state. Use the default "
                "`DynamicCache` or a `StaticCache` (cache_implementation='static'), not a quantized / sliding cache."
            )
        if current.is_initialized:
            raise ValueError(
                f"Primal-Attention layer {layer_idx} cannot use a {type(cache).__name__} whose layer is a "
                f"{type(current).__name__} that already holds keys and values (was the cache filled by a model "
                "without a primal layer there?). Primal layers keep running sums: start from a fresh cache."
            )
        return _install(cache, layer_idx, PrimalCacheLayer(crop_window=crop_window))
    # Lazily-grown cache (DynamicCache() without config): fill the gap with the cache's own layer type.
    while len(layers) < layer_idx:
        layers.append(cache.layer_class_to_replicate() if cache.layer_class_to_replicate else DynamicLayer())
    layers.append(None)
    return _install(cache, layer_idx, PrimalCacheLayer(crop_window=crop_window))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def cache_nbytes(cache: Cache) -> int:
    """Bytes of memory held by the tensors of `cache`: keys/values of KV layers, running states of primal layers.

    Walks the layers' attributes instead of assuming `keys`/`values`, so a hybrid model's cache is measured
    the same way for both kinds of layer (and static caches count their preallocated buffers).
    """
    if isinstance(cache, EncoderDecoderCache):
        return cache_nbytes(cache.self_attention_cache) + cache_nbytes(cache.cross_attention_cache)
    storages: dict[tuple, int] = {}
    for layer in cache.layers:
        for tensor in _tensors(vars(layer)):
            # Count whole storages, once each: a view keeps its entire base buffer alive.
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
