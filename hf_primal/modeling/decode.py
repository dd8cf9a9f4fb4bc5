"""One decoding step of a causal primal layer, in plain torch: the fast path of `PrimalCore.causal_forward`.

The general causal path builds (B, H, L, d) prefix sums, per-token counts, clones and the scores buffer for a
single token; here the new state is the old one plus this token's q / k, and y is two small GEMMs and the head map
on (B, H, 1, .) tensors. Same math: S / max(||S||, eps * c) = normalize(S / c), computed in the state's fp32 (or
wider), which also keeps half-precision models from overflowing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .kernel import NORM_EPS


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    valid: Optional[torch.Tensor],
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w_e: torch.Tensor,
    w_r: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    log_decay: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """y (B, H, 1, d) of one new token and the running (sum_q, sum_k, count) after it, without autograd ops that
    matter and without KSVD terms.

    Args:
        q, k: (B, H, 1, d) projections of the new token; valid: (B, 1) bool or None.
        state: (sum_q, sum_k, count) before the token, (B, H, d), (B, H, d), (B,) (a `CausalState`).
        w_e, w_r: the layer's (H, d, s) weights; weight, bias: its head map.
        log_decay: (H,) log gamma_h under ``causal_mixing="decay"`` (the sums age by gamma_h at a valid token), or
            None (plain sums).
    """
    sum_q0, sum_k0, count0 = state
    wide = sum_q0.dtype
    q1, k1 = q[:, :, 0].to(wide), k[:, :, 0].to(wide)  # (B, H, d)
    if valid is None:
        count = count0 + 1.0
        keep = None
    else:
        keep = valid[:, 0]
        drop = ~keep[:, None, None]
        q1, k1 = q1.masked_fill(drop, 0.0), k1.masked_fill(drop, 0.0)
        count = count0 + keep.to(count0.dtype)
    if log_decay is None:
        sum_q, sum_k = sum_q0 + q1, sum_k0 + k1
    else:
        gamma = log_decay.exp().to(wide)[None, :, None]  # (1, H, 1); a padded token does not age the sums
        left = gamma if keep is None else torch.where(keep[:, None, None], gamma, torch.ones((), dtype=wide))
        sum_q, sum_k = sum_q0 * left + q1, sum_k0 * left + k1
    floor = (count.clamp(min=1.0) * NORM_EPS).to(wide)[:, None, None, None]  # (B, 1, 1, 1)
    scores = []
    for total, w in ((sum_q, w_e), (sum_k, w_r)):
        rows = total[:, :, None, :]  # (B, H, 1, d)
        norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True)
        scores.append(torch.matmul(rows, w.to(wide)) / torch.maximum(norm, floor))  # (B, H, 1, s)
    dtype = q.dtype
    y = F.linear(torch.cat(scores, dim=-1).to(dtype), weight.to(dtype), bias.to(dtype))
    if keep is not None:  # padded tokens output exactly zero, as in the full forward
        y = y.masked_fill(~keep[:, None, None, None], 0.0)
    return y, (sum_q, sum_k, count)
