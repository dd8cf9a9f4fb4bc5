"""KEP-SVGP attention (Chen, Tao, Tonin, Suykens, ICML 2024) in plain torch: no transformers import here.

The KSVD of a primal layer also defines two sparse variational Gaussian processes whose inducing variables are the
layer's s singular directions; the prior covariance of the inducing variables is the diagonal matrix of singular
values squared, so the posterior needs no matrix inverse (docs/method.md, "KEP-SVGP").

Per head, with the primal scores e = q_hat W_{e|X}, r = k_hat W_{r|X} (B, H, N, s) and Lambda^{-1} = exp(2 theta):

    V = (e + r) Lambda^{-1}                       the inducing features of each token ("add" merge)
    F = V m_u  [+ noise]                          posterior mean [+ one sample of the posterior]
    y = W_out F                                   s -> d (`head_map`), shared by the heads; zero at padding

Two covariance readings of the same parameters (`covariance`):

* ``"reference"``: the authors' layer. L[a, i, j] = exp(gamma[a, i]) [i == j] + A[a, i, j] [i > j]; one standard
  normal vector eps_n in R^s per token, shared by its s outputs: noise[n, j] = sum_{a, i} V[n, a] L[a, i, j]
  eps_n[i]. Its KL (`kl_divergence`) is the formula of the authors' code, which is not the KL of what it samples.
* ``"consistent"``: for each output j a lower-triangular factor over the inducing index, L_j[a, i] =
  exp(gamma[j, a]) [a == i] + A[j, a, i] [a > i], and an independent eps_{n, j}: u_j ~ N(m_u[:, j], L_j L_j^T) and
  noise[n, j] = sum_{a, i} V[n, a] L_j[a, i] eps_{n, j}[i]. Its KL is the closed-form Gaussian KL of those u_j
  against the prior N(0, Lambda^2).

The GP math and the KL run in fp32 (or wider) whatever the input dtype: exp(4 theta) overflows fp16.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .kernel import NORM_EPS, _Packing, kernel_matrix, sampled_gram
from .primal import KSVDTerms, init_functions
from .sampling import sampled_weights

COVARIANCES = ("reference", "consistent")


class KEPSVGPCore(nn.Module):
    """The parameters of one KEP-SVGP attention layer (non-causal) and its math.

    Attributes:
        We, Wr: (H, p, s) projection weights of the sampled tokens, as in `PrimalCore`.
        theta: (H, s); Lambda = exp(-2 theta) are the singular values, exp(theta) the KSVD loss weights.
        m_u: (H, s, s) variational means, inducing index first.
        tril: (H, s, s, s) off-diagonal entries of the covariance factors (see the module docstring).
        log_diag: (H, s, s) logarithms of their diagonals.
        head_map: W_out, the s -> d map shared by the heads.
    """

    _is_primal_core = True
    causal = False
    sampling = "even"
    covariance = "consistent"

    def __init__(self, num_heads: int, head_dim: int, low_rank: int, num_samples: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.low_rank, self.num_samples = num_heads, head_dim, low_rank, num_samples
        s = low_rank
        self.We = nn.Parameter(torch.empty(num_heads, num_samples, s))
        self.Wr = nn.Parameter(torch.empty(num_heads, num_samples, s))
        self.theta = nn.Parameter(torch.empty(num_heads, s))
        self.m_u = nn.Parameter(torch.empty(num_heads, s, s))
        self.tril = nn.Parameter(torch.empty(num_heads, s, s, s))
        self.log_diag = nn.Parameter(torch.empty(num_heads, s, s))
        self.head_map = nn.Linear(s, head_dim)
        # Eval-mode forwards return the posterior mean unless sampling is switched on (`sampling_enabled`); training
        # draws one sample per forward. `generator` (or the global RNG of the inputs' device) draws the noise.
        self.sample_in_eval = False
        self.generator: Optional[torch.Generator] = None
        self.kl_term: Optional[torch.Tensor] = None
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, low_rank={self.low_rank}, p={self.num_samples}, "
                f"covariance={self.covariance}")

    @torch.no_grad()
    def reset_parameters(self, init: Any = None) -> None:
        """As `PrimalCore.reset_parameters`; the variational parameters start standard normal."""
        if (init := init_functions(init, self.We)) is None:
            return
        init.orthogonal_(self.We)
        init.orthogonal_(self.Wr)
        init.uniform_(self.theta, 0.0, 1.0)
        for tensor in (self.m_u, self.tril, self.log_diag):
            init.normal_(tensor, 0.0, 1.0)

    # ------------------------------------------------------------------ the GP head
    def factors(self) -> torch.Tensor:
        """The covariance factors (H, s, s, s), fp32 or wider: L[h, a, i, j] ("reference") or L_j[a, i] stored as
        [h, j, a, i] ("consistent"); both lower-triangular in their last two indices' reading."""
        wide = torch.promote_types(self.tril.dtype, torch.float32)
        s = self.low_rank
        eye = torch.eye(s, dtype=wide, device=self.tril.device)
        strict = torch.tril(torch.ones(s, s, dtype=torch.bool, device=self.tril.device), diagonal=-1)
        diag = self.log_diag.to(wide).exp()[..., :, None] * eye  # (H, s, s, s): exp(gamma[h, x, y]) at [.., y, y]
        return diag + self.tril.to(wide) * strict

    def noise(self, v: torch.Tensor, eps: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sampled part of F for inducing features `v` (B, H, N, s), fp32: one draw per token (`eps` given:
        (B, H, N, s) for "reference", (B, H, N, s, s) indexed [.., j, i] for "consistent")."""
        L = self.factors()
        if self.covariance == "reference":
            if eps is None:
                eps = torch.randn(v.shape, generator=self.generator, device=v.device, dtype=v.dtype)
            # sum_a V[n, a] sum_i L[a, i, j] eps[n, i]
            return torch.einsum("bhna,haij,bhni->bhnj", v, L, eps)
        if eps is None:
            eps = torch.randn(*v.shape, self.low_rank, generator=self.generator, device=v.device, dtype=v.dtype)
        # sum_a V[n, a] sum_i L_j[a, i] eps[n, j, i]
        return torch.einsum("bhna,hjai,bhnji->bhnj", v, L, eps)

    def kl_divergence(self) -> torch.Tensor:
        """The layer's KL term (summed over heads and outputs), fp32 or wider; it depends on the parameters only.

        Both readings give the same expression: 1/2 sum exp(4 theta_a) L^2 + 1/2 sum exp(4 theta_a) m_u^2 - sum gamma
        - 2 s sum theta - s^2 H / 2, the inducing index a being the first index of m_u and, in L, the first index
        ("reference") or the second ("consistent", which makes it the KL of N(m_u[:, j], L_j L_j^T) to N(0, Lambda^2)).
        """
        wide = torch.promote_types(self.theta.dtype, torch.float32)
        theta = self.theta.to(wide)
        s, heads = self.low_rank, self.num_heads
        scale = (4 * theta).exp()  # (H, s): exp(4 theta_a) = Lambda^{-2}
        L = self.factors()
        if self.covariance == "reference":  # L[h, a, i, j]
            trace = (scale[:, :, None, None] * L.square()).sum()
        else:  # L[h, j, a, i]
            trace = (scale[:, None, :, None] * L.square()).sum()
        mahalanobis = (scale[:, :, None] * self.m_u.to(wide).square()).sum()
        log_det = self.log_diag.to(wide).sum() + 2 * s * theta.sum()
        return 0.5 * trace + 0.5 * mahalanobis - log_det - 0.5 * s * s * heads

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, x: Optional[torch.Tensor] = None,
                valid: Optional[torch.Tensor] = None, state: None = None, segments: Optional[torch.Tensor] = None,
                history: int = 0) -> tuple[torch.Tensor, KSVDTerms, None]:
        """(y, KSVD terms, None): `PrimalCore.forward`'s interface (the layers call either core the same way) for a
        non-causal layer; `state` and `history` exist only for causal layers and are unused here."""
        if x is None:
            raise ValueError("KEP-SVGP attention needs the layer input `x` to sample tokens from")
        # The KL, for the trainer's loss: computed here, where the parameters are whole even when sharded (FSDP).
        self.kl_term = self.kl_divergence() if torch.is_grad_enabled() else None
        if segments is not None:
            y, terms = _Packing.build(segments).run_noncausal(self.noncausal, q, k, x, valid)
        else:
            y, terms = self.noncausal(q, k, x, valid)
        return y, terms, None

    def scores(
        self, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, valid: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The primal scores e, r (B, H, N, s) in fp32 or wider."""
        batch, heads, length, dim = q.shape
        if x.shape[-1] != heads * dim:
            raise ValueError(
                f"KEP-SVGP attention splits the layer input into heads and needs hidden_size == num_heads * head_dim; "
                f"got hidden_size={x.shape[-1]}, num_heads={heads}, head_dim={dim}."
            )
        wide = torch.promote_types(q.dtype, torch.float32)
        we_x, wr_x = sampled_weights(x, valid, self.We, self.Wr, self.sampling, wide, self.training)
        q_hat = F.normalize(q.to(wide), dim=-1, eps=NORM_EPS)
        k_hat = F.normalize(k.to(wide), dim=-1, eps=NORM_EPS)
        return torch.matmul(q_hat, we_x), torch.matmul(k_hat, wr_x)

    def noncausal(
        self, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, valid: Optional[torch.Tensor],
        eps: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, KSVDTerms]:
        """y (B, H, N, d) (a view of a (B, N, H, d) tensor, zero at invalid tokens) and the KSVD terms.

        Noise is drawn while training, or in eval mode with `sample_in_eval`; `eps` fixes the draw (tests).
        """
        batch, heads, length, _ = q.shape
        e, r = self.scores(q, k, x, valid)
        wide = e.dtype
        theta = self.theta.to(wide)
        v = (e + r) * (2 * theta).exp()[None, :, None, :]
        f = torch.matmul(v, self.m_u.to(wide))
        if eps is not None or self.training or self.sample_in_eval:
            f = f + self.noise(v, eps)
        y = F.linear(f, self.head_map.weight.to(wide), self.head_map.bias.to(wide))
        if valid is not None:
            y = y * valid[:, None, :, None].to(wide)
        y = y.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        lam2 = (2 * theta).exp()[None, :, None, :]  # exp(theta)^2, the KSVD weights
        keep = 1.0 if valid is None else valid[:, None, :, None].to(wide)
        e_sum = 0.5 * (lam2 * e.square() * keep).sum(dim=(1, 2, 3))
        r_sum = 0.5 * (lam2 * r.square() * keep).sum(dim=(1, 2, 3))
        count = (torch.full((batch,), float(heads * length), device=q.device) if valid is None
                 else valid.sum(dim=1).float() * heads)
        trace = (self.We.to(wide) * self.Wr.to(wide)).sum(dim=(1, 2)).mean()
        return y, KSVDTerms(e_sum, r_sum, count, trace)

    def attention_kernel(
        self, q: torch.Tensor, k: torch.Tensor, *, x: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None, segments: Optional[torch.Tensor] = None, **_: object,
    ) -> tuple[torch.Tensor, None]:
        """The asymmetric kernel of the layer's KSVD, as `PrimalCore.attention_kernel` (non-causal)."""
        if x is None:
            raise ValueError("KEP-SVGP attention needs the layer input `x` to sample tokens from")
        if segments is not None:
            raise ValueError("output_attentions with packed sequences is not supported by KEP-SVGP layers")
        q_hat = F.normalize(q.to(torch.promote_types(q.dtype, torch.float32)), dim=-1, eps=NORM_EPS)
        k_hat = F.normalize(k.to(q_hat.dtype), dim=-1, eps=NORM_EPS)
        gram = sampled_gram(x, valid, self.num_samples, q.shape[1], self.sampling).to(q_hat.dtype)
        return kernel_matrix(q_hat, k_hat, gram, row_valid=valid, col_valid=valid), None
