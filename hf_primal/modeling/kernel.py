"""Packed segments, prefix means and the N x N attention kernel of primal layers, in plain torch.

Packed rows hold several sequences (padding-free training): `segment_starts` / `_segmented_cumsum` restart the
causal prefix sums at each segment, `_Packing` turns each segment of a non-causal batch into a sequence of its own.
`causal_log_decay` / `decayed_cumsum` are the causal layer's decayed running sums (``causal_mixing="decay"``);
`running_sums` / `running_counts` / `prefix_sums` the causal layer's sums of either rule, for its forward and kernel.
`prefix_mean_features`, `sampled_gram` and `kernel_matrix` build, with plain autograd ops, the kernel matrix whose
KSVD a layer computes (``output_attentions=True``, hf_primal.tools.analysis).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .sampling import _sample_tokens

NORM_EPS = 1e-12
# Head h of a layer with H heads forgets at the rate gamma_h = 1 - 2^-b_h, b_h evenly spaced from 1 to 10: windows
# 1 / (1 - gamma) of 2 .. 1024 tokens (docs/method.md, "Causal layer").
DECAY_EXPONENTS = (1.0, 10.0)
_FASTEST_DECAY = -math.log1p(-(2.0 ** -DECAY_EXPONENTS[0]))  # -log gamma of the fastest-forgetting head


def _accumulator_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; elsewhere float64 keeps "total - total at the segment start" exact to fp32 precision.
    return torch.float32 if device.type == "mps" else torch.float64


def segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """(B, L) segment ids -> (B, L) position of the first token of each token's segment.

    A segment is a run of equal ids: a new one starts wherever the id changes from the previous token.
    """
    batch, length = segments.shape
    positions = torch.arange(length, device=segments.device).expand(batch, length)
    change = torch.ones_like(segments, dtype=torch.bool)
    change[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return torch.where(change, positions, torch.zeros_like(positions)).cummax(dim=1).values


def _segmented_cumsum(v: torch.Tensor, starts: torch.Tensor, dim: int) -> torch.Tensor:
    """Inclusive cumulative sum along `dim` that restarts at every segment start (float64 where supported).

    `starts` is `segment_starts(...)`, (B, L), broadcast over the other axes of `v`; subtracting the exclusive
    sum at the segment start keeps this a single cumsum + gather, without a loop over segments.
    """
    acc = _accumulator_dtype(v.device)
    total = torch.cumsum(v, dim=dim, dtype=acc)
    exclusive = total - v.to(acc)
    shape = [1] * v.dim()
    shape[0], shape[dim] = starts.shape
    index = starts.view(shape).expand_as(total)
    return total - torch.gather(exclusive, dim, index)


def causal_log_decay(num_heads: int, mixing: str, device: torch.device) -> Optional[torch.Tensor]:
    """(H,) log gamma_h of each head of a causal layer (float64, or float32 on MPS), or None for ``"prefix_mean"``
    (every token weighs the same: gamma = 1, computed as a plain prefix sum)."""
    if mixing == "prefix_mean":
        return None
    if mixing != "decay":
        raise ValueError(f"causal_mixing={mixing!r} is not allowed: use 'decay' or 'prefix_mean'.")
    low, high = DECAY_EXPONENTS
    exponents = [low] if num_heads == 1 else [low + (high - low) * h / (num_heads - 1) for h in range(num_heads)]
    return torch.tensor([math.log1p(-(2.0 ** -b)) for b in exponents], dtype=_accumulator_dtype(device), device=device)


def decayed_cumsum(
    v: torch.Tensor, keep: torch.Tensor, log_decay: torch.Tensor, starts: Optional[torch.Tensor] = None,
    fastest: float = _FASTEST_DECAY,
) -> torch.Tensor:
    """S_i = sum_{j <= i} gamma_h^(t_i - t_j) v_j per head, t_i the number of kept tokens up to i (so padding
    neither adds to S nor ages it); restarting at each packed segment when `starts` (`segment_starts`) is given.

    Args:
        v: (B, H, L, d), zero at tokens that are not kept; keep: (B, L) 1 / 0; log_decay: (H,) log gamma_h <= 0.
        fastest: a bound on -log gamma_h (a Python number, so the chunk length is known without reading a tensor,
            which keeps torch.compile graphs whole).
    Returns:
        (B, H, L, d) in float64 (float32 on MPS), with autograd.

    Computed as gamma^t_i * cumsum(gamma^-t_j v_j) within chunks short enough that gamma^-t cannot overflow, each
    chunk continuing the last sum of the one before: O(L d) and exact to the accumulator's precision.
    """
    acc = _accumulator_dtype(v.device)
    length = v.shape[2]
    rates = log_decay.to(device=v.device, dtype=acc)
    ages = keep.to(acc).cumsum(dim=1)[:, None, :] * rates[None, :, None]  # (B, H, L): t_i log gamma, non-increasing
    budget = 0.25 * math.log(torch.finfo(acc).max)  # exp(budget) times |v| stays far from overflow
    chunk = length if fastest <= 0.0 else max(1, int(budget / fastest))
    values = v.to(acc)
    pieces, carry, carry_age = [], None, None
    for begin in range(0, length, chunk):
        age = ages[:, :, begin:begin + chunk]
        ref = age[:, :, :1]
        part = (values[:, :, begin:begin + chunk] * torch.exp(ref - age)[..., None]).cumsum(dim=2)
        part = part * torch.exp(age - ref)[..., None]
        if carry is not None:
            part = part + carry[:, :, None, :] * torch.exp(age - carry_age)[..., None]
        pieces.append(part)
        carry, carry_age = part[:, :, -1], age[:, :, -1:]
    sums = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    if starts is None:
        return sums
    # S within a segment = S of the row - the row's S before the segment start, aged to i.
    before = (starts - 1).clamp(min=0)[:, None, :].expand_as(ages)
    earlier = torch.gather(sums, 2, before[..., None].expand_as(sums))
    aged = torch.exp(ages - torch.gather(ages, 2, before))[..., None]
    inside = (starts > 0)[:, None, :, None]
    return sums - torch.where(inside, earlier * aged, torch.zeros((), dtype=acc, device=v.device))


def decay_since_state(keep: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """(B, H, L, 1) gamma_h^t_i, t_i the number of kept new tokens up to i: how much of a cached state's sums is left
    after each of L new tokens."""
    rates = log_decay.to(device=keep.device)
    return torch.exp(keep.to(rates.dtype).cumsum(dim=1)[:, None, :] * rates[None, :, None])[..., None]


def running_sums(
    v: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype, starts: Optional[torch.Tensor] = None,
    log_decay: Optional[torch.Tensor] = None, state_sum: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(B, H, L, d) running sums of `v` (zero at dropped tokens) after each token, in `dtype`: plain, or decayed per
    head when `log_decay` is given (`decayed_cumsum`); restarting at each packed segment (`starts`, from
    `segment_starts`); continuing `state_sum` ((B, H, d), the sums before these tokens) when given."""
    if log_decay is not None:
        sums = decayed_cumsum(v, keep, log_decay, starts)
        if state_sum is not None:
            sums = sums + state_sum[:, :, None, :].to(sums.dtype) * decay_since_state(keep, log_decay)
        return sums.to(dtype)
    sums = torch.cumsum(v, dim=2, dtype=dtype) if starts is None else _segmented_cumsum(v, starts, dim=2).to(dtype)
    return sums if state_sum is None else sums + state_sum[:, :, None, :].to(dtype)


