"""Singular-value spectrum of each layer's attention.

See docs/method.md, "Attention kernel and spectrum", and the paper's Figure 1.

For a model and one batch, `attention_spectrum` returns per layer the normalised cumulative singular values
c_k = sum_{i<=k} sigma_i / sum_i sigma_i (or with sigma^2) of every (sequence, head) attention matrix,
restricted to the sequence's valid tokens:

* softmax layers: the post-softmax attention probabilities (the model runs once with eager attention and
  ``output_attentions=True``; the attention implementation is restored afterwards);
* non-causal primal layers: the kernel the primal model implies, K = Q_hat F_h^T F_h K_hat^T per head, with
  F_h (p x d) the head block of the sampled tokens of the layer input (``primal_kernel="sampled"``), or
  K = Q_hat K_hat^T (``"identity"``, f(X) = I);
* causal primal layers: K = Q_hat K_hat^T on the normalised prefix means (plain W_e, W_r, f(X) = I).

The primal kernels are built by the same functions (`hf_primal.modeling.kernel`) as the matrices primal layers return
with ``output_attentions=True`` (the "sampled" one; for causal layers the spectrum is that of the full product,
not of its lower triangle). They have rank <= d, so their singular values come from a d x d core (QR of Q_hat
and K_hat) instead of an N x N SVD. `plot_attention_spectrum` draws the paper-style mean +- std curves per
layer group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling.architecture import primal_attention_modules
from ..modeling.kernel import NORM_EPS, prefix_mean_features, sampled_gram

SOFTMAX, PRIMAL, PRIMAL_CAUSAL = "softmax", "primal", "primal-causal"


@dataclass
class LayerSpectrum:
    """Normalised cumulative singular values of one layer's attention matrices.

    Attributes:
        layer: layer index (position in ``outputs.attentions``).
        kind: ``"softmax"``, ``"primal"`` or ``"primal-causal"``.
        curves: (sequences * heads, N) float64; row m is c_0..c_{N-1} of one matrix. Beyond a sequence's
            valid length L the matrix has no more singular values, so its curve stays at 1.
    """

    layer: int
    kind: str
    curves: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        """(N,) mean curve over sequences and heads."""
        return self.curves.mean(dim=0)

    @property
    def std(self) -> torch.Tensor:
        """(N,) population standard deviation over sequences and heads."""
        return self.curves.std(dim=0, correction=0)


def cumulative_from_singular_values(
    sigma: torch.Tensor, length: Optional[int] = None, use_sigma_squared: bool = False
) -> torch.Tensor:
    """(..., r) singular values (descending) -> (..., length) c_k, padded with 1 after the r-th value."""
    values = sigma.double().clamp(min=0.0)
    if use_sigma_squared:
        values = values.square()
    total = values.sum(dim=-1, keepdim=True)
    curve = values.cumsum(dim=-1) / total
    curve = torch.where(total > 0, curve, torch.ones_like(curve))  # an all-zero matrix: nothing to explain
    length = values.shape[-1] if length is None else length
    if length > curve.shape[-1]:
        pad = curve.new_ones(*curve.shape[:-1], length - curve.shape[-1])
        curve = torch.cat([curve, pad], dim=-1)
    return curve[..., :length]


def cumulative_spectrum(
    matrices: torch.Tensor, use_sigma_squared: bool = False, length: Optional[int] = None
) -> torch.Tensor:
    """(..., L, L) matrices -> (..., length or L) normalised cumulative singular values c_k (float64)."""
    sigma = torch.linalg.svdvals(matrices.double())
    return cumulative_from_singular_values(
        sigma, length if length is not None else matrices.shape[-1], use_sigma_squared
    )


def _low_rank_spectrum(
    left: torch.Tensor, core: torch.Tensor, right: torch.Tensor, length: int, use_sigma_squared: bool
) -> torch.Tensor:
    """c_k of left @ core @ right^T for (..., L, d) left/right and (..., d, d) core, via QR (rank <= d)."""
    q_left, r_left = torch.linalg.qr(left.double())
    q_right, r_right = torch.linalg.qr(right.double())
    del q_left, q_right  # orthonormal columns do not change singular values
    sigma = torch.linalg.svdvals(r_left @ core.double() @ r_right.mT)
    return cumulative_from_singular_values(sigma, length, use_sigma_squared)


def _primal_curves(
    captured: dict[str, Any], core: nn.Module, valid: torch.Tensor, length: int, use_sigma_squared: bool,
    primal_kernel: str,
) -> tuple[str, torch.Tensor]:
    q, k = captured["q"].double(), captured["k"].double()
    batch, heads, tokens, dim = q.shape
    layer_valid = captured["valid"] if captured["valid"] is not None else valid[:, -tokens:]
    if core.causal:
        state, log_decay = captured["state"], core.log_decay(q.device)
        q_hat = prefix_mean_features(
            q, layer_valid, None if state is None else state.sum_q, None if state is None else state.count,
            log_decay=log_decay,
        )
        k_hat = prefix_mean_features(
            k, layer_valid, None if state is None else state.sum_k, None if state is None else state.count,
            log_decay=log_decay,
        )
        kind, cores = PRIMAL_CAUSAL, None
    else:
        q_hat, k_hat = F.normalize(q, dim=-1, eps=NORM_EPS), F.normalize(k, dim=-1, eps=NORM_EPS)
        kind, cores = PRIMAL, None
        if primal_kernel == "sampled":
            # F_h^T F_h from the tokens the layer itself sampled (same padding-aware rule as its forward)
            cores = sampled_gram(captured["x"].double(), layer_valid, core.num_samples, heads, core.sampling)
    curves = []
    for b in range(batch):
        rows = layer_valid[b].nonzero().squeeze(-1)
        core_b = cores[b] if cores is not None else torch.eye(dim, dtype=torch.float64).expand(heads, dim, dim)
        curves.append(_low_rank_spectrum(q_hat[b][:, rows], core_b, k_hat[b][:, rows], length, use_sigma_squared))
    return kind, torch.cat(curves)


def _softmax_curves(probs: torch.Tensor, valid: torch.Tensor, length: int, use_sigma_squared: bool) -> torch.Tensor:
    curves = []
    for b in range(probs.shape[0]):
        rows = valid[b, -probs.shape[-1]:].nonzero().squeeze(-1)
        matrices = probs[b][:, rows][:, :, rows]
        curves.append(cumulative_spectrum(matrices, use_sigma_squared, length))
    return torch.cat(curves)


def _hook_primal_cores(
    model: nn.Module, captured: dict[int, dict[str, Any]]
) -> tuple[dict[int, nn.Module], list[torch.utils.hooks.RemovableHandle]]:
    """Pre-hooks that store each primal core's inputs in ``captured[layer]``; returns the cores and hook handles."""
    cores: dict[int, nn.Module] = {}
    handles = []
    for _, module in primal_attention_modules(model):
        index = int(module.layer_idx)
        cores[index] = module.primal

        def hook(_core, args, kwargs, index=index):
            captured[index] = {"q": args[0], "k": args[1], "x": kwargs.get("x"), "valid": kwargs.get("valid"),
                               "state": kwargs.get("state")}

        handles.append(module.primal.register_forward_pre_hook(hook, with_kwargs=True))
    return cores, handles


