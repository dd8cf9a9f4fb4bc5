"""How good a classifier's confidence is: calibration, proper scores, and how well confidence separates right from
wrong (misclassification detection) and in- from out-of-distribution inputs.

Plain torch, no model code: every function takes class probabilities (N, K) (rows summing to 1), labels (N,) and,
where it ranks examples, a confidence score (default: the maximum probability, MSP). All results are Python floats
in natural units (fractions, nats); `uncertainty_report` gathers them.

Conventions (those of the KEP-SVGP paper's evaluation code, so figures compare):

* ECE: 15 equal-width confidence bins, bin b = (b/15, (b+1)/15] (a confidence of exactly 0 joins the first bin),
  sum over bins of (fraction of examples in the bin) * |accuracy in the bin - mean confidence in the bin|.
* Brier: squared distance between the probability vector and the one-hot label, summed over classes, averaged.
* Misclassification detection: correctly classified examples are the positives, ranked by confidence; AUROC (ties
  count one half), FPR95 (the false-positive rate at the ROC point whose true-positive rate is closest to 0.95), AURC
  (the area under the risk-coverage curve: the mean, over k = 1..N, of the error rate among the k most confident
  examples; ties in confidence keep the input order).
* OOD detection: in-distribution examples are the positives, ranked by their confidence score; AUROC.
"""

from __future__ import annotations

from typing import Optional

import torch

ECE_BINS = 15


def _check(probs: torch.Tensor, labels: Optional[torch.Tensor] = None) -> None:
    if probs.dim() != 2 or probs.shape[0] == 0:
        raise ValueError(
            f"probs must be a non-empty (N, K) tensor of class probabilities; got shape {tuple(probs.shape)}."
        )
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise ValueError("probs must be finite and non-negative (class probabilities, not logits).")
    if labels is not None and labels.shape != probs.shape[:1]:
        raise ValueError(f"labels must have shape ({probs.shape[0]},) to match probs; got {tuple(labels.shape)}.")


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of examples whose most probable class is the label."""
    _check(probs, labels)
    return float((probs.argmax(dim=-1) == labels).double().mean())


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> float:
    """ECE over `bins` equal-width bins of the maximum probability (see the module docstring)."""
    _check(probs, labels)
    confidence, predicted = probs.double().max(dim=-1)
    correct = (predicted == labels).double()
    # Bin b holds (b / bins, (b + 1) / bins]: ceil(c * bins) - 1, with c = 0 in bin 0.
    index = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, correct - confidence)
    return float(gap.abs().sum() / confidence.numel())


def negative_log_likelihood(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean of -log p(label), in nats (a probability of 0 for the label gives +inf)."""
    _check(probs, labels)
    return float(-probs.double().gather(1, labels[:, None].long()).log().mean())


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over examples of sum_k (p_k - 1[k = label])^2."""
    _check(probs, labels)
    onehot = torch.nn.functional.one_hot(labels.long(), probs.shape[1]).double()
    return float((probs.double() - onehot).square().sum(dim=1).mean())


def _roc(scores: torch.Tensor, positive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FPR, TPR) at every distinct score threshold ("score >= t" predicted positive), from (0, 0) to (1, 1)."""
    scores, positive = scores.double(), positive.bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"a ROC curve needs positives and negatives; got {n_pos} positive and {n_neg} negative.")
    order = torch.argsort(scores, descending=True, stable=True)
    s, y = scores[order], positive[order].double()
    tp, fp = torch.cumsum(y, 0), torch.cumsum(1 - y, 0)
    last_of_tie = torch.ones_like(s, dtype=torch.bool)
    last_of_tie[:-1] = s[1:] != s[:-1]
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.cat([zero, fp[last_of_tie] / n_neg]), torch.cat([zero, tp[last_of_tie] / n_pos])


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve of `scores` for the `positive` (bool) examples: the probability that a random
    positive scores above a random negative, ties counting one half."""
    fpr, tpr = _roc(scores, positive)
    return float(torch.trapezoid(tpr, fpr))


def fpr_at_95_tpr(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """False-positive rate at the ROC point whose true-positive rate is closest to 0.95 (the first such point)."""
    fpr, tpr = _roc(scores, positive)
    return float(fpr[torch.argmin((tpr - 0.95).abs())])


def aurc(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """Area under the risk-coverage curve: mean over k of the error rate of the k most confident examples."""
    order = torch.argsort(confidence.double(), descending=True, stable=True)
    errors = (~correct.bool()[order]).double()
    k = torch.arange(1, errors.numel() + 1, dtype=torch.float64)
    return float((torch.cumsum(errors, 0) / k).mean())


def uncertainty_report(
    probs: torch.Tensor,
    labels: torch.Tensor,
    confidence: Optional[torch.Tensor] = None,
    ood_confidence: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """Every metric of this module for one set of predictions.

    Args:
        probs: (N, K) class probabilities of in-distribution examples; labels: (N,) their classes.
        confidence: (N,) the score that ranks examples (default: the maximum probability).
        ood_confidence: (M,) the same score on out-of-distribution examples, for ``ood_auroc``.
    Returns:
        accuracy, ece, nll, brier, aurc, misclassification_auroc, fpr95 (NaN where every prediction is right, or
        every one wrong) and, with `ood_confidence`, ood_auroc.

    Example:
        >>> import torch
        >>> from hf_primal.tools.uncertainty_metrics import uncertainty_report
        >>> probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
        >>> report = uncertainty_report(probs, torch.tensor([0, 1, 1]))
        >>> round(report["accuracy"], 3), round(report["misclassification_auroc"], 3)
        (0.667, 1.0)
    """
    _check(probs, labels)
    if confidence is None:
        confidence = probs.max(dim=-1).values
    correct = probs.argmax(dim=-1) == labels
    report = {
        "accuracy": accuracy(probs, labels),
        "ece": expected_calibration_error(probs, labels),
        "nll": negative_log_likelihood(probs, labels),
        "brier": brier_score(probs, labels),
        "aurc": aurc(confidence, correct),
    }
    mixed = bool(correct.any()) and not bool(correct.all())
    report["misclassification_auroc"] = auroc(confidence, correct) if mixed else float("nan")
    report["fpr95"] = fpr_at_95_tpr(confidence, correct) if mixed else float("nan")
    if ood_confidence is not None:
        scores = torch.cat([confidence.double(), ood_confidence.double()])
        inside = torch.cat([torch.ones(len(confidence), dtype=torch.bool),
                            torch.zeros(len(ood_confidence), dtype=torch.bool)])
        report["ood_auroc"] = auroc(scores, inside)
    return report
