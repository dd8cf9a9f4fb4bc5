"""The forward glue every primal attention module shares: masks, packed sequences, `run_primal`.

Each architecture's ``Primal*Attention.forward`` (hf_primal/models/) computes its per-head q/k and calls
`run_primal`, which reads which tokens are real from whatever mask transformers built, finds packed sequences,
talks to the generation cache and runs the layer's `PrimalCore`.

Imports only torch, transformers and the flat modules `cache`, `cache_layers`: copied next to shared checkpoints as
remote code (hf_primal/integration/hub.py, `REMOTE_CODE_FILES`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from transformers.cache_utils import Cache

from .cache import attention_cache_layer
from .cache_layers import PrimalCacheLayer, PrimalStaticCacheLayer

try:  # transformers records layer outputs (attentions, hidden states) with hooks while this collector is active
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # pragma: no cover - other transformers versions: fall back to kwargs / config
    _OUTPUT_COLLECTOR = None


# ---------------------------------------------------------------------------------------------- masks
def valid_tokens(
    attention_mask: Optional[torch.Tensor],
    batch: int,
    length: int,
    own_row: bool = False,
    past: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Which of the `length` newest tokens are real, from whatever mask transformers built.

    Accepts 4D boolean (True = attend) and additive float masks (sdpa / eager) and 2D masks (flash
    attention). Key validity is read from the last query row, which sees every key in both causal and
    bidirectional masks; with `own_row` (packed sequences, where the last row sees only the last sequence) from
    whether each token attends to itself, which transformers' masks allow exactly at real tokens. The new tokens
    are the last `length` key columns, except with a static cache, whose masks have a column per cache slot: then
    `past` (a 0-d tensor, the tokens already in the cache) says where they are. Returns None when every token is
    valid.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"Primal-Attention cannot read an attention mask of type {type(attention_mask).__name__} (e.g. a flex "
            "attention BlockMask); load the model with attn_implementation='sdpa' or 'eager'."
        )
    if attention_mask.dim() == 4:
        if own_row:
            keys = attention_mask.shape[-1]
            row = torch.diagonal(attention_mask[:, 0, -length:], offset=keys - length, dim1=-2, dim2=-1)
        elif past is not None:
            columns = past.to(attention_mask.device) + torch.arange(length, device=attention_mask.device)
            row = attention_mask[:, 0, -1].index_select(-1, columns)
        else:
            row = attention_mask[:, 0, -1, -length:]
        if row.dtype == torch.bool:
            valid = row
        else:
            valid = row > torch.finfo(row.dtype).min / 2
    elif attention_mask.dim() == 2:
        valid = attention_mask[:, -length:] != 0
    else:
        raise ValueError(
            f"Primal-Attention got an attention mask with shape {tuple(attention_mask.shape)}; expected a 2D "
            "(batch, keys) or 4D (batch, 1, queries, keys) mask."
        )
    return valid.expand(batch, length)


# The same position_ids tensor reaches every layer of one forward: derive its segments once, not once per layer
# (the single-segment check reads a value back from the device). Keyed on the tensors themselves and their
# version counters, so a buffer refilled in place is read again.
_SEGMENTS_MEMO: tuple = ()


def _memo_key(*tensors: Optional[torch.Tensor]) -> Optional[tuple]:
    key = []
    for t in tensors:
        try:
            key.append((t, t._version) if t is not None else (None, 0))
        except RuntimeError:  # inference-mode tensors keep no version counter: do not memoise
            return None
    return tuple(key)


def packed_segments(
    batch: int,
    length: int,
    position_ids: Optional[torch.Tensor] = None,
    cu_seq_lens: Optional[torch.Tensor] = None,
    always: bool = False,
) -> Optional[torch.Tensor]:
    """(B, L) ids of the sequences packed in each row (padding-free batches), or None when no row holds several.

    From the flash-attention kwarg ``cu_seq_lens_q`` when given (cumulative lengths over the flattened batch),
    else from ``position_ids`` with transformers' own rule (``masking_utils.find_packed_sequence_indices``): a new
    sequence starts wherever a position does not continue the previous one by +1 (``DataCollatorWithFlattening``
    restarts them at ``position_ids_start``), so primal layers split rows exactly where transformers' masks do.
    `always` returns the ids even for single-sequence rows (no data-dependent branch, for torch.compile).
    """
    global _SEGMENTS_MEMO
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _memo_key(position_ids, cu_seq_lens)
    if key is not None:
        key = (key, (batch, length, always))
        if _SEGMENTS_MEMO and _same_key(_SEGMENTS_MEMO[0], key):
            return _SEGMENTS_MEMO[1]
    ids = None
    if cu_seq_lens is not None:
        flat = torch.arange(batch * length, device=cu_seq_lens.device)
        if int(cu_seq_lens[-1]) != batch * length and not compiling:
            raise ValueError(
                f"cu_seq_lens_q ends at {int(cu_seq_lens[-1])} but the batch holds {batch} x {length} tokens; "
                "packed sequences must fill the flattened batch exactly."
            )
        ids = torch.searchsorted(cu_seq_lens[1:-1].to(flat.dtype), flat, right=True).view(batch, length)
    elif position_ids is not None and position_ids.dim() == 2 and position_ids.shape[-1] == length:
        positions = position_ids.expand(batch, length)
        restart = torch.diff(positions, dim=-1) != 1
        ids = torch.cat([restart.new_zeros(batch, 1), restart], dim=1).long().cumsum(dim=1)
    if ids is not None and not always and not bool((ids[:, -1] != ids[:, 0]).any()):
        ids = None  # one sequence per row: the unsegmented fast path
    if key is not None:
        _SEGMENTS_MEMO = (key, ids)
    return ids


def _same_key(a: tuple, b: tuple) -> bool:
    (tensors_a, shape_a), (tensors_b, shape_b) = a, b
    return shape_a == shape_b and all(x is y and vx == vy for (x, vx), (y, vy) in zip(tensors_a, tensors_b))


def attentions_requested(module: nn.Module, kwargs: dict) -> bool:
    """Whether the caller asked for attention matrices (``output_attentions``, argument or config).

    transformers 5 records ``outputs.attentions`` with forward hooks that append a layer's second output only
    while the model's output collector holds an "attentions" entry; asking the collector keeps every layer in
    step with what gets recorded (GPT-2 does not even pass ``output_attentions`` down to its layers).
    """
    collected = _OUTPUT_COLLECTOR.get() if _OUTPUT_COLLECTOR is not None else None
    if collected is not None:
        return "attentions" in collected
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(flag)


def _causal(
    core: nn.Module, layer: Optional[PrimalCacheLayer], q: torch.Tensor, k: torch.Tensor,
    valid: Optional[torch.Tensor], segments: Optional[torch.Tensor], wanted: bool, static: bool,
) -> tuple[torch.Tensor, Any, Optional[torch.Tensor]]:
    """A causal primal layer's step: continue the cache `layer`'s state (if any), write the new state back, and
    form the kernel matrix when attentions are `wanted`. Returns (y, KSVD terms, attention or None)."""
    if static and wanted:
        layer.write(None, q.shape[2], key_features=q)  # raises: attentions need every earlier token's key
    state = layer.current_state() if layer is not None else None
    history = layer.history_request() if layer is not None else 0
    y, terms, new_state = core(q, k, valid=valid, state=state, segments=segments, history=history)
    attention = keys = None
    if wanted:
        past = None
        if layer is not None and layer.seen > 0:
            if layer.key_features is None:
                raise ValueError(layer.missing_key_history())
            past = layer.key_features
        attention, keys = core.attention_kernel(q, k, valid=valid, state=state, segments=segments, past_keys=past)
    elif layer is not None and layer.key_features is not None:
        keys = core.key_features(k, valid, state)  # keep the history complete for later steps that ask
    if layer is not None:
        layer.write(new_state, q.shape[2], keys)
    return y, terms, attention


def run_primal(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    cache: Optional[Cache] = None,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Shared body of every primal attention module: (B, H, L, d) q/k -> (B, L, H*d) merged heads.

    `kwargs` are what transformers passes down to attention layers: ``position_ids`` / ``cu_seq_lens_q`` mark
    packed sequences (only without a cache, as for transformers' masks), ``output_attentions`` is read when no
    output collector is active. Returns the merged heads and, when attentions were asked for, the layer's
    kernel matrix (`PrimalCore.attention_kernel`), else None. Keeps the layer's `KSVDTerms` on
    ``module.ksvd_terms`` for the loss (None after a decoding step, which skips them).
    """
    batch, heads, length, dim = q.shape
    core = module.primal
    causal = module._primal_causal
    segments = None
    if cache is None:
        segments = packed_segments(
            batch, length, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"),
            always=causal and torch.compiler.is_compiling(),
        )
    wanted = attentions_requested(module, kwargs)
    attention = None
    layer = None
    if causal and cache is not None:
        layer = attention_cache_layer(cache, module)
    static = isinstance(layer, PrimalStaticCacheLayer)
    valid = valid_tokens(
        attention_mask, batch, length, own_row=segments is not None,
        past=layer.cumulative_length if static else None,
    )
    if causal:
        y, terms, attention = _causal(core, layer, q, k, valid, segments, wanted, static)
    else:
        y, terms, _ = core(q, k, x=x, valid=valid, segments=segments)
        if wanted:
            attention, _ = core.attention_kernel(q, k, x=x, valid=valid, segments=segments)
    # None after a decoding step (cached state, autograd off): generation never reads the KSVD terms. Lambda, which
    # enters only the KSVD loss, is tied to the output inside PrimalCore (DDP with find_unused_parameters needs it).
    module.ksvd_terms = terms
    out = y.transpose(1, 2).reshape(batch, length, heads * dim)
    if attention is not None:
        attention = attention.to(q.dtype)
        if attention.requires_grad and attention.numel() > 0:
            # The kernel does not feed the output (the layer never forms it); a zero-weight tie puts the returned
            # tensor on the path to any loss, so attentions[i].retain_grad() gets a (zero) gradient like softmax
            # weights do. nan_to_num keeps an overflowing entry from turning the output into NaN.
            out = out + torch.nan_to_num(attention.reshape(-1)[:1] * 0.0).sum().to(y.dtype)
    return out, attention


