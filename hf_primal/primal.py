"""Primal-Attention in plain torch: no transformers import here.

Shapes follow the method spec: B batch, H heads, N tokens, d head dim, C = H*d hidden size,
s = low_rank, p = sampled tokens (encoders only).

Two variants share one parameter module, `PrimalCore`:

* non-causal (encoders): data-dependent projection weights W_{e|X} = X_s^T W_e built from p tokens
  sampled evenly among the *valid* tokens of each sequence;
* causal (decoders): plain W_e, W_r applied to the normalised masked prefix means of q and k; the
  prefix sums double as the constant-size generation state.

Each call also returns `KSVDTerms`, the per-sequence sums the KSVD regulariser needs, so the loss can be
assembled later without keeping (B, H, N, s) score tensors alive.
"""

from __future__ import annotations


from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

NORM_EPS = 1e-12


class KSVDTerms(NamedTuple):
    """Per-sequence pieces of one layer's KSVD objective J (method spec §4), all fp32.

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


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """The cosine feature map, computed in fp32 (eps 1e-12 underflows in half precision)."""
    return F.normalize(x.float(), dim=-1, eps=NORM_EPS)


def sample_token_indices(valid: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Evenly spaced positions among the valid tokens of each sequence.

    For sequence b with valid positions v_b (L_b of them) returns idx[b, j] = v_b[floor(j (L_b - 1) / (p - 1))]
    for j = 0..p-1: indices repeat when L_b < p, and left or right padding give the same tokens. Integer
    arithmetic keeps the rule exact and identical on every device.

    Args:
        valid: (B, N) bool, True at real tokens.
        num_samples: p >= 1.
    Returns:
        (B, p) int64 positions into the N axis (0 where a sequence has no valid token).
    """
    batch, length = valid.shape
    lengths = valid.sum(dim=1, keepdim=True)  # (B, 1)
    j = torch.arange(num_samples, device=valid.device)
    if num_samples == 1:
        ranks = torch.zeros(batch, 1, dtype=torch.long, device=valid.device)
    else:
        ranks = (j[None, :] * (lengths - 1).clamp(min=0)) // (num_samples - 1)
    running = valid.long().cumsum(dim=1)
    # The position of the token of rank r is the first position where the running count reaches r + 1.
    idx = torch.searchsorted(running, ranks + 1)
    return idx.clamp(max=length - 1)


