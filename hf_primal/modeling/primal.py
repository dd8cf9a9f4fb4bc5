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

The scores, head map and KSVD sums of both variants run in one autograd function with a hand-written backward,
`_PrimalHeads` (fused_heads.py, which also says how it is made fast on CPU). Token sampling is in sampling.py, packed
segments, prefix means and the kernel matrix in kernel.py, the one-token decoding step in decode.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .decode import decode_step
from .fused_heads import _heads_forward, _PrimalHeads
from .kernel import (
    NORM_EPS,
    _Packing,
    causal_log_decay,
    kernel_matrix,
    prefix_mean_features,
    prefix_sums,
    sampled_gram,
)
from .sampling import sampled_weights


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

    sum_q, sum_k: (B, H, d) fp32 sums of q and k over the valid tokens seen so far (under ``causal_mixing="decay"``
                  each token weighted by gamma_h^(its age in valid tokens)).
    count:        (B,) fp32 number of valid tokens seen so far.
    """

    sum_q: torch.Tensor
    sum_k: torch.Tensor
    count: torch.Tensor



def init_functions(init: Any, probe: torch.Tensor) -> Any:
    """`init` if given, else `torch.nn.init`; None (nothing to fill yet) for parameters on the meta device."""
    return init if init is not None else (None if probe.device.type == "meta" else nn.init)


class PrimalCore(nn.Module):
    """The parameters Primal-Attention adds to one attention layer, and its math.

    Attributes:
        We, Wr: (H, rows, s) projection weights; rows = p (non-causal, data-dependent) or d (causal).
        Lambda: (H, s) KSVD regulariser weights; used only by the loss, never by the output.
        head_map: the 2s -> d linear map shared by all heads.
    """

    _is_primal_core = True
    sampling = "even"  # the sampling rule (`SAMPLING_RULES`); conversion sets PrimalAttentionConfig.sampling
    # How a causal layer weighs earlier tokens (`CAUSAL_MIXING`); conversion sets PrimalAttentionConfig.causal_mixing.
    causal_mixing = "prefix_mean"

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
        kind = f"causal, {self.causal_mixing}" if self.causal else f"non-causal, p={self.num_samples}"
        return f"heads={self.num_heads}, head_dim={self.head_dim}, low_rank={self.low_rank}, {kind}"

    @torch.no_grad()
    def reset_parameters(self, init: Any = None) -> None:
        """docs/method.md, "Initialisation"; `init`: the init functions (the model hooks pass transformers', which
        skip tensors a checkpoint already filled)."""
        if (init := init_functions(init, self.We)) is None:
            return
        # Orthogonal over the whole (H, rows, s) tensor, as the reference code does: torch flattens the
        # trailing dims, so the H head matrices are mutually orthonormal vectors of Frobenius norm 1.
        init.orthogonal_(self.We)
        init.orthogonal_(self.Wr)
        init.uniform_(self.Lambda, 0.0, 1.0)

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
        """`causal_forward` for one new token continuing `state`, without autograd and without KSVD terms
        (hf_primal/modeling/decode.py)."""
        y, new_state = decode_step(
            q, k, valid, state, self.We, self.Wr, self.head_map.weight, self.head_map.bias, self.log_decay(q.device)
        )
        return y, CausalState(*new_state)

    def log_decay(self, device: torch.device) -> Optional[torch.Tensor]:
        """(H,) log gamma_h of this causal layer's heads, or None for the prefix mean (`causal_log_decay`)."""
        return causal_log_decay(self.num_heads, self.causal_mixing, device)

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
        we_x, wr_x = sampled_weights(x, valid, self.We, self.Wr, self.sampling, q.dtype, self.training)
        return self._finish(q, k, we_x, wr_x, NORM_EPS, valid)

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
        length, dtype = q.shape[2], q.dtype
        if segments is not None and state is not None:
            raise ValueError("packed segments start new sequences: they cannot continue a cached state")
        # Decoding: continuing a cached state with autograd off. Generation never reads the KSVD terms, so they are
        # skipped (terms None). A fresh sequence (state None: training, evaluation under no_grad with a cache that
        # transformers creates, or a prefill) always gets them, so the loss and PrimalTrainer's eval see them.
        decoding = state is not None and not torch.is_grad_enabled()
        if decoding and length == 1 and history == 0:
            y, new_state = self._decode_step(q, k, valid, state)
            return y, None, new_state
        sum_q, sum_k, counts = prefix_sums(q, k, valid, state, segments, self.log_decay(q.device))
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
        return _Packing.build(segments).run_noncausal(self.noncausal, q, k, x, valid)

    # ------------------------------------------------------------------ attention matrix
    def key_features(
        self, k: torch.Tensor, valid: Optional[torch.Tensor], state: Optional[CausalState] = None
    ) -> torch.Tensor:
        """Causal layers: the normalised prefix-mean keys k_hat of L new tokens, (B, H, L, d), zero at invalid
        tokens: what a cache keeps to give later steps the columns of earlier tokens."""
        k_hat = prefix_mean_features(
            k, valid, None if state is None else state.sum_k, None if state is None else state.count,
            log_decay=self.log_decay(k.device),
        )
        return k_hat if valid is None else k_hat * valid[:, None, :, None].to(k_hat.dtype)

    def attention_kernel(
        self, q: torch.Tensor, k: torch.Tensor, *, x: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None, segments: Optional[torch.Tensor] = None,
        state: Optional[CausalState] = None, past_keys: Optional[torch.Tensor] = None,
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
            log_decay = self.log_decay(q.device)
            q_hat = prefix_mean_features(
                q, valid, None if state is None else state.sum_q, None if state is None else state.count, segments,
                log_decay,
            )
            k_hat = prefix_mean_features(
                k, valid, None if state is None else state.sum_k, None if state is None else state.count, segments,
                log_decay,
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
            q_rows, k_rows, x_rows, valid_rows = packing.pack_inputs(q, k, x, valid)
            packed, _ = self.attention_kernel(q_rows, k_rows, x=x_rows, valid=valid_rows)
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
