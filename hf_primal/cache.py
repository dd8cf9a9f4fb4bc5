"""Constant-size generation state for causal primal layers, as a transformers cache layer.

A causal primal layer needs only the running sums of its q and k and the number of valid tokens seen
(method spec §3), so its slot in a `DynamicCache` holds a `CausalState` of shape (B, H, d) instead of
keys and values that grow with the context. Canonical layers of the same model keep their KV layers.

What works on a cache holding primal layers: ``get_seq_length``, ``get_mask_sizes``, ``get_max_length`` (-1),
``len(cache)``, ``cache.layers[i]``, ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
(beam search, contrastive search), ``reset``, ``offload`` / ``prefetch``. What cannot: ``crop`` (running sums cannot
forget tokens) and reading ``.keys`` / ``.values`` of a primal layer (or iterating the cache, which reads them):
both raise an error saying what the layer keeps instead.

With ``output_attentions=True`` the layer also keeps the normalised prefix-mean keys of every token from then on
(``key_features``, (B, H, seen, d)), because the attention matrix of a later step has a column per earlier token;
that part grows with the context, and only when attentions are asked for.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, EncoderDecoderCache

from .primal import CausalState


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself if it owns exactly its storage, else a copy that does."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


class PrimalCacheLayer(CacheLayerMixin):
    """Running q/k sums of one causal primal layer.

    `seen` counts every token fed so far, padding included, because transformers derives positions and
    mask sizes from it; the state's `count` counts only valid tokens.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.state: Optional[CausalState] = None
        self.seen = 0
        self.key_features: Optional[torch.Tensor] = None

    # A primal layer has no keys or values: reading them must not silently give None (the stock layers' "empty").
    _WHAT_IT_KEEPS = (
        "a causal primal attention layer caches no keys or values: it keeps `state`, the running sums of its "
        "queries and keys over the tokens seen (`state.sum_q`, `state.sum_k`, shape (batch, heads, head_dim)) and "
        "the number of valid tokens (`state.count`, shape (batch,)) - a constant-size state (hf_primal.cache)"
    )

    @property
    def keys(self):
        raise AttributeError(f"{type(self).__name__}.keys: {self._WHAT_IT_KEEPS}.")

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ and reset() assign None
            raise AttributeError(f"{type(self).__name__}.keys cannot be set: {self._WHAT_IT_KEEPS}.")

    @property
    def values(self):
        raise AttributeError(f"{type(self).__name__}.values: {self._WHAT_IT_KEEPS}.")

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError(f"{type(self).__name__}.values cannot be set: {self._WHAT_IT_KEEPS}.")

    # -- CacheLayerMixin interface ------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError(
            f"`update` must not be called on a {type(self).__name__}: {self._WHAT_IT_KEEPS}. Was a stock attention "
            "module run at a primal layer index?"
        )

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self.seen = 0
        self.key_features = None
        self.is_initialized = False

    def _map_state(self, fn) -> None:
        # Everything held per sequence moves together (beam search reorders, contrastive search repeats / selects).
        if self.state is not None:
            self.state = CausalState(*(fn(t) for t in self.state))
        if self.key_features is not None:
            self.key_features = fn(self.key_features)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            f"Primal-Attention caches cannot be cropped: {self._WHAT_IT_KEEPS}, and running sums cannot forget "
            "tokens. Assisted / speculative decoding is not supported with primal layers."
        )

    def offload(self) -> None:
        self._map_state(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        device = getattr(self, "device", None)
        if device is not None:
            self._map_state(lambda t: t.to(device, non_blocking=True))

    # -- primal interface -----------------------------------------------------------
    def write(self, state: CausalState, new_tokens: int, key_features: Optional[torch.Tensor] = None) -> None:
        """Store the state after `new_tokens` more tokens; `key_features` ((B, H, new_tokens, d) k_hat of those
        tokens) extends the key history that attention matrices need (kept from the first time it is given)."""
        # The state usually arrives as views into (B, H, L, d) prefix-sum buffers of the L new tokens; storing
        # the views would keep those buffers alive, i.e. memory linear in the prompt length.
        self.state = CausalState(*(_compact(t) for t in state))
        self.device = state.sum_q.device
        if key_features is not None:
            if self.seen > 0 and self.key_features is None:
                raise ValueError(self.missing_key_history())
            key_features = key_features.detach()  # the cache must not keep the forward's graph alive
            self.key_features = (
                key_features if self.key_features is None else torch.cat([self.key_features, key_features], dim=2)
            )
        self.seen += int(new_tokens)
        self.is_initialized = True

    def missing_key_history(self) -> str:
        return (
            f"This primal cache layer has seen {self.seen} tokens without keeping their normalised keys, so it cannot "
            "give the attention matrix's columns for them: pass output_attentions=True from the first forward that "
            "fills the cache (generate(..., output_attentions=True) does), or start from a fresh cache."
        )

    def state_numel(self) -> int:
        """Number of elements of the running state (independent of the context length)."""
        return 0 if self.state is None else sum(t.numel() for t in self.state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seen={self.seen}, numel={self.state_numel()})"


def primal_cache_layer(cache: Cache, layer_idx: int) -> PrimalCacheLayer:
    """The `PrimalCacheLayer` at `layer_idx` of `cache`, installing it on first use.

    Raises a clear error for caches whose layers cannot hold a primal state (static / quantized / offloaded
    caches), instead of letting stock KV layers produce wrong tokens.
    """
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    layers = cache.layers
    if layer_idx < len(layers) and isinstance(layers[layer_idx], PrimalCacheLayer):
        return layers[layer_idx]
    if layer_idx < len(layers):
        current = layers[layer_idx]
        if type(current) is not DynamicLayer:
            raise ValueError(
                f"Primal-Attention layer {layer_idx} cannot use a {type(cache).__name__} whose layer is a "
                f"{type(current).__name__}: primal layers keep a constant-size running state. Use the default "
                "`DynamicCache` (do not pass cache_implementation='static' / a StaticCache / a quantized cache)."
            )
        if current.is_initialized:
            raise ValueError(
                f"Primal-Attention layer {layer_idx} cannot use a {type(cache).__name__} whose layer is a "
                f"{type(current).__name__} that already holds keys and values (was the cache filled by a model "
                "without a primal layer there?). Primal layers keep running sums: start from a fresh cache."
            )
        layers[layer_idx] = PrimalCacheLayer()
        return layers[layer_idx]
    # Lazily-grown cache (DynamicCache() without config): fill the gap with the cache's own layer type.
    while len(layers) < layer_idx:
        layers.append(cache.layer_class_to_replicate() if cache.layer_class_to_replicate else DynamicLayer())
    layers.append(PrimalCacheLayer())
    return layers[layer_idx]


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