def _masked_score_sum(scores: torch.Tensor, lam: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """0.5 * sum over heads and valid tokens of ||lambda_h * score||^2 -> (B,), in fp32."""
    weighted = scores.float() * lam.float()[None, :, None, :]
    per_token = weighted.square().sum(dim=-1)  # (B, H, N)
    if valid is not None:
        per_token = per_token * valid[:, None, :].to(per_token.dtype)
    return 0.5 * per_token.sum(dim=(1, 2))


class PrimalCore(nn.Module):
    """The parameters Primal-Attention adds to one attention layer, and its math.

    Attributes:
        We, Wr: (H, rows, s) projection weights; rows = p (non-causal, data-dependent) or d (causal).
        Lambda: (H, s) KSVD regulariser weights; used only by the loss, never by the output.
        head_map: the 2s -> d linear map shared by all heads.
    """

    _is_primal_core = True

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
    def _terms(self, e: torch.Tensor, r: torch.Tensor, valid: Optional[torch.Tensor]) -> KSVDTerms:
        batch, heads, length = e.shape[:3]
        if valid is None:
            count = torch.full((batch,), float(heads * length), device=e.device)
        else:
            count = valid.sum(dim=1).float() * heads
        trace = (self.We.float() * self.Wr.float()).sum(dim=(1, 2)).mean()
        return KSVDTerms(_masked_score_sum(e, self.Lambda, valid), _masked_score_sum(r, self.Lambda, valid), count, trace)

    def _output(self, e: torch.Tensor, r: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        y = self.head_map(torch.cat([e, r], dim=-1))  # (B, H, N, d)
        if valid is not None:
            y = y * valid[:, None, :, None].to(y.dtype)
        return y

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        x: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None,
        state: Optional[CausalState] = None,
    ) -> tuple[torch.Tensor, KSVDTerms, Optional[CausalState]]:
        """Dispatch to `noncausal` or `causal_forward`; returns (y, terms, new_state or None)."""
        if self.causal:
            return self.causal_forward(q, k, valid, state)
        if x is None:
            raise ValueError("non-causal Primal-Attention needs the layer input `x` to sample tokens from")
        y, terms = self.noncausal(q, k, x, valid)
        return y, terms, None

    # ------------------------------------------------------------------ variants
    def noncausal(
        self, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, valid: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, KSVDTerms]:
        """Method spec §2.

        Args:
            q, k: (B, H, N, d) projected queries and keys (no 1/sqrt(d) scaling).
            x: (B, N, H*d) the tensor fed to the attention sub-layer; its sampled tokens build W_{e|X}, W_{r|X}.
            valid: (B, N) bool or None (all tokens valid).
        Returns:
            y: (B, H, N, d) per-head outputs, zero at invalid tokens; the KSVD terms.
        """
        batch, heads, length, dim = q.shape
        if x.shape[-1] != heads * dim:
            raise ValueError(
                f"Primal-Attention splits the layer input into heads and needs hidden_size == num_heads * head_dim; "
                f"got hidden_size={x.shape[-1]}, num_heads={heads}, head_dim={dim}."
            )
        dtype = q.dtype
        mask = valid if valid is not None else torch.ones(batch, length, dtype=torch.bool, device=q.device)
        idx = sample_token_indices(mask, self.num_samples)  # (B, p)
        sampled = torch.gather(x, 1, idx[:, :, None].expand(-1, -1, x.shape[-1]))  # (B, p, C)
        sampled = sampled.view(batch, self.num_samples, heads, dim).to(dtype)
        we_x = torch.einsum("bphd,hps->bhds", sampled, self.We.to(dtype))  # (B, H, d, s)
        wr_x = torch.einsum("bphd,hps->bhds", sampled, self.Wr.to(dtype))
        e = torch.matmul(l2_normalize(q).to(dtype), we_x)  # (B, H, N, s)
        r = torch.matmul(l2_normalize(k).to(dtype), wr_x)
        return self._output(e, r, valid), self._terms(e, r, valid)

    def causal_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        valid: Optional[torch.Tensor],
        state: Optional[CausalState] = None,
    ) -> tuple[torch.Tensor, KSVDTerms, CausalState]:
        """Method spec §3, continuing from `state` when given (incremental decoding).

        Args:
            q, k: (B, H, L, d) projections of the L new tokens.
            valid: (B, L) bool or None; invalid tokens neither enter the prefix means nor get an output.
            state: running sums over the tokens before these L, or None at the start of a sequence.
        Returns:
            y (B, H, L, d), the KSVD terms over the new valid tokens, and the state after the L tokens.
        """
        batch, heads, length, dim = q.shape
        dtype = q.dtype
        qf, kf = q.float(), k.float()
        if valid is not None:
            keep = valid[:, None, :, None].float()
            qf, kf = qf * keep, kf * keep
            counts = valid.float().cumsum(dim=1)  # (B, L)
        else:
            counts = torch.arange(1, length + 1, device=q.device, dtype=torch.float32).expand(batch, length)
        sum_q, sum_k = qf.cumsum(dim=2), kf.cumsum(dim=2)
        if state is not None:
            sum_q = sum_q + state.sum_q[:, :, None, :]
            sum_k = sum_k + state.sum_k[:, :, None, :]
            counts = counts + state.count[:, None]
        new_state = CausalState(sum_q[:, :, -1, :], sum_k[:, :, -1, :], counts[:, -1])
        denom = counts.clamp(min=1.0)[:, None, :, None]
        q_hat = l2_normalize(sum_q / denom).to(dtype)
        k_hat = l2_normalize(sum_k / denom).to(dtype)
        e = torch.matmul(q_hat, self.We.to(dtype))  # (B, H, L, s): (B,H,L,d) @ (H,d,s)
        r = torch.matmul(k_hat, self.Wr.to(dtype))
        return self._output(e, r, valid), self._terms(e, r, valid), new_state


def num_sampled_tokens(max_tokens: int, low_rank: int, rank_multi: int) -> int:
    """p = min(N_max, s * m) (method spec §2 step 3)."""
    return max(1, min(int(max_tokens), low_rank * rank_multi))


def ksvd_objective(terms: KSVDTerms, reduction: str = "sequence") -> torch.Tensor:
    """J of one layer: (B,) per sequence, or a scalar over the batch (method spec §4).

    Sequences without valid tokens get J = 0 - trace in the per-sequence form; callers drop them.
    """
    if reduction == "sequence":
        count = terms.count.clamp(min=1.0)
        return terms.e_sum / count + terms.r_sum / count - terms.trace
    if reduction == "batch":
        count = terms.count.sum().clamp(min=1.0)
        return terms.e_sum.sum() / count + terms.r_sum.sum() / count - terms.trace
    raise ValueError(f"reduction={reduction!r} is not allowed: use 'sequence' or 'batch'.")


