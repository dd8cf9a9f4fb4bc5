"""The cache layers of causal primal layers: `PrimalCacheLayer` (the default dynamic cache) and
`PrimalStaticCacheLayer` (static caches, compiled decoding), each the constant-size state of one layer.

What works on a cache holding primal layers: ``get_seq_length``, ``get_mask_sizes``, ``get_max_length`` (-1),
``len(cache)``, ``cache.layers[i]``, ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
(beam search, contrastive search), ``reset``, ``offload`` / ``prefetch``, and ``crop`` once the cache records its
past: after ``cache.activate_past_recording()`` (which ``generate`` calls for assisted and prompt-lookup decoding)
each primal layer also keeps the state after each of its last W + 1 tokens (W = ``crop_window``,
`PrimalAttentionConfig.crop_window`, default 64, widened to the number of tokens ``generate`` drafts per step
when transformers passes it, from 5.25 on), so ``crop(-n)`` for n <= W puts back exactly the state after the
token it returns to; more than W raises. Reading ``.keys`` / ``.values`` of a primal layer (or iterating the cache,
which reads them) raises an error saying what the layer keeps instead.

With ``output_attentions=True`` the layer also keeps the normalised prefix-mean keys of every token from then on
(``key_features``, (B, H, seen, d)), because the attention matrix of a later step has a column per earlier token;
that part grows with the context, and only when attentions are asked for.

Static caches (``StaticCache`` / ``generate(..., cache_implementation="static")``) get a `PrimalStaticCacheLayer`
at each primal index: fixed (B, H, d) / (B,) buffers updated in place and a tensor token counter, like
transformers' ``StaticLayer``, so compiled decoding (``torch.compile(model.forward, fullgraph=True)``) runs
without graph breaks. Cropping a static primal layer is not supported (use the default cache for assisted decoding).
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Optional

import torch
from transformers.cache_utils import CacheLayerMixin

from .config import DEFAULT_CROP_WINDOW
from .primal import CausalState


@lru_cache(maxsize=None)
def cache_kwarg() -> str:
    """The keyword models and generate() take the cache under: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (also the field name on generate()'s outputs)."""
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


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
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, crop_window: int = DEFAULT_CROP_WINDOW, **kwargs) -> None:
        super().__init__()
        self.state: Optional[CausalState] = None
        self.seen = 0
        self.key_features: Optional[torch.Tensor] = None
        self.crop_window = int(crop_window)
        self.record_past = False
        # While recording: the state after each of the last (at most crop_window + 1) tokens, oldest first, along a
        # token axis (sums (B, H, n, d), count (B, n)); the last entry equals `state`.
        self.history: Optional[CausalState] = None

    # A primal layer has no keys or values: reading them must not silently give None (the stock layers' "empty").
    _WHAT_IT_KEEPS = (
        "a causal primal attention layer caches no keys or values: it keeps `state`, the running sums of its "
        "queries and keys over the tokens seen (`state.sum_q`, `state.sum_k`, shape (batch, heads, head_dim)) and "
        "the number of valid tokens (`state.count`, shape (batch,)) - a constant-size state (hf_primal.modeling.cache)"
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
        self.history = None
        self.is_initialized = False

    def _map_state(self, fn) -> None:
        # Everything held per sequence moves together (beam search reorders, contrastive search repeats / selects).
        if self.state is not None:
            self.state = CausalState(*(fn(t) for t in self.state))
        if self.key_features is not None:
            self.key_features = fn(self.key_features)
        if self.history is not None:
            self.history = CausalState(*(fn(t) for t in self.history))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices])

    # -- cropping (assisted / prompt-lookup decoding) --------------------------------
    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None) -> None:
        """Keep the state after each of the last `crop_window` + 1 tokens from now on, so `crop` can roll back.

        `recurrent_states_to_keep` is how many tokens the caller may take back at once (transformers >= 5.25's
        ``generate`` passes the number of tokens it drafts per step); the window widens to it if it is larger, so a
        draft longer than the configured ``crop_window`` can still be rolled back.
        """
        if recurrent_states_to_keep is not None:
            if isinstance(recurrent_states_to_keep, bool) or not isinstance(recurrent_states_to_keep, int) \
                    or recurrent_states_to_keep < 0:
                raise ValueError(
                    f"recurrent_states_to_keep must be a non-negative int (the number of tokens a crop may take "
                    f"back), got {recurrent_states_to_keep!r}."
                )
            self.crop_window = max(self.crop_window, recurrent_states_to_keep)
        self.record_past = True

    def history_length(self) -> int:
        return 0 if self.history is None else int(self.history.count.shape[-1])

    def check_crop(self, tokens_to_remove: int) -> int:
        """Validate ``crop(tokens_to_remove)`` without changing anything; returns the number of tokens to remove."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported: pass minus the number "
                "of tokens to remove, as for transformers' own cache layers."
            )
        n = -int(tokens_to_remove)
        if n == 0:
            return 0
        if n > self.seen:
            raise ValueError(f"Cannot crop {n} tokens from a primal cache layer that has seen only {self.seen}.")
        if n > self.crop_window:
            raise ValueError(
                f"Cannot crop {n} tokens from a primal cache layer: it keeps the running state after each of only its "
                f"last crop_window={self.crop_window} tokens (running sums cannot forget older tokens). Raise "
                "`crop_window` in the model's primal_attention config (PrimalAttentionConfig.crop_window) or draft "
                "fewer tokens at once (e.g. `num_assistant_tokens`, `prompt_lookup_num_tokens`)."
            )
        if not self.record_past:
            raise RuntimeError(
                f"Cannot crop a primal cache layer that does not record its past: it keeps only running sums "
                f"({self._WHAT_IT_KEEPS}). Call `cache.activate_past_recording()` before the forward passes you may "
                "want to undo (generate does this for assisted and prompt-lookup decoding). A primal layer is put into "
                "a cache you create yourself at the model's first forward, so call it after that forward, or first run "
                f"`prepare_primal_cache(model, {{{cache_kwarg()!r}: cache}})` from hf_primal.modeling.hooks."
            )
        if n < self.seen and self.history_length() < n + 1:
            raise ValueError(
                f"Cannot crop {n} tokens from a primal cache layer that started recording its past only "
                f"{max(self.history_length() - 1, 0)} tokens ago."
            )
        return n

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (at most `crop_window`) by restoring the state kept for the
        token the cache returns to. ``crop(0)`` does nothing (the kept states are already bounded by the window)."""
        n = self.check_crop(tokens_to_remove)
        if n == 0:
            return
        if n == self.seen:  # back to an empty sequence
            self.state = None
            self.history = None
            if self.key_features is not None:
                self.key_features = self.key_features[:, :, :0]
            self.seen = 0
            return
        keep = self.history_length() - n
        self.history = CausalState(self.history.sum_q[:, :, :keep], self.history.sum_k[:, :, :keep],
                                   self.history.count[:, :keep])
        self.state = CausalState(self.history.sum_q[:, :, -1].clone(), self.history.sum_k[:, :, -1].clone(),
                                 self.history.count[:, -1].clone())
        if self.key_features is not None:
            self.key_features = self.key_features[:, :, : self.seen - n]
        self.seen -= n

    def offload(self) -> None:
        self._map_state(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        device = getattr(self, "device", None)
        if device is not None:
            self._map_state(lambda t: t.to(device, non_blocking=True))

    # -- primal interface -----------------------------------------------------------
    def current_state(self) -> Optional[CausalState]:
        """The running state to continue from (None before the first token)."""
        return self.state

    def history_request(self) -> int:
        """How many per-token states the next `write` needs (0 when the layer does not record its past)."""
        return self.crop_window + 1 if self.record_past else 0

    def write(self, state: CausalState, new_tokens: int, key_features: Optional[torch.Tensor] = None) -> None:
        """Store the state after `new_tokens` more tokens; `key_features` ((B, H, new_tokens, d) k_hat of those
        tokens) extends the key history that attention matrices need (kept from the first time it is given).

        When the layer records its past, `state` is what `PrimalCore.causal_forward(..., history=
        self.history_request())` returns: the states after each of the last new tokens along a token axis."""
        if state.count.dim() == 2:  # per-token states: keep the last crop_window + 1, the running state is the last
            recent = state
            if self.history is not None:
                recent = CausalState(*(torch.cat([old, new], dim=-1 if new.dim() == 2 else 2)
                                       for old, new in zip(self.history, recent)))
            width = self.crop_window + 1
            self.history = CausalState(
                _compact(recent.sum_q[:, :, -width:]), _compact(recent.sum_k[:, :, -width:]),
                _compact(recent.count[:, -width:]),
            )
            state = CausalState(state.sum_q[:, :, -1], state.sum_k[:, :, -1], state.count[:, -1])
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
        """Number of elements of the running state, plus the kept per-token states while the layer records its
        past (at most crop_window + 1 of them): independent of the context length."""
        numel = 0 if self.state is None else sum(t.numel() for t in self.state)
        return numel + (0 if self.history is None else sum(t.numel() for t in self.history))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seen={self.seen}, numel={self.state_numel()})"


