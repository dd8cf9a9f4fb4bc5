"""`predict_with_uncertainty`: several stochastic forward passes of a classifier, summarised.

The passes draw from the posterior of the model's KEP-SVGP layers (``primal_attention={"variant": "kep_svgp"}``) and,
with ``mc_dropout=True``, from its dropout masks (MC dropout, the usual baseline, for any model). Metrics of the result:
`hf_primal.tools.uncertainty_metrics`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from ..modeling.kep_svgp import KEPSVGPCore


@dataclass
class UncertaintyOutput:
    """What `predict_with_uncertainty` returns; every tensor has one row per example, in input order.

    Attributes:
        logits: (N, K) mean over the passes of the logits (every field float64).
        probs: (N, K) softmax of `logits` (how the KEP-SVGP paper scores predictions; use it for accuracy, ECE, NLL).
        mean_probs: (N, K) mean over the passes of each pass's probabilities.
        predictive_entropy: (N,) entropy of `mean_probs`, in nats.
        expected_entropy: (N,) mean over the passes of each pass's entropy.
        mutual_information: (N,) predictive minus expected entropy (>= 0): the part of the uncertainty that comes
            from the model's randomness (zero for one pass).
        variance: (N, K) variance over the passes of each class probability.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    mean_probs: torch.Tensor
    predictive_entropy: torch.Tensor
    expected_entropy: torch.Tensor
    mutual_information: torch.Tensor
    variance: torch.Tensor


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.clamp(min=1e-30).log()).sum(dim=-1)


@contextlib.contextmanager
def stochastic_passes(model: nn.Module, generator: torch.Generator, mc_dropout: bool = False) -> Iterator[None]:
    """Within the block, forwards of `model` draw from its KEP-SVGP posteriors (noise from `generator`) and, with
    `mc_dropout`, run in training mode (dropout on, as MC dropout does; global RNG); everything is put back after."""
    cores = [m for m in model.modules() if isinstance(m, KEPSVGPCore)]
    saved = [(core, core.sample_in_eval, core.generator) for core in cores]
    was_training = model.training
    try:
        for core in cores:
            core.sample_in_eval, core.generator = True, generator
        model.train(mc_dropout)
        yield
    finally:
        for core, flag, gen in saved:
            core.sample_in_eval, core.generator = flag, gen
        model.train(was_training)


def _batches(inputs: Union[Mapping[str, Any], Iterable[Mapping[str, Any]]], batch_size: int) -> Iterator[dict]:
    if isinstance(inputs, Mapping):
        first = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
        for start in range(0, first.shape[0], batch_size):
            yield {k: (v[start:start + batch_size] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    else:
        yield from inputs


def _check_request(model: nn.Module, samples: int, mc_dropout: bool) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"predict_with_uncertainty: samples={samples!r} is not allowed: it must be an integer >= 1.")
    if not mc_dropout and not any(isinstance(m, KEPSVGPCore) for m in model.modules()):
        raise ValueError(
            f"predict_with_uncertainty: {type(model).__name__} has no KEP-SVGP layer, so its passes would all be "
            "the same; build it with primal_attention={'variant': 'kep_svgp', ...} or pass mc_dropout=True."
        )


@torch.no_grad()
def predict_with_uncertainty(
    model: nn.Module,
    inputs: Union[Mapping[str, Any], Iterable[Mapping[str, Any]]],
    samples: int = 10,
    seed: int = 0,
    batch_size: int = 32,
    mc_dropout: bool = False,
) -> UncertaintyOutput:
    """`samples` stochastic forward passes of a classifier (sequence or image classification head), summarised.

    Args:
        model: a model with KEP-SVGP layers, or any classifier with ``mc_dropout=True``.
        inputs: one batch (a dict of tensors, split into `batch_size` rows) or an iterable of such batches (e.g. a
            DataLoader); labels, if present, are ignored.
        samples: forward passes per batch (T >= 1).
        seed: seeds the KEP-SVGP noise (a generator on the model's device) and, with `mc_dropout`, the dropout
            masks (the global RNG, restored afterwards): the same call gives the same result.
        batch_size: rows per forward when `inputs` is one batch.
        mc_dropout: also sample dropout masks (MC dropout: the passes run in training mode).
    Returns:
        `UncertaintyOutput`. For each batch the T passes run one after the other, all from the one generator.

    Example:
        >>> import torch, hf_primal
        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        ...                     vocab_size=100, primal_attention={"low_rank": 4, "variant": "kep_svgp"})
        >>> model = BertForSequenceClassification(config).eval()
        >>> out = hf_primal.predict_with_uncertainty(model, {"input_ids": torch.randint(1, 100, (3, 8))}, samples=5)
        >>> out.probs.shape, bool((out.mutual_information >= 0).all())
        (torch.Size([3, 2]), True)
    """
    _check_request(model, samples, mc_dropout)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    logits_runs: list[torch.Tensor] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with stochastic_passes(model, generator, mc_dropout):
            for batch in _batches(inputs, batch_size):
                batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
                         if k not in ("labels", "label")}
                logits_runs.append(torch.stack([model(**batch).logits.float() for _ in range(samples)], dim=1))
    runs = torch.cat(logits_runs).double()  # (N, T, K); float64: the mutual information is a small difference
    per_pass = runs.softmax(dim=-1)
    mean_probs = per_pass.mean(dim=1)
    predictive = _entropy(mean_probs)
    expected = _entropy(per_pass).mean(dim=1)
    return UncertaintyOutput(
        logits=runs.mean(dim=1), probs=runs.mean(dim=1).softmax(dim=-1), mean_probs=mean_probs,
        predictive_entropy=predictive, expected_entropy=expected,
        mutual_information=(predictive - expected).clamp(min=0.0),
        variance=per_pass.var(dim=1, unbiased=False),
    )
