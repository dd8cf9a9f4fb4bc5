"""Primal-Attention in plain torch: no transformers import here.

Shapes follow docs/method.md: B batch, H heads, N tokens, d head dim, C = H*d hidden size,
s = low_rank, p = sampled tokens (encoders only).

Two variants share one parameter module, `PrimalCore`:

* non-causal (encoders): data-dependent projection weights W_{e|X} = X_s^T W_e built from p tokens
  sampled evenly among the *valid* tokens of each sequence;
* causal (decoders): plain W_e, W_r applied to the normalised masked prefix means of q and k; the
  prefix sums double as the constant-size generation state.

Each call also returns `KSVDTerms`, the per-sequence sums the KSVD regulariser needs, so the loss can be
assembled later without keeping (B, H, N, s) score tensors alive.

Packed rows (several sequences in one row, padding-free training): both variants take optional per-token
segment ids. The causal variant restarts its prefix sums at each segment start (the running sum at the start is
subtracted, accumulated in float64 so that late segments do not inherit the rounding of the whole row); the
non-causal variant runs every segment as a sequence of its own (its own sampled tokens and W_{e|X}). KSVD terms
stay per row.

`PrimalCore.attention_kernel` gives the N x N asymmetric kernel whose KSVD a layer computes (what
``output_attentions=True`` returns): built from the same normalised queries/keys and sampled tokens as the
forward, with plain autograd ops, only when asked.

Performance (CPU, fp32; scripts/benchmark.py measures the whole models): `_PrimalHeads` is one autograd
function from the q/k projections to the merged heads, with a hand-written backward.

* The cosine feature map is a per-row scale, so it scales the (N, s) scores rather than the (N, d) rows
  of q and k: q_hat is never materialised, and the gradient of the norm folds into the input GEMM.
* Scores are written once, token-major, into one buffer z = [e | r | keep flag]; the flag column carries
  the head-map bias, so padded rows come out exactly zero without a masking pass, and the KSVD sums need
  only the per-column sums of z^2 (no mask either: scores are zero at padding).
* y comes out (B, N, H, d), so merging heads is a free view; per-head GEMMs run on strided views of the
  projections (no head-major copies), and weights are never expanded over the batch.
* In the causal variant normalize(S / c) = S / max(||S||, eps * c), so the prefix means are never formed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

NORM_EPS = 1e-12


class KSVDTerms(NamedTuple):
    """Per-sequence pieces of one layer's KSVD objective J (docs/method.md, "The KSVD loss"), all fp32.

    e_sum, r_sum: (B,) half the sum over heads and valid tokens of ||lambda_h * e||^2 (resp. r).
    count:        (B,) number of (head, valid token) pairs the sums ran over.
    trace:        ()   mean over heads of Tr(W_e[h]^T W_r[h]), from the parameters.
    """

    e_sum: torch.Tensor
    r_sum: torch.Tensor
    count: torch.Tensor
    trace: torch.Tensor


class CausalState(NamedTuple):
    """Running state of a causal primal layer: everything needed to continue a sequence.

    sum_q, sum_k: (B, H, d) fp32 sums of q and k over the valid tokens seen so far.
    count:        (B,) fp32 number of valid tokens seen so far.
    """

    sum_q: torch.Tensor
    sum_k: torch.Tensor
    count: torch.Tensor


SAMPLING_RULES = ("even", "legacy")


def _sample_ranks(lengths: torch.Tensor, num_samples: int, rule: str) -> torch.Tensor:
    """Rank among a sequence's valid tokens of the token each of the p slots holds: (B, 1) lengths -> (B, p).

    docs/method.md, "Sampling". L >= p (both rules): slot j holds rank floor(j (L - 1) / (p - 1)), p evenly spaced
    tokens from the first to the last. L < p: ``"even"`` gives slot j rank floor(j L / p), so token r holds slots
    ceil(r p / L) .. ceil((r + 1) p / L) - 1, i.e. floor(p/L) or ceil(p/L) slots each; ``"legacy"`` (hf_primal 0.1)
    keeps the L >= p formula, which gives the last token one slot and every other about p / L. Integer arithmetic
    keeps the rule exact and identical on every device.
    """
    if rule not in SAMPLING_RULES:
        raise ValueError(f"sampling rule {rule!r} is not allowed: use one of {list(SAMPLING_RULES)}.")
    if num_samples == 1:
        return torch.zeros_like(lengths)
    j = torch.arange(num_samples, device=lengths.device)
    spread = (j * (lengths - 1).clamp(min=0)) // (num_samples - 1)
    if rule == "legacy":
        return spread
    return torch.where(lengths < num_samples, (j * lengths) // num_samples, spread)


def sample_token_indices(valid: torch.Tensor, num_samples: int, rule: str = "even") -> torch.Tensor:
    """Positions of the p sampled tokens among the valid tokens of each sequence (`_sample_ranks` picks them).

    The rule depends only on each token's rank among the valid ones, so left and right padding give the same
    tokens.

    Args:
        valid: (B, N) bool, True at real tokens.
        num_samples: p >= 1.
        rule: ``"even"`` or ``"legacy"`` (`PrimalAttentionConfig.sampling`).
    Returns:
        (B, p) int64 positions into the N axis (0 where a sequence has no valid token).
    """
    length = valid.shape[1]
    ranks = _sample_ranks(valid.sum(dim=1, keepdim=True), num_samples, rule)
    running = valid.long().cumsum(dim=1)
    # The position of the token of rank r is the first position where the running count reaches r + 1.
    idx = torch.searchsorted(running, ranks + 1)
    return idx.clamp(max=length - 1)


def _even_positions(length: int, num_samples: int, device: torch.device, rule: str = "even") -> torch.Tensor:
    """`sample_token_indices` for a batch without padding: one (p,) index shared by every sequence."""
    lengths = torch.full((1, 1), length, dtype=torch.long, device=device)
    return _sample_ranks(lengths, num_samples, rule)[0]


def _sample_tokens(x: torch.Tensor, valid: Optional[torch.Tensor], num_samples: int, rule: str = "even") -> torch.Tensor:
    """(B, N, C) -> (B, p, C) sampled rows of the layer input."""
    length = x.shape[1]
    if valid is None:
        if num_samples == length:  # every token, in order (e.g. ViT with p = N): no copy, no scatter in backward
            return x
        # One index for the whole batch: index_select is cheaper than a per-sequence gather and its backward.
        return x.index_select(1, _even_positions(length, num_samples, x.device, rule))
    idx = sample_token_indices(valid, num_samples, rule)
    return torch.gather(x, 1, idx[:, :, None].expand(-1, -1, x.shape[-1]))


def segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """(B, L) segment ids -> (B, L) position of the first token of each token's segment.

    A segment is a run of equal ids: a new one starts wherever the id changes from the previous token.
    """
    batch, length = segments.shape
    positions = torch.arange(length, device=segments.device).expand(batch, length)
    change = torch.ones_like(segments, dtype=torch.bool)
    change[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return torch.where(change, positions, torch.zeros_like(positions)).cummax(dim=1).values


def _accumulator_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; elsewhere float64 keeps "total - total at the segment start" exact to fp32 precision.
    return torch.float32 if device.type == "mps" else torch.float64


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


def prefix_mean_features(
    v: torch.Tensor,
    valid: Optional[torch.Tensor] = None,
    state_sum: Optional[torch.Tensor] = None,
    state_count: Optional[torch.Tensor] = None,
    segments: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Normalised masked prefix means of the causal layer (docs/method.md, "Causal layer"), with plain autograd ops.

    Args:
        v: (B, H, L, d) queries or keys of L new tokens.
        valid: (B, L) bool or None; invalid tokens do not enter the means.
        state_sum, state_count: (B, H, d) and (B,) running sum and valid count before these tokens, or None.
        segments: (B, L) ids of sequences packed in one row (means restart at each new id), or None.
    Returns:
        (B, H, L, d) in fp32 (or wider for a wider `v`); rows at invalid tokens are the means so far.
    """
    batch, _, length, _ = v.shape
    dtype = torch.promote_types(v.dtype, torch.float32)
    v = v.to(dtype)
    keep = torch.ones(batch, length, dtype=dtype, device=v.device) if valid is None else valid.to(dtype)
    v = v * keep[:, None, :, None]
    if segments is not None:
        if state_sum is not None:
            raise ValueError("packed segments start new sequences: they cannot continue a cached state")
        starts = segment_starts(segments)
        sums = _segmented_cumsum(v, starts, dim=2).to(dtype)
        counts = _segmented_cumsum(keep, starts, dim=1).to(dtype)
    else:
        sums = v.cumsum(dim=2)
        counts = keep.cumsum(dim=1)
    if state_sum is not None:
        sums = sums + state_sum[:, :, None, :].to(dtype)
        counts = counts + state_count[:, None].to(dtype)
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


