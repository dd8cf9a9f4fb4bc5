"""`ksvd_loss`: the KSVD regulariser of the most recent forward pass (docs/method.md, "The KSVD loss").

Each primal attention module keeps the `KSVDTerms` of its last forward on ``module.ksvd_terms``; this
module only gathers them. Code semantics of the paper's released code: Lambda squared, means over valid
tokens and heads, trace on the W_e/W_r parameters, mean over primal layers, all in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..modeling.architecture import primal_attention_modules
from ..modeling.config import KSVD_REDUCTIONS as REDUCTIONS
from ..modeling.primal import KSVDTerms, ksvd_objective


def _primal_modules(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in primal_attention_modules(model)]


def primal_model(model: nn.Module) -> nn.Module:
    """The module whose ``config.primal_attention`` applies: DDP / compile / PEFT wrappers hold the HF model below."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "primal_attention", None) is not None:
            return module
    return model


def _default_reduction(model: nn.Module) -> str:
    spec = getattr(getattr(primal_model(model), "config", None), "primal_attention", None)
    return spec.get("ksvd_reduction", "sequence") if isinstance(spec, dict) else "sequence"


def collect_ksvd_terms(model: nn.Module) -> list[KSVDTerms]:
    """The KSVD terms every primal layer kept from the last forward; raises if there are none."""
    modules = _primal_modules(model)
    if not modules:
        raise ValueError(
            f"ksvd_loss: {type(model).__name__} has no primal attention layer; build or load it with "
            "primal_attention=... (see hf_primal.PrimalAttentionConfig)."
        )
    terms = [getattr(m, "ksvd_terms", None) for m in modules]
    if any(t is None for t in terms):
        raise ValueError(
            "ksvd_loss: the primal layers hold no KSVD terms: either no forward pass has run through them yet, or the "
            "last one was a decoding step (continuing a cache with autograd off), which skips them; run a forward "
            "over whole sequences (with grad, or without a cache state) first."
        )
    return terms


def ksvd_from_terms(terms: list[KSVDTerms], reduction: str = "sequence") -> torch.Tensor:
    """Combine per-layer terms into the scalar regulariser."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"ksvd_loss: reduction={reduction!r} is not allowed: use one of {list(REDUCTIONS)}.")
    if reduction == "batch":
        return torch.stack([ksvd_objective(t, "batch").square() for t in terms]).mean()
    per_layer = torch.stack([ksvd_objective(t, "sequence").square() for t in terms])  # (layers, B)
    per_sequence = per_layer.mean(dim=0)
    has_tokens = terms[0].count > 0  # every layer sees the same valid tokens
    weights = has_tokens.to(per_sequence.dtype)
    return (per_sequence * weights).sum() / weights.sum().clamp(min=1.0)


def ksvd_loss(model: nn.Module, reduction: Optional[str] = None) -> torch.Tensor:
    """KSVD loss of the most recent forward pass of `model` (fp32 scalar, differentiable).

    Args:
        model: a model with primal layers (PEFT-, DDP- and torch.compile-wrapped models work too).
        reduction: ``"sequence"`` (J per sequence, squared, averaged over sequences: the default, and the
            paper's time-series/RL/NLP code) or ``"batch"`` (J over the whole batch: the paper's CV/LRA code).
            Defaults to the model's ``primal_attention["ksvd_reduction"]``.
    """
    reduction = reduction if reduction is not None else _default_reduction(model)
    return ksvd_from_terms(collect_ksvd_terms(model), reduction)


def kl_from_model(model: nn.Module) -> Optional[torch.Tensor]:
    """The KL term of the model's KEP-SVGP layers, summed over layers (fp32 scalar, differentiable), or None when it
    has none. Each layer's KL depends on its parameters only; the one its last forward computed (where sharded
    parameters are whole) is used, else it is computed now."""
    cores = [m.primal for m in _primal_modules(model) if hasattr(m.primal, "kl_divergence")]
    if not cores:
        return None
    terms = [core.kl_term if getattr(core, "kl_term", None) is not None else core.kl_divergence() for core in cores]
    return torch.stack([t.float() for t in terms]).sum()


def clear_ksvd_terms(model: nn.Module) -> None:
    """Drop the kept terms (and the graph they hold) from every primal layer."""
    for module in _primal_modules(model):
        module.ksvd_terms = None
        if hasattr(module.primal, "kl_term"):
            module.primal.kl_term = None