class PrimalStaticCacheLayer(PrimalCacheLayer):
    """`PrimalCacheLayer` for static caches and compiled decoding: fixed-size buffers updated in place.

    The running sums (B, H, d) and the count (B,) are allocated once (at the first write, or by
    ``cache.early_initialization``) and then only copied into; the number of tokens fed is a 0-d tensor
    (``cumulative_length``, as in transformers' ``StaticLayer``), so decoding steps trace to one graph. Mask sizes
    are those of a static layer (``max_cache_len`` columns), and the new tokens' columns are read at their positions.
    """

    is_compileable = True
    is_croppable = False
    supports_early_init = True

    def __init__(self, max_cache_len: int, crop_window: int = DEFAULT_CROP_WINDOW, **kwargs) -> None:
        super().__init__(crop_window=crop_window)
        self.max_cache_len = int(max_cache_len)
        self.cumulative_length = torch.tensor(0, dtype=torch.long)

    @property
    def seen(self):
        return self.cumulative_length if self.is_initialized else 0

    @seen.setter
    def seen(self, value) -> None:
        if not hasattr(self, "cumulative_length"):  # PrimalCacheLayer.__init__
            return
        if isinstance(value, int) and value == 0:
            self.cumulative_length.zero_()
        else:
            raise AttributeError("a static primal cache layer counts its tokens in place (cumulative_length)")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        wide = torch.promote_types(key_states.dtype, torch.float32)
        device = key_states.device
        self.state = CausalState(
            torch.zeros(batch, heads, dim, dtype=wide, device=device),
            torch.zeros(batch, heads, dim, dtype=wide, device=device),
            torch.zeros(batch, dtype=torch.float32, device=device),
        )
        self.batch_size = batch
        self.device = device
        self.cumulative_length = self.cumulative_length.to(device)
        if not torch.compiler.is_compiling():
            for tensor in (*self.state, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def get_seq_length(self):
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def current_state(self) -> Optional[CausalState]:
        return self.state if self.is_initialized else None

    def history_request(self) -> int:
        return 0

    def write(self, state: CausalState, new_tokens: int, key_features: Optional[torch.Tensor] = None) -> None:
        if key_features is not None:
            raise ValueError(
                "output_attentions=True is not supported for causal primal layers with a static cache: the attention "
                "matrix of a later step needs every earlier token's normalised key, which a fixed-size primal state "
                "does not keep. Use the default dynamic cache to get attentions."
            )
        if not self.is_initialized:
            self.lazy_initialization(state.sum_q[:, :, None, :], state.sum_q[:, :, None, :])
        if not torch.compiler.is_compiling() and int(self.cumulative_length) + int(new_tokens) > self.max_cache_len:
            raise ValueError(
                f"This static cache holds {self.max_cache_len} tokens (max_cache_len) and has seen "
                f"{int(self.cumulative_length)}: {new_tokens} more do not fit in its attention mask."
            )
        for buffer, value in zip(self.state, state):
            buffer.copy_(value)
        self.cumulative_length.add_(int(new_tokens))

    def reset(self) -> None:
        # In place, like transformers' StaticLayer: compiled graphs keep pointing at the same buffers.
        if self.is_initialized:
            for buffer in self.state:
                buffer.zero_()
        self.cumulative_length.zero_()
        self.key_features = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "A causal primal layer of a static cache cannot be cropped: it keeps only fixed-size running sums, updated "
            "in place for compiled decoding, not the per-token states a rollback needs. Use the default dynamic "
            "cache (no cache_implementation) for assisted or prompt-lookup decoding."
        )

    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None) -> None:
        return None  # cropping is refused with a clear error instead

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_cache_len={self.max_cache_len}, seen={int(self.get_seq_length())})"