def running_counts(
    keep: torch.Tensor, starts: Optional[torch.Tensor] = None, state_count: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(B, L) number of kept tokens up to each position (restarting at packed segments, continuing `state_count`),
    in `keep`'s dtype."""
    counts = keep.cumsum(dim=1) if starts is None else _segmented_cumsum(keep, starts, dim=1).to(keep.dtype)
    return counts if state_count is None else counts + state_count[:, None].to(counts.dtype)


def prefix_sums(
    q: torch.Tensor, k: torch.Tensor, valid: Optional[torch.Tensor], state: Optional[Any],
    segments: Optional[torch.Tensor], log_decay: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Running sums of q and k (B, H, L, d) and valid-token counts (B, L) after each new token, from `state` (a
    `CausalState`: sum_q, sum_k, count); restarting at each packed segment; decayed per head when `log_decay` ((H,),
    `causal_log_decay`) is given. Sums are fp32 or wider: long prefixes lose precision in half precision."""
    batch, _, length, _ = q.shape
    if valid is not None:
        drop = ~valid[:, None, :, None]
        q, k = q.masked_fill(drop, 0.0), k.masked_fill(drop, 0.0)
        keep = valid.float()
    else:
        keep = torch.ones(batch, length, device=q.device, dtype=torch.float32)
    wide = torch.promote_types(q.dtype, torch.float32)
    starts = None if segments is None else segment_starts(segments)
    sum_q = running_sums(q, keep, wide, starts, log_decay, None if state is None else state.sum_q)
    sum_k = running_sums(k, keep, wide, starts, log_decay, None if state is None else state.sum_k)
    return sum_q, sum_k, running_counts(keep, starts, None if state is None else state.count)


class _Packing(NamedTuple):
    """Where each token of a packed (B, L) batch goes when every segment becomes a sequence of its own.

    group, slot: (B, L) sequence index (0..G-1) and position in it; rows: (G,) the row each sequence came from.
    """

    group: torch.Tensor
    slot: torch.Tensor
    rows: torch.Tensor
    num_groups: int
    width: int

    @staticmethod
    def build(segments: torch.Tensor) -> "_Packing":
        batch, length = segments.shape
        starts = segment_starts(segments)
        positions = torch.arange(length, device=segments.device)
        new = (starts == positions).long()  # 1 at every segment start
        local = new.cumsum(dim=1) - 1  # segment index within the row
        per_row = new.sum(dim=1)
        offsets = per_row.cumsum(dim=0) - per_row
        group = local + offsets[:, None]
        slot = positions - starts
        rows = torch.repeat_interleave(torch.arange(batch, device=segments.device), per_row)
        return _Packing(group, slot, rows, int(per_row.sum()), int(slot.max()) + 1)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (G, W, ...), zero in the slots past each sequence's end."""
        out = t.new_zeros(self.num_groups, self.width, *t.shape[2:])
        out[self.group, self.slot] = t
        return out

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """(G, W, ...) -> (B, L, ...)."""
        return t[self.group, self.slot]

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """(G,) per-sequence sums -> (B,) per-row sums."""
        batch = self.group.shape[0]
        return values.new_zeros(batch).index_add(0, self.rows, values)

    def pack_inputs(
        self, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, valid: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A non-causal layer's (B, H, N, d) q, k, (B, N, C) input and (B, N) valid mask (None: every token) ->
        the same per packed sequence, (G, H, W, d), (G, W, C) and (G, W), invalid in the slots past each end."""
        keep = torch.ones_like(self.group, dtype=torch.bool) if valid is None else valid
        return (
            self.pack(q.transpose(1, 2)).transpose(1, 2),
            self.pack(k.transpose(1, 2)).transpose(1, 2),
            self.pack(x),
            self.pack(keep),
        )

    def run_noncausal(self, noncausal, q, k, x, valid):
        """`noncausal` (q, k, x, valid -> y, KSVD terms) with every packed segment run as a sequence of its own: y as
        a (B, H, N, d) view of (B, N, H, d), like the unpacked path, and the terms summed per row."""
        y, terms = noncausal(*self.pack_inputs(q, k, x, valid))
        y = self.unpack(y.transpose(1, 2)).transpose(1, 2)
        return y, type(terms)(self.per_row(terms.e_sum), self.per_row(terms.r_sum), self.per_row(terms.count),
                              terms.trace)


def prefix_mean_features(
    v: torch.Tensor,
    valid: Optional[torch.Tensor] = None,
    state_sum: Optional[torch.Tensor] = None,
    state_count: Optional[torch.Tensor] = None,
    segments: Optional[torch.Tensor] = None,
    log_decay: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Normalised masked prefix means of the causal layer (docs/method.md, "Causal layer"), with plain autograd ops.

    Args:
        v: (B, H, L, d) queries or keys of L new tokens.
        valid: (B, L) bool or None; invalid tokens do not enter the means.
        state_sum, state_count: (B, H, d) and (B,) running sum and valid count before these tokens, or None.
        segments: (B, L) ids of sequences packed in one row (means restart at each new id), or None.
        log_decay: (H,) `causal_log_decay`, or None for equal weights (the prefix mean).
    Returns:
        (B, H, L, d) in fp32 (or wider for a wider `v`); rows at invalid tokens are the means so far.
    """
    batch, _, length, _ = v.shape
    dtype = torch.promote_types(v.dtype, torch.float32)
    v = v.to(dtype)
    keep = torch.ones(batch, length, dtype=dtype, device=v.device) if valid is None else valid.to(dtype)
    v = v * keep[:, None, :, None]
    if segments is not None and state_sum is not None:
        raise ValueError("packed segments start new sequences: they cannot continue a cached state")
    starts = None if segments is None else segment_starts(segments)
    sums = running_sums(v, keep, dtype, starts, log_decay, state_sum)
    counts = running_counts(keep, starts, state_count)
    means = sums / counts.clamp(min=1.0)[:, None, :, None]
    return F.normalize(means, dim=-1, eps=NORM_EPS)


def sampled_gram(
    x: torch.Tensor, valid: Optional[torch.Tensor], num_samples: int, heads: int, rule: str = "even"
) -> torch.Tensor:
    """F_h^T F_h for every sequence and head: (B, N, C) layer input -> (B, H, d, d), fp32 or wider.

    F_h (p x d) is the head-h block of the p sampled rows the non-causal forward builds W_{e|X} from (the same
    padding-aware `sample_token_indices` rule), so q_hat F_h^T F_h k_hat^T is the kernel its primal model implies.
    """
    batch = x.shape[0]
    sampled = _sample_tokens(x, valid, num_samples, rule).to(torch.promote_types(x.dtype, torch.float32))
    blocks = sampled.reshape(batch, num_samples, heads, -1).transpose(1, 2)  # (B, H, p, d)
    return blocks.mT @ blocks


def kernel_matrix(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    gram: Optional[torch.Tensor] = None,
    row_valid: Optional[torch.Tensor] = None,
    col_valid: Optional[torch.Tensor] = None,
    causal: bool = False,
    segments: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """K = q_hat [gram] k_hat^T per sequence and head, (B, H, L, M), zero where the layer masks.

    Args:
        q_hat: (B, H, L, d) normalised queries of the L newest tokens; k_hat: (B, H, M, d), M >= L, the last L
            of them the same tokens as the queries.
        gram: (B, H, d, d) or None (identity).
        row_valid, col_valid: (B, L) / (B, M) bool or None; rows / columns of invalid tokens are zero.
        causal: keep only keys at or before each query (query i is key position M - L + i).
        segments: (B, L) packed-sequence ids (needs M == L); entries across sequences are zero.
    """
    left = q_hat if gram is None else q_hat @ gram
    kernel = left @ k_hat.mT
    length, keys = q_hat.shape[2], k_hat.shape[2]
    keep = None
    if causal:
        rows = torch.arange(length, device=kernel.device)[:, None] + (keys - length)
        keep = torch.arange(keys, device=kernel.device)[None, :] <= rows  # (L, M)
    if segments is not None:
        same = segments[:, None, :, None] == segments[:, None, None, :]
        keep = same if keep is None else keep & same
    if row_valid is not None:
        rows_ok = row_valid[:, None, :, None]
        keep = rows_ok if keep is None else keep & rows_ok
    if col_valid is not None:
        cols_ok = col_valid[:, None, None, :]
        keep = cols_ok if keep is None else keep & cols_ok
    if keep is None:
        return kernel
    return torch.where(keep, kernel, torch.zeros((), dtype=kernel.dtype, device=kernel.device))