def _forward_with_attentions(
    model: nn.Module, inputs: Mapping[str, torch.Tensor], handles: list[torch.utils.hooks.RemovableHandle]
) -> Any:
    """One eval forward with eager attention and ``output_attentions=True``; then removes `handles` and restores
    the attention implementation and training mode, also when the forward fails."""
    previous_impl = getattr(model.config, "_attn_implementation", None)
    was_training = model.training
    try:
        if previous_impl != "eager":
            model.set_attn_implementation("eager")
        model.eval()
        return model(**inputs, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
        if previous_impl is not None and previous_impl != "eager":
            model.set_attn_implementation(previous_impl)
        model.train(was_training)


@torch.no_grad()
def attention_spectrum(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    use_sigma_squared: bool = False,
    primal_kernel: str = "sampled",
) -> list[LayerSpectrum]:
    """Per-layer normalised cumulative singular values of the attention matrices of `model` on one batch.

    Args:
        model: a transformers model of a registered architecture, with or without primal layers.
        inputs: keyword inputs of the model (``input_ids``/``attention_mask`` or ``pixel_values``); a 2D
            ``attention_mask`` restricts every matrix to the valid tokens of its sequence.
        use_sigma_squared: accumulate sigma^2 (explained variance) instead of sigma.
        primal_kernel: ``"sampled"`` (K = Q_hat F_h^T F_h K_hat^T, the kernel of the data-dependent primal
            model) or ``"identity"`` (K = Q_hat K_hat^T) for non-causal primal layers.
    Returns:
        One `LayerSpectrum` per attention layer, in layer order; curves have N (padded length) entries.
    """
    if primal_kernel not in ("sampled", "identity"):
        raise ValueError(f"primal_kernel={primal_kernel!r} is not allowed: use 'sampled' or 'identity'.")
    captured: dict[int, dict[str, Any]] = {}
    cores, handles = _hook_primal_cores(model, captured)
    outputs = _forward_with_attentions(model, inputs, handles)
    attentions = getattr(outputs, "attentions", None)
    if attentions is None:
        raise ValueError(
            f"{type(model).__name__} returned no attentions; attention_spectrum needs output_attentions support."
        )
    mask = inputs.get("attention_mask")
    spectra = []
    for layer, probs in enumerate(attentions):
        length = probs.shape[-2]
        if mask is not None and mask.dim() == 2:
            valid = mask.to(probs.device) != 0
        else:
            valid = torch.ones(probs.shape[0], length, dtype=torch.bool, device=probs.device)
        if layer in captured:  # primal: the low-rank factors of the kernel it returned, captured on the way
            kind, curves = _primal_curves(
                captured[layer], cores[layer], valid, length, use_sigma_squared, primal_kernel
            )
        else:
            kind, curves = SOFTMAX, _softmax_curves(probs, valid, length, use_sigma_squared)
        spectra.append(LayerSpectrum(layer, kind, curves))
    return spectra


def _default_groups(num_layers: int) -> list[list[int]]:
    if num_layers <= 3:
        return [[i] for i in range(num_layers)]
    size = -(-num_layers // 3)
    return [list(range(start, min(start + size, num_layers))) for start in range(0, num_layers, size)]


def _limit(length: int, max_index: Optional[int]) -> int:
    """How many curve entries to draw: all `length`, or fewer with `max_index`."""
    return length if max_index is None else min(max_index, length)


def _plot_group(
    ax: Any,
    group: list[int],
    models: dict[str, Sequence[LayerSpectrum]],
    colors: list[str],
    max_index: Optional[int],
    dashed_layer: Optional[int],
) -> None:
    """One panel: mean +- std per model over `group`'s layers, `dashed_layer` (if in a multi-layer group) dashed."""
    for m, (label, layers) in enumerate(models.items()):
        color = colors[m % len(colors)]
        curves = torch.cat([layers[i].curves for i in group])
        limit = _limit(curves.shape[1], max_index)
        mean, std = curves.mean(0)[:limit], curves.std(0, correction=0)[:limit]
        xs = range(limit)
        group_label = f"L{group[0]}-{group[-1]}" if len(group) > 1 else f"L{group[0]}"
        ax.plot(xs, mean, color=color, label=f"{label} {group_label}")
        ax.fill_between(xs, (mean - std).clamp(min=0), (mean + std).clamp(max=1), color=color, alpha=0.2)
        if dashed_layer is not None and dashed_layer in group and len(group) > 1:
            lc = layers[dashed_layer].curves
            ax.plot(xs, lc.mean(0)[:limit], "--", color=color,
                    label=f"{label} L[{dashed_layer}] ({layers[dashed_layer].kind})")
    first = next(iter(models.values()))
    kinds = sorted({first[i].kind for i in group})
    span = f"layers {group[0]}-{group[-1]}" if len(group) > 1 else f"layer {group[0]}"
    ax.set_title(f"{span} ({', '.join(kinds)})", fontsize=9)
    ax.set_xlabel("singular value index k")
    ax.set_ylabel("normalised cumulative singular value")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_heatmap(fig: Any, ax: Any, spectra: Sequence[LayerSpectrum], label: str, max_index: Optional[int]) -> None:
    """Heatmap of the per-layer mean curves of one model, with its colour bar."""
    heat = torch.stack([s.mean for s in spectra])
    limit = _limit(heat.shape[1], max_index)
    image = ax.imshow(heat[:, :limit].numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower")
    ax.set_xlabel("singular value index k")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(spectra)))
    ax.set_title(f"mean c_k per layer ({label})", fontsize=9)
    fig.colorbar(image, ax=ax)


def plot_attention_spectrum(
    spectra: Union[Sequence[LayerSpectrum], Mapping[str, Sequence[LayerSpectrum]]],
    path: Union[str, Path],
    groups: Optional[Sequence[Sequence[int]]] = None,
    title: Optional[str] = None,
    max_index: Optional[int] = None,
) -> Path:
    """Paper-style figure: one panel per layer group (mean +- std over sequences, heads and the group's
    layers; the last layer dashed in the last panel), and a heatmap of per-layer mean curves of the first model.

    Args:
        spectra: the output of `attention_spectrum`, or ``{label: spectra}`` to overlay several models.
        path: PNG file to write.
        groups: layer indices per panel; default: three contiguous groups (one per layer for <= 3 layers).
        max_index: draw c_k for k < max_index only (default: all).
    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = dict(spectra) if isinstance(spectra, Mapping) else {"model": list(spectra)}
    first = next(iter(models.values()))
    groups = [list(g) for g in groups] if groups is not None else _default_groups(len(first))
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(4.2 * (len(groups) + 1), 3.8), squeeze=False)
    axes = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    last = len(first) - 1
    for panel, group in enumerate(groups):
        _plot_group(axes[panel], group, models, colors, max_index, last if panel == len(groups) - 1 else None)
    _plot_heatmap(fig, axes[-1], first, next(iter(models)), max_index)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "LayerSpectrum",
    "attention_spectrum",
    "cumulative_spectrum",
    "cumulative_from_singular_values",
    "plot_attention_spectrum",
]