# Up to this many sequences, per-sequence weights are applied with one batched GEMM per sequence on strided
# views; beyond it, one 4-D matmul (which copies q/k head-major) has less call overhead.
_LOOP_MAX_BATCH = 4


def _head_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    """(B, H, N, x) -> an (H, B*N, x) view when t is token-major in memory (a split projection), else None."""
    batch, heads, length, width = t.shape
    rows = t.permute(1, 0, 2, 3)
    if batch > 1 and rows.stride(1) != length * rows.stride(2):
        return None
    return rows.as_strided((heads, batch * length, width), (rows.stride(0), rows.stride(2), rows.stride(3)))


def _mul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if torch.compiler.is_compiling():  # Dynamo rejects a strided out=; the compiler fuses the copy anyway
        out.copy_(a * b)
    else:
        torch.mul(a, b, out=out)


def _scores_into(out: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
    """out[...] = (v w) * scale for (B, H, N, d) v and (B, H, d, s) per-sequence or (H, d, s) shared w."""
    if w.dim() == 3:
        rows = _head_rows(v)
        if rows is not None:  # shared weights: one GEMM per head over every token of the batch
            raw = torch.bmm(rows, w).view(w.shape[0], v.shape[0], v.shape[2], -1).transpose(0, 1)
        else:
            raw = torch.einsum("bhnd,hds->bhns", v, w)
        _mul_into(out, raw, scale)
    elif v.shape[0] <= _LOOP_MAX_BATCH:
        for b in range(v.shape[0]):
            _mul_into(out[b], torch.bmm(v[b], w[b]), scale[b])
    else:
        _mul_into(out, torch.matmul(v, w), scale)


def _input_grad(g_v: torch.Tensor, g_raw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """g_v + g_raw w^T, accumulated in place into g_v's own (token-major) layout where possible."""
    if w.dim() == 3:
        rows, g_rows = _head_rows(g_v), _head_rows(g_raw)
        if rows is not None and g_rows is not None:
            rows.baddbmm_(g_rows, w.mT)
            return g_v
        return g_v + torch.einsum("bhns,hds->bhnd", g_raw, w)
    if g_v.shape[0] <= _LOOP_MAX_BATCH:
        for b in range(g_v.shape[0]):
            g_v[b].baddbmm_(g_raw[b], w[b].mT)
        return g_v
    return g_v + torch.matmul(g_raw, w.mT)


def _weight_grad(v: torch.Tensor, g_raw: torch.Tensor, shared: bool) -> torch.Tensor:
    """d(v w)/dw contracted with g_raw: (B, H, d, s), or (H, d, s) summed over sequences when shared.

    (s x N)(N x d) runs ~1.4x faster in MKL than (d x N)(N x s) for these thin shapes (measured, fp32 CPU).
    """
    if shared:
        rows, g_rows = _head_rows(v), _head_rows(g_raw)
        if rows is not None and g_rows is not None:
            return torch.bmm(g_rows.mT, rows).mT
        return torch.einsum("bhns,bhnd->hds", g_raw, v)
    if v.shape[0] <= _LOOP_MAX_BATCH:
        return torch.stack([torch.bmm(g_raw[b].mT, v[b]).mT for b in range(v.shape[0])])
    return torch.matmul(g_raw.mT, v).mT


def _inverse_norm(v: torch.Tensor, floor: Union[float, torch.Tensor], keep: Optional[torch.Tensor], live: bool = True):
    """(B, H, N, d) -> 1 / max(||v||, floor) as (B, H, N, 1), 0 at dropped tokens; and where the norm is live
    (None when `live` is False: only the backward needs it).

    The norm accumulates in fp32 (or wider) without a widened copy of v.
    """
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=torch.promote_types(v.dtype, torch.float32))
    where_live = norm > floor if live else None  # where the floor is active, 1 / floor does not depend on v
    if isinstance(floor, torch.Tensor):
        inv = torch.maximum(norm, floor).reciprocal_()
    else:
        inv = norm.clamp_(min=floor).reciprocal_()
    if keep is not None:
        inv = inv.masked_fill(~keep, 0.0)
        if where_live is not None:
            where_live = where_live & keep
    return inv, where_live


def _heads_forward(q, k, w_e, w_r, weight, bias, floor, keep, for_backward: bool = False, with_s2: bool = True):
    """The forward of `_PrimalHeads` as plain tensor code: (y as (B, N, H, d), S2 or None, what backward keeps).

    Without `for_backward` (no autograd graph to build) the liveness masks are not formed and nothing is kept;
    without `with_s2` the KSVD sums are skipped (decoding needs only y).
    """
    batch, heads, length, _ = q.shape
    s = w_e.shape[-1]
    cdtype = torch.promote_types(q.dtype, torch.float32)
    inv_q, live_q = _inverse_norm(q, floor, keep, live=for_backward)
    inv_k, live_k = _inverse_norm(k, floor, keep, live=for_backward)
    # Columns: [e | r | keep flag | zero padding]. The flag column carries the bias, so dropped rows come
    # out exactly 0; padding the width to a multiple of 16 makes the head-map GEMMs ~1.4x faster in MKL.
    width = -(-(2 * s + 1) // 16) * 16
    z = torch.empty(batch, length, heads, width, dtype=cdtype, device=q.device)
    zt = z.transpose(1, 2)
    _scores_into(zt[..., :s], q, w_e, inv_q)
    _scores_into(zt[..., s : 2 * s], k, w_r, inv_k)
    # (B, H, 2s); vector_norm over this axis is ~9x slower on CPU
    s2 = z[..., : 2 * s].square().sum(dim=1) if with_s2 else None
    zt[..., 2 * s] = 1.0 if keep is None else keep[..., 0]
    zt[..., 2 * s + 1 :] = 0.0
    full_weight = torch.cat([weight, bias[:, None], weight.new_zeros(weight.shape[0], width - 2 * s - 1)], dim=1)
    mm_dtype = q.dtype
    y = torch.matmul(z.to(mm_dtype), full_weight.to(mm_dtype).mT)
    saved = (full_weight, z, inv_q, inv_k, live_q, live_k) if for_backward else ()
    return y, s2, saved


class _PrimalHeads(torch.autograd.Function):
    """Everything between the q/k projections and the merged heads, with a hand-fused backward.

    Per sequence and head, with the cosine feature map folded into a per-token scale of the scores:
        z = [ (q w_e) / max(||q||, floor) | (k w_r) / max(||k||, floor) ]   (zero at dropped tokens)
        y = z W^T + b                                                       (b only at kept tokens)
        S2 = sum over tokens of z^2                                         (the KSVD sums need only this)
    z is written once, token-major (B, N, H, 2s + padding), so the head map is one GEMM and y comes out as
    (B, N, H, d): merging heads is a free view. The backward reuses the gradient buffer of z in place and
    folds the gradient of the norm into the input GEMM (g_q = c q + g_e w_e^T), where autograd would
    materialise q_hat, the scores, their squares and a layout copy of g_q. Scores and S2 are fp32.
    """

    @staticmethod
    def forward(ctx, q, k, w_e, w_r, weight, bias, floor, keep):
        # q, k: (B, H, N, d); w_e, w_r: (B, H, d, s) or (H, d, s); weight (d, 2s), bias (d,);
        # floor: float or (B, 1, N, 1); keep: (B, 1, N, 1) bool or None (every token kept).
        y, s2, saved = _heads_forward(q, k, w_e, w_r, weight, bias, floor, keep, for_backward=True)
        ctx.save_for_backward(q, k, w_e, w_r, *saved)
        ctx.dtypes = (weight.dtype, bias.dtype, w_e.dtype, y.dtype)
        return y.transpose(1, 2), s2

    @staticmethod
    def backward(ctx, g_y, g_s2):
        q, k, w_e, w_r, full_weight, z, inv_q, inv_k, live_q, live_k = ctx.saved_tensors
        weight_dtype, bias_dtype, w_dtype, mm_dtype = ctx.dtypes
        batch, heads, length, d = q.shape
        s = w_e.shape[-1]
        cdtype = z.dtype
        if g_y is None:
            g_y = torch.zeros(batch, heads, length, d, dtype=mm_dtype, device=q.device)
        g_yt = g_y.transpose(1, 2).to(mm_dtype)  # (B, N, H, d): contiguous when heads were merged afterwards
        rows = g_yt.reshape(-1, d)
        z_rows = z.view(-1, z.shape[-1]).to(mm_dtype)
        g_full = (z_rows.mT @ rows).mT  # (d, width); this orientation is the faster one in MKL
        g_weight = g_full[:, : 2 * s].to(weight_dtype).contiguous()
        g_bias = g_full[:, 2 * s].to(bias_dtype).contiguous()
        g_z = (rows @ full_weight.to(mm_dtype)).to(cdtype).view(z.shape)[..., : 2 * s]  # fresh buffer, edited in place
        z_s = z[..., : 2 * s]
        if g_s2 is not None:
            g_z.addcmul_(z_s, 2.0 * g_s2[:, None].to(cdtype))  # KSVD sums: dS2/dz = 2z
        # sum_s g_e * e per token and head, i.e. g_inv * inv, separately for the q and k halves.
        g_scale = (g_z * z_s).view(batch, length, heads, 2, s).sum(dim=-1).transpose(1, 2)  # (B, H, N, 2)
        g_zt = g_z.transpose(1, 2)
        g_e, g_r = g_zt[..., :s], g_zt[..., s:]
        g_e.mul_(inv_q)  # now the gradient of the unscaled scores q w_e
        g_r.mul_(inv_k)
        grads = []
        for v, w, inv, live, g_raw, gs in (
            (q, w_e, inv_q, live_q, g_e, g_scale[..., 0:1]),
            (k, w_r, inv_k, live_k, g_r, g_scale[..., 1:2]),
        ):
            # d(1/||v||)/dv = -v / ||v||^3 where the norm is live; g_inv = gs / inv.
            coef = (gs * inv.square()).masked_fill(~live, 0.0).neg()
            g_raw_mm = g_raw.to(v.dtype)
            g_v = _input_grad(v * coef.to(v.dtype), g_raw_mm, w.to(v.dtype))
            grads.append((g_v, _weight_grad(v, g_raw_mm, w.dim() == 3).to(w_dtype)))
        (g_q, g_we), (g_k, g_wr) = grads
        return g_q, g_k, g_we, g_wr, g_weight, g_bias, None, None


class PrimalCore(nn.Module):
    """The parameters Primal-Attention adds to one attention layer, and its math.

    Attributes:
        We, Wr: (H, rows, s) projection weights; rows = p (non-causal, data-dependent) or d (causal).
        Lambda: (H, s) KSVD regulariser weights; used only by the loss, never by the output.
        head_map: the 2s -> d linear map shared by all heads.
    """

    _is_primal_core = True
    sampling = "even"  # the sampling rule (`SAMPLING_RULES`); conversion sets PrimalAttentionConfig.sampling

    def __init__(self, num_heads: int, head_dim: int, low_rank: int, num_samples: int, causal: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.low_rank = low_rank
        self.causal = causal
        self.num_samples = num_samples
        rows = head_dim if causal else num_samples
        self.We = nn.Parameter(torch.empty(num_heads, rows, low_rank))
        self.Wr = nn.Parameter(torch.empty(num_heads, rows, low_rank))
        self.Lambda = nn.Parameter(torch.empty(num_heads, low_rank))
        self.head_map = nn.Linear(2 * low_rank, head_dim)
        self.reset_parameters()

    def extra_repr(self) -> str:
        kind = "causal" if self.causal else f"non-causal, p={self.num_samples}"
        return f"heads={self.num_heads}, head_dim={self.head_dim}, low_rank={self.low_rank}, {kind}"

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # Orthogonal over the whole (H, rows, s) tensor, as the reference code does: torch flattens the
        # trailing dims, so the H head matrices are mutually orthonormal vectors of Frobenius norm 1.
        if self.We.device.type != "meta":
            nn.init.orthogonal_(self.We)
            nn.init.orthogonal_(self.Wr)
            nn.init.uniform_(self.Lambda, 0.0, 1.0)

    # ------------------------------------------------------------------ shared pieces
    def _finish(
        self,
        v_q: torch.Tensor,
        v_k: torch.Tensor,
        w_e: torch.Tensor,
        w_r: torch.Tensor,
        floor: Union[float, torch.Tensor],
        valid: Optional[torch.Tensor],
        need_terms: bool = True,
    ) -> tuple[torch.Tensor, Optional[KSVDTerms]]:
        """Scores, head map and KSVD sums shared by both variants.

        v_q, v_k: (B, H, N, d) rows whose normalisation is the feature map; w_e, w_r: their projection
        weights. Returns y as a (B, H, N, d) view of a token-major (B, N, H, d) tensor, and the KSVD terms (None
        when not `need_terms`).
        """
        batch, heads, length, _ = v_q.shape
        s = self.low_rank
        keep = None if valid is None else valid[:, None, :, None]
        weight, bias = self.head_map.weight, self.head_map.bias
        graph = torch.is_grad_enabled() and any(
            t.requires_grad for t in (v_q, v_k, w_e, w_r, weight, bias, self.Lambda)
        )
        if graph:
            if self.Lambda.requires_grad:
                # Lambda enters only the KSVD loss. A zero-weight tie on the (d,) bias makes it reachable from the
                # layer output, which DDP with find_unused_parameters=True (Trainer's default) needs; tying the
                # terms to the (B, N, C) output instead cost a full-size add and its reduction in backward.
                bias = bias + (self.Lambda.sum() * 0.0).to(bias.dtype)
            y, s2 = _PrimalHeads.apply(v_q, v_k, w_e, w_r, weight, bias, floor, keep)
        else:  # no graph to build (inference, evaluation, decoding): no autograd node, no liveness masks
            y, s2, _ = _heads_forward(v_q, v_k, w_e, w_r, weight, bias, floor, keep, with_s2=need_terms)
            y = y.transpose(1, 2)
        if not need_terms:
            return y, None
        wide = torch.promote_types(self.Lambda.dtype, torch.float32)  # fp32, or fp64 for a float64 module
        lam2 = self.Lambda.to(wide).square()[None]  # (1, H, s)
        e_sum = 0.5 * (s2[..., :s] * lam2).sum(dim=(1, 2))
        r_sum = 0.5 * (s2[..., s:] * lam2).sum(dim=(1, 2))
        if valid is None:
            count = torch.full((batch,), float(heads * length), device=v_q.device)
        else:
            count = valid.sum(dim=1).float() * heads
        trace = (self.We.to(wide) * self.Wr.to(wide)).sum(dim=(1, 2)).mean()
        return y, KSVDTerms(e_sum, r_sum, count, trace)

    def _decode_step(
        self, q: torch.Tensor, k: torch.Tensor, valid: Optional[torch.Tensor], state: CausalState
    ) -> tuple[torch.Tensor, CausalState]:
        """`causal_forward` for one new token continuing `state`, without autograd and without KSVD terms.

        The general path builds (B, H, L, d) prefix sums, per-token counts, clones and the scores buffer for a
        single token; here the new state is the old one plus this token's q / k, and y is two small GEMMs and the
        head map on (B, H, 1, .) tensors. Same math: S / max(||S||, eps * c) = normalize(S / c), computed in the
        state's fp32 (or wider), which also keeps half-precision models from overflowing.
        """
        wide = state.sum_q.dtype
        q1, k1 = q[:, :, 0].to(wide), k[:, :, 0].to(wide)  # (B, H, d)
        if valid is None:
            count = state.count + 1.0
            keep = None
        else:
            keep = valid[:, 0]
            drop = ~keep[:, None, None]
            q1, k1 = q1.masked_fill(drop, 0.0), k1.masked_fill(drop, 0.0)
            count = state.count + keep.to(state.count.dtype)
        sum_q, sum_k = state.sum_q + q1, state.sum_k + k1
        floor = (count.clamp(min=1.0) * NORM_EPS).to(wide)[:, None, None, None]  # (B, 1, 1, 1)
        scores = []
        for total, w in ((sum_q, self.We), (sum_k, self.Wr)):
            rows = total[:, :, None, :]  # (B, H, 1, d)
            norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True)
            scores.append(torch.matmul(rows, w.to(wide)) / torch.maximum(norm, floor))  # (B, H, 1, s)
        dtype = q.dtype
        y = F.linear(torch.cat(scores, dim=-1).to(dtype), self.head_map.weight.to(dtype), self.head_map.bias.to(dtype))
        if keep is not None:  # padded tokens output exactly zero, as in the full forward
            y = y.masked_fill(~keep[:, None, None, None], 0.0)
        return y, CausalState(sum_q, sum_k, count)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        x: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None,
        state: Optional[CausalState] = None,
        segments: Optional[torch.Tensor] = None,
        history: int = 0,
    ) -> tuple[torch.Tensor, Optional[KSVDTerms], Optional[CausalState]]:
        """Dispatch to `noncausal` or `causal_forward`; returns (y, terms, new_state or None); terms are None for a
        decoding step (see `causal_forward`).

        `segments` ((B, N) ids, or None) marks sequences packed in one row, which must not see each other.
        `history` (causal only): see `causal_forward`.
        """
        if self.causal:
            return self.causal_forward(q, k, valid, state, segments, history)
        if x is None:
            raise ValueError("non-causal Primal-Attention needs the layer input `x` to sample tokens from")
        y, terms = self.noncausal(q, k, x, valid, segments)
        return y, terms, None

    # ------------------------------------------------------------------ variants
    def noncausal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        x: torch.Tensor,
        valid: Optional[torch.Tensor],
        segments: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, KSVDTerms]:
        """docs/method.md, "Non-causal layer".

        Args:
            q, k: (B, H, N, d) projected queries and keys (no 1/sqrt(d) scaling).
            x: (B, N, H*d) the tensor fed to the attention sub-layer; its sampled tokens build W_{e|X}, W_{r|X}.
            valid: (B, N) bool or None (all tokens valid).
            segments: (B, N) ids of sequences packed in one row, or None; each runs as a sequence of its own.
        Returns:
            y: (B, H, N, d) per-head outputs, zero at invalid tokens (a view of a (B, N, H, d) tensor, so
            ``y.transpose(1, 2).reshape(B, N, H*d)`` is free); the KSVD terms (per row).
        """
        if segments is not None:
            return self._noncausal_packed(q, k, x, valid, segments)
        batch, heads, length, dim = q.shape
        if x.shape[-1] != heads * dim:
            raise ValueError(
                f"Primal-Attention splits the layer input into heads and needs hidden_size == num_heads * head_dim; "
                f"got hidden_size={x.shape[-1]}, num_heads={heads}, head_dim={dim}."
            )
        we_x, wr_x = self._sampled_weights(x, valid, q.dtype)
        return self._finish(q, k, we_x, wr_x, NORM_EPS, valid)

    def _sampled_weights(
        self, x: torch.Tensor, valid: Optional[torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """W_{e|X} = X_s^T W_e and W_{r|X} = X_s^T W_r per sequence and head: (B, N, C) -> 2 x (B, H, d, s) views.

        One contraction with [W_e | W_r] serves both. When the sequences are shorter than p, sampled tokens repeat:
        summing the weight rows of the slots that hold each token first and contracting over the N tokens instead
        of the p sampled rows is the same sum at N / p of the cost (a ~60-token MiniLM batch with p = 300: ~5x
        less), without the (B, p, C) gather. Every sampling rule gives slots in token order (non-decreasing
        positions), so the slots of token n are a contiguous range [start_n, end_n) and their sum is a difference
        of prefix sums of the weight rows (fp32 or wider): two row gathers instead of a (B, p, H * 2s) scatter.
        """
        batch, length, width = x.shape
        heads, p, s = self.We.shape
        dim = width // heads
        w = torch.cat([self.We, self.Wr], dim=-1).to(dtype)  # (H, p, 2s)
        if length < p:
            wide = torch.promote_types(dtype, torch.float32)
            rows = w.transpose(0, 1).reshape(p, heads * 2 * s).to(wide)  # slot-major: row j is slot j of every head
            prefix = torch.cat([rows.new_zeros(1, rows.shape[1]), rows.cumsum(dim=0)])  # (p + 1, H * 2s)
            tokens = x.reshape(batch, length, heads, dim).to(dtype)
            positions = torch.arange(length, device=x.device)
            if valid is None:  # one index for the whole batch
                idx = _even_positions(length, p, x.device, self.sampling)
                start = torch.searchsorted(idx, positions)
                end = torch.searchsorted(idx, positions, right=True)
                per_token = (prefix[end] - prefix[start]).to(dtype).view(length, heads, 2 * s)
                both = torch.einsum("bnhd,nhs->bhds", tokens, per_token)
            else:
                idx = sample_token_indices(valid, p, self.sampling)  # (B, p), sorted along p
                positions = positions.expand(batch, length).contiguous()
                start = torch.searchsorted(idx, positions)
                end = torch.searchsorted(idx, positions, right=True)
                per_token = (prefix[end] - prefix[start]).to(dtype).view(batch, length, heads, 2 * s)
                both = torch.einsum("bnhd,bnhs->bhds", tokens, per_token)
        else:
            sampled = _sample_tokens(x, valid, p, self.sampling).reshape(batch, p, heads, dim).to(dtype)
            # Contracting over p keeps the weights (H, p, 2s): no per-sequence copy of W_e, W_r.
            both = torch.einsum("bphd,hps->bhds", sampled, w)  # (B, H, d, 2s)
        return both[..., :s], both[..., s:]

    def causal_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        valid: Optional[torch.Tensor],
        state: Optional[CausalState] = None,
        segments: Optional[torch.Tensor] = None,
        history: int = 0,
    ) -> tuple[torch.Tensor, Optional[KSVDTerms], CausalState]:
        """docs/method.md, "Causal layer", continuing from `state` when given (incremental decoding).

        Args:
            q, k: (B, H, L, d) projections of the L new tokens.
            valid: (B, L) bool or None; invalid tokens neither enter the prefix means nor get an output.
            state: running sums over the tokens before these L, or None at the start of a sequence.
            segments: (B, L) ids of sequences packed in one row, or None: prefix sums restart at each new id
                (not with `state`).
            history: when > 0, the returned state holds the states after each of the last min(L, history) new
                tokens along a token axis (sums (B, H, n, d), count (B, n)), oldest first; the state after all L
                tokens is the last entry. Caches keep these to roll back (crop) tokens exactly.
        Returns:
            y (B, H, L, d) (a view of a (B, L, H, d) tensor), the KSVD terms over the new valid tokens (None when
            decoding: continuing `state` with autograd off), and the state after the L tokens (of the last packed
            sequence).
        """
        batch, heads, length, dim = q.shape
        dtype = q.dtype
        if segments is not None and state is not None:
            raise ValueError("packed segments start new sequences: they cannot continue a cached state")
        # Decoding: continuing a cached state with autograd off. Generation never reads the KSVD terms, so they are
        # skipped (terms None). A fresh sequence (state None: training, evaluation under no_grad with a cache that
        # transformers creates, or a prefill) always gets them, so the loss and PrimalTrainer's eval see them.
        decoding = state is not None and not torch.is_grad_enabled()
        if decoding and length == 1 and history == 0:
            y, new_state = self._decode_step(q, k, valid, state)
            return y, None, new_state
        if valid is not None:
            drop = ~valid[:, None, :, None]
            q, k = q.masked_fill(drop, 0.0), k.masked_fill(drop, 0.0)
            counts = valid.float()
        else:
            counts = torch.ones(batch, length, device=q.device, dtype=torch.float32)
        # fp32 running sums: long prefixes lose precision in half precision.
        wide = torch.promote_types(dtype, torch.float32)
        if segments is not None:
            starts = segment_starts(segments)
            sum_q = _segmented_cumsum(q, starts, dim=2).to(wide)
            sum_k = _segmented_cumsum(k, starts, dim=2).to(wide)
            counts = _segmented_cumsum(counts, starts, dim=1).float()
        else:
            sum_q = torch.cumsum(q, dim=2, dtype=wide)
            sum_k = torch.cumsum(k, dim=2, dtype=wide)
            counts = counts.cumsum(dim=1)  # (B, L)
        if state is not None:
            sum_q = sum_q + state.sum_q[:, :, None, :]
            sum_k = sum_k + state.sum_k[:, :, None, :]
            counts = counts + state.count[:, None]
        # Clones, so that a cache holding the state does not pin the whole (B, H, L, d) prefix sums.
        if history > 0:
            n = min(length, int(history))
            new_state = CausalState(sum_q[:, :, -n:, :].clone(), sum_k[:, :, -n:, :].clone(), counts[:, -n:].clone())
        else:
            new_state = CausalState(sum_q[:, :, -1, :].clone(), sum_k[:, :, -1, :].clone(), counts[:, -1].clone())
        denom = counts.clamp(min=1.0)[:, None, :, None]
        if dtype == torch.float16:  # raw sums can overflow fp16 in the matmul: use the prefix means
            sum_q, sum_k, floor = sum_q / denom, sum_k / denom, NORM_EPS
        else:  # normalize(S / c) == S / max(||S||, eps * c) for c > 0: the means are never formed
            floor = denom * NORM_EPS
        y, terms = self._finish(
            sum_q.to(dtype), sum_k.to(dtype), self.We.to(dtype), self.Wr.to(dtype), floor, valid,
            need_terms=not decoding,
        )
        return y, terms, new_state

    def _noncausal_packed(
        self, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, valid: Optional[torch.Tensor], segments: torch.Tensor
    ) -> tuple[torch.Tensor, KSVDTerms]:
        """`noncausal` with every packed segment run as a sequence of its own (zero-padded to the longest)."""
        packing = _Packing.build(segments)
        keep = torch.ones_like(segments, dtype=torch.bool) if valid is None else valid
        y, terms = self.noncausal(
            packing.pack(q.transpose(1, 2)).transpose(1, 2),
            packing.pack(k.transpose(1, 2)).transpose(1, 2),
            packing.pack(x),
            packing.pack(keep),
        )
        y = packing.unpack(y.transpose(1, 2)).transpose(1, 2)  # a view of (B, N, H, d), like the unpacked path
        terms = KSVDTerms(packing.per_row(terms.e_sum), packing.per_row(terms.r_sum), packing.per_row(terms.count),
                          terms.trace)
        return y, terms

    # ------------------------------------------------------------------ attention matrix
    def key_features(
        self, k: torch.Tensor, valid: Optional[torch.Tensor], state: Optional[CausalState] = None
    ) -> torch.Tensor:
        """Causal layers: the normalised prefix-mean keys k_hat of L new tokens, (B, H, L, d), zero at invalid
        tokens: what a cache keeps to give later steps the columns of earlier tokens."""
        k_hat = prefix_mean_features(
            k, valid, None if state is None else state.sum_k, None if state is None else state.count
        )
        return k_hat if valid is None else k_hat * valid[:, None, :, None].to(k_hat.dtype)

    def attention_kernel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        x: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None,
        state: Optional[CausalState] = None,
        segments: Optional[torch.Tensor] = None,
        past_keys: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The asymmetric kernel matrix whose KSVD this layer computes, for the L new tokens.

        Non-causal: K_h = q_hat F_h^T F_h k_hat^T (B, H, L, L), F_h the head-h block of the sampled layer-input
        rows (cosine feature map on q, k). Causal: K_ij = <q_hat_i, k_hat_j> on the normalised prefix means for
        j <= i, (B, H, L, P + L) with the P earlier tokens' keys taken from `past_keys` (needed with `state`).
        Rows and columns of invalid tokens, and entries across packed segments, are zero. Not a probability
        matrix: entries can be negative and rows do not sum to 1. Computed with autograd ops (fp32 or wider).

        Returns:
            the kernel and, for causal layers, the new tokens' k_hat (`key_features`) to append to `past_keys`.
        """
        heads = q.shape[1]
        if self.causal:
            if state is not None and past_keys is None:
                raise ValueError(
                    "the attention matrix of a causal primal layer continuing a cached state needs the earlier "
                    "tokens' normalised keys, which the cache keeps only once attentions were requested"
                )
            q_hat = prefix_mean_features(
                q, valid, None if state is None else state.sum_q, None if state is None else state.count, segments
            )
            k_hat = prefix_mean_features(
                k, valid, None if state is None else state.sum_k, None if state is None else state.count, segments
            )
            if valid is not None:
                k_hat = k_hat * valid[:, None, :, None].to(k_hat.dtype)
            keys = k_hat if past_keys is None else torch.cat([past_keys.to(k_hat.dtype), k_hat], dim=2)
            kernel = kernel_matrix(q_hat, keys, row_valid=valid, causal=True, segments=segments)
            return kernel, k_hat
        if x is None:
            raise ValueError("non-causal Primal-Attention needs the layer input `x` to sample tokens from")
        if segments is not None:
            packing = _Packing.build(segments)
            keep = torch.ones_like(segments, dtype=torch.bool) if valid is None else valid
            packed, _ = self.attention_kernel(
                packing.pack(q.transpose(1, 2)).transpose(1, 2),
                packing.pack(k.transpose(1, 2)).transpose(1, 2),
                packing.pack(x),
                packing.pack(keep),
            )
            # (G, H, W, W) -> (B, H, N, N): entry (i, j) of a row is entry (slot_i, slot_j) of their sequence.
            by_slot = packed.permute(0, 2, 3, 1)
            group, slot = packing.group, packing.slot
            full = by_slot[group[:, :, None], slot[:, :, None], slot[:, None, :]]  # (B, N, N, H)
            same = (group[:, :, None] == group[:, None, :])[..., None]
            full = torch.where(same, full, torch.zeros((), dtype=full.dtype, device=full.device))
            return full.permute(0, 3, 1, 2), None
        q_hat = F.normalize(q.to(torch.promote_types(q.dtype, torch.float32)), dim=-1, eps=NORM_EPS)
        k_hat = F.normalize(k.to(q_hat.dtype), dim=-1, eps=NORM_EPS)
        gram = sampled_gram(x, valid, self.num_samples, heads, self.sampling).to(q_hat.dtype)
        return kernel_matrix(q_hat, k_hat, gram, row_valid=valid, col_valid=valid), None


def num_sampled_tokens(max_tokens: int, low_rank: int, rank_multi: int) -> int:
    """p = min(N_max, s * m) (docs/method.md, "Non-causal layer" step 3)."""
    return max(1, min(int(max_tokens), low_rank * rank_multi))


def ksvd_objective(terms: KSVDTerms, reduction: str = "sequence") -> torch.Tensor:
    """J of one layer: (B,) per sequence, or a scalar over the batch (docs/method.md, "The KSVD loss").

    Sequences without valid tokens get J = 0 - trace in the per-sequence form; callers drop them.
    """
    if reduction == "sequence":
        count = terms.count.clamp(min=1.0)
        return terms.e_sum / count + terms.r_sum / count - terms.trace
    if reduction == "batch":
        count = terms.count.sum().clamp(min=1.0)
        return terms.e_sum.sum() / count + terms.r_sum.sum() / count - terms.trace
    raise ValueError(f"reduction={reduction!r} is not allowed: use 'sequence' or 'batch'.")
