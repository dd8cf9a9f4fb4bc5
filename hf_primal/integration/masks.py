"""The attention mask a model whose every attention layer is primal gets: the (batch, keys) padding mask.

transformers builds one mask per forward for the configured attention implementation; for ``sdpa`` and ``eager``
that is a (batch, 1, queries, keys) tensor, N^2 booleans (or floats) per sequence. A primal layer reads only which
keys are real from it (`layers.valid_tokens`), so where no softmax layer is left to use the rest, building it is
pure cost: at N = 4096 and batch 32 it is a 512 MiB tensor, about as much as all primal layers' own activations,
and one of the largest operations of a primal training step. `padding_only` wraps transformers' ``sdpa`` and
``eager`` mask functions (installed by `patching.install_hooks`) and, for such models only, returns what
transformers gives flash attention instead: the 2D padding mask, or None when no token is padding. Every other
request (a model with a softmax layer left, a cache that already holds tokens, packed sequences, extra mask
patterns) goes to transformers' own function unchanged; `valid_tokens` reads both forms to the same answer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from transformers import masking_utils

from ..models import architecture_for_config

# The two plain patterns; anything else (packed sequences, or_mask / and_mask overlays) carries information a
# padding mask cannot hold.
_SKIP_FLAG = {
    masking_utils.bidirectional_mask_function: "allow_is_bidirectional_skip",
    masking_utils.causal_mask_function: "allow_is_causal_skip",
}


def reads_padding_only(config: Any) -> bool:
    """Whether every attention module of a model built from `config` is primal
    (`Architecture.attends_only_through_primal`)."""
    if getattr(config, "primal_attention", None) is None:
        return False
    architecture = architecture_for_config(config)
    return architecture is not None and architecture.attends_only_through_primal(config)


def _padding_suffices(kwargs: dict) -> bool:
    """Whether this request is a plain causal or bidirectional pattern over exactly the new tokens, plus padding."""
    flag = _SKIP_FLAG.get(kwargs.get("mask_function"))
    if flag is None or not kwargs.get(flag, True) or kwargs.get("local_size") is not None:
        return False  # an overlay, or a caller that needs the mask materialised (e.g. to concatenate it)
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    if isinstance(q_offset, torch.Tensor) or q_offset != 0 or kv_offset != 0:
        return False  # a cache with earlier tokens (or a static one): the 4D mask locates the new keys
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if q_length is None or q_length != kv_length:
        return False
    padding = kwargs.get("attention_mask")
    return padding is None or (padding.dim() == 2 and padding.shape[-1] == kv_length)


def padding_only(original: Callable) -> Callable:
    """Wrap one of transformers' mask functions (``sdpa_mask``, ``eager_mask``) so that models whose attention is all
    primal get the 2D padding mask (None without padding); everything else gets `original`'s answer."""

    def mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        if args or not reads_padding_only(kwargs.get("config")) or not _padding_suffices(kwargs):
            return original(*args, **kwargs)
        padding = kwargs.get("attention_mask")
        if padding is None:
            return None
        # Under torch.compile the mask is returned as it is: reading its values would break the graph.
        if not torch.compiler.is_compiling() and bool(padding.all()):
            return None
        return padding

    mask.__wrapped__ = original
    return mask
