"""hf_primal.tools.uncertainty_metrics against brute-force references written from the definitions (loops over bins,
pairs, thresholds and coverages in plain Python), on random predictions with ties, and on hand-computed cases."""

import math
import random

import pytest
import torch

from hf_primal.tools import uncertainty_metrics as um


def _random_case(seed, n=60, k=4, ties=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, generator=g) * 2
    if ties:  # repeated rows give tied confidences
        logits[n // 2:] = logits[: n - n // 2].flip(0)
        logits = torch.round(logits)
    probs = logits.softmax(-1).double()
    labels = torch.randint(0, k, (n,), generator=g)
    return probs, labels


def _ece_loops(probs, labels, bins=15):
    rows = [(max(p), max(range(len(p)), key=lambda c: (p[c], -c)) == y)
            for p, y in zip(probs.tolist(), labels.tolist())]
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [(c, ok) for c, ok in rows if (lo < c <= hi) or (b == 0 and c == 0)]
        if members:
            acc = sum(ok for _, ok in members) / len(members)
            conf = sum(c for c, _ in members) / len(members)
            total += len(members) / len(rows) * abs(acc - conf)
    return total


def _auroc_pairs(scores, positive):
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg) / (len(pos) * len(neg))


def _fpr95_thresholds(scores, positive):
    # Thresholds from +inf down through every distinct score; "score >= t" is predicted positive.
    n_pos, n_neg = sum(positive), len(positive) - sum(positive)
    points = [(0.0, 0.0)]
    for t in sorted(set(scores), reverse=True):
        tp = sum(1 for s, p in zip(scores, positive) if p and s >= t)
        fp = sum(1 for s, p in zip(scores, positive) if not p and s >= t)
        points.append((fp / n_neg, tp / n_pos))
    best = min(range(len(points)), key=lambda i: (abs(points[i][1] - 0.95), i))
    return points[best][0]


def _aurc_loops(confidence, correct):
    order = sorted(range(len(confidence)), key=lambda i: (-confidence[i], i))
    risks, errors = [], 0
    for k, i in enumerate(order, start=1):
        errors += not correct[i]
        risks.append(errors / k)
    return sum(risks) / len(risks)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_metric_equals_its_brute_force_definition(seed):
    probs, labels = _random_case(seed)
    confidence = probs.max(-1).values
    correct = (probs.argmax(-1) == labels)
    assert um.accuracy(probs, labels) == pytest.approx(sum(correct.tolist()) / len(labels))
    assert um.expected_calibration_error(probs, labels) == pytest.approx(_ece_loops(probs, labels), abs=1e-12)
    nll = -sum(math.log(p[y]) for p, y in zip(probs.tolist(), labels.tolist())) / len(labels)
    assert um.negative_log_likelihood(probs, labels) == pytest.approx(nll, rel=1e-12)
    brier = sum(sum((p[c] - (c == y)) ** 2 for c in range(len(p))) for p, y in zip(probs.tolist(), labels.tolist()))
    assert um.brier_score(probs, labels) == pytest.approx(brier / len(labels), rel=1e-12)
    scores, positive = confidence.tolist(), correct.tolist()
    assert len(set(scores)) < len(scores)  # the case has ties
    assert um.auroc(confidence, correct) == pytest.approx(_auroc_pairs(scores, positive), abs=1e-12)
    assert um.fpr_at_95_tpr(confidence, correct) == pytest.approx(_fpr95_thresholds(scores, positive), abs=1e-12)
    assert um.aurc(confidence, correct) == pytest.approx(_aurc_loops(scores, positive), abs=1e-12)


def test_ood_auroc_and_the_report():
    probs, labels = _random_case(3, ties=False)
    rng = random.Random(0)
    ood = torch.tensor([rng.uniform(0.2, 0.9) for _ in range(25)], dtype=torch.float64)
    report = um.uncertainty_report(probs, labels, ood_confidence=ood)
    msp = probs.max(-1).values.tolist()
    assert report["ood_auroc"] == pytest.approx(_auroc_pairs(msp + ood.tolist(), [True] * len(msp) + [False] * 25))
    assert report["ece"] == um.expected_calibration_error(probs, labels)
    assert set(report) == {"accuracy", "ece", "nll", "brier", "aurc", "misclassification_auroc", "fpr95", "ood_auroc"}


def test_hand_computed_cases():
    # Perfectly calibrated: 4 examples at confidence 0.75, 3 right -> ECE 0; a confident wrong one -> ECE 0.9.
    probs = torch.tensor([[0.75, 0.25]] * 4)
    assert um.expected_calibration_error(probs, torch.tensor([0, 0, 0, 1])) == pytest.approx(0.0)
    assert um.expected_calibration_error(torch.tensor([[0.9, 0.1]]), torch.tensor([1])) == pytest.approx(0.9)
    # Confidence exactly on a bin edge (0.6 = 9/15) falls in the lower bin (8/15, 9/15], with 0.55 beside it.
    mixed = torch.tensor([[0.6, 0.4], [0.55, 0.45]], dtype=torch.float64)
    assert um.expected_calibration_error(mixed, torch.tensor([0, 1])) == pytest.approx(abs(0.5 - 0.575))
    # Confidence ranks the two errors last: AURC = mean(0, 0, 1/3, 2/4), AUROC 1.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    labels = torch.tensor([0, 0, 1, 1])
    assert um.aurc(probs.max(-1).values, probs.argmax(-1) == labels) == pytest.approx((0 + 0 + 1 / 3 + 2 / 4) / 4)
    assert um.auroc(probs.max(-1).values, probs.argmax(-1) == labels) == 1.0
    assert um.brier_score(torch.tensor([[1.0, 0.0]]), torch.tensor([1])) == pytest.approx(2.0)


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="class probabilities, not logits"):
        um.accuracy(torch.tensor([[2.0, -1.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\)"):
        um.brier_score(torch.tensor([[0.5, 0.5], [0.1, 0.9]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="needs positives and negatives"):
        um.auroc(torch.tensor([0.1, 0.2]), torch.tensor([True, True]))
