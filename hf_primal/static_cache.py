"""`PrimalStaticCacheLayer`: a causal primal layer's state in a static cache, for compiled decoding.

Static caches (``StaticCache`` / ``generate(..., cache_implementation="static")``) get a `PrimalStaticCacheLayer`
at each primal index: fixed (B, H, d) / (B,) buffers updated in place and a tensor token counter, like
transformers' ``StaticLayer``, so compiled decoding (``torch.compile(model.forward, fullgraph=True)``) runs
without graph breaks. Cropping a static primal layer is not supported (use the default cache for assisted decoding).
"""

from __future__ import annotations

from typing import Optional

import torch

from .cache_layer import DEFAULT_CROP_WINDOW, PrimalCacheLayer
from .primal import CausalState


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
