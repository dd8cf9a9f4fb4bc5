"""The hand-written autograd function of primal layers, `_PrimalHeads`, in plain torch.

`_heads_forward` is its forward as plain tensor code, which inference runs directly when there is no graph to build.

Performance (CPU, fp32; scripts/benchmarks/layers.py measures the whole models): `_PrimalHeads` is one
autograd function from the q/k projections to the merged heads, with a hand-written backward.

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

from typing import Optional, Union

import torch

# Per-sequence weights are applied with one batched GEMM per sequence on strided views when there are few
# sequences or each is long; otherwise one 4-D matmul, which copies q/k head-major, has less call overhead.
# (fp32 CPU, one thread, training steps: the loop is ~10% faster per step at 32 x 256-4096 tokens, even at 32 x 128
# and 8 x 128-512, and ~4% slower at 32 x 64 tokens of a narrow model.)
_LOOP_MAX_BATCH = 4
_LOOP_MIN_LENGTH = 128


def _per_sequence(t: torch.Tensor) -> bool:
    """Whether to loop over the sequences of a (B, H, N, x) tensor (see `_LOOP_MAX_BATCH`)."""
    return t.shape[0] <= _LOOP_MAX_BATCH or t.shape[2] >= _LOOP_MIN_LENGTH


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
    elif _per_sequence(v):
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
    if _per_sequence(g_v):
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
    if _per_sequence(v):
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