def pop_cache(cache: Optional[Cache], kwargs: dict) -> Optional[Cache]:
    # transformers 5.24 renamed `past_key_values` to `cache`; accept both spellings.
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


class PrimalProjectedAttention:
    """The forward of a primal attention module whose stock module projects q and k with two linears.

    Every architecture but GPT-2 (fused ``c_attn``) uses it as the first base of its ``Primal*`` class: the q/k,
    head-dimension and output-projection names come from the class's `architecture.Architecture` record
    (``_primal_architecture``), so the architecture module holds no forward code of its own. Returns what the stock
    module returns: (output, attention matrix or None).
    """

    _is_primal_attention = True
    _primal_architecture = None  # set by architecture.Architecture

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[Cache] = None, **kwargs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        architecture = self._primal_architecture
        query, key = (getattr(self, name) for name in architecture.qk_names)
        head_dim = getattr(self, architecture.head_dim_attr)
        q, k = split_heads(query(hidden_states), key(hidden_states), head_dim)
        out, attention = run_primal(self, q, k, hidden_states, attention_mask, pop_cache(cache, kwargs), **kwargs)
        if architecture.out_name is not None:
            out = getattr(self, architecture.out_name)(out)
        return out, attention


def split_heads(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, H*d) projected queries and keys -> (B, H, L, d) each, the layout `run_primal` takes."""
    shape = (*q.shape[:-1], -1, head_dim)
    return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2)
