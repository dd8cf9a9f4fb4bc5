"""Accuracy as a local `evaluate` module.

`evaluate.load("accuracy")` fetches its script from the Hugging Face Hub, which fails offline; loading this
file by path (``evaluate.load(hf_primal.tools.metrics.metric_path("accuracy"))``) needs no network.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import datasets
import evaluate

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their reference label (optionally weighted)."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool, default True): return the fraction correct; False returns the (weighted) count correct.
    sample_weight (list of float, optional): per-example weights.
Returns:
    accuracy (float): in [0, 1] when normalize is True.
Examples:
    >>> metric = evaluate.load("path/to/accuracy.py")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(
        self,
        predictions: Sequence[int],
        references: Sequence[int],
        normalize: bool = True,
        sample_weight: Optional[Sequence[float]] = None,
    ) -> dict[str, Any]:
        if len(predictions) != len(references):
            raise ValueError(f"accuracy: {len(predictions)} predictions but {len(references)} references.")
        weights = [1.0] * len(references) if sample_weight is None else [float(w) for w in sample_weight]
        correct = sum(w for p, r, w in zip(predictions, references, weights) if int(p) == int(r))
        if not normalize:
            return {"accuracy": float(correct)}
        total = sum(weights)
        # An empty evaluation set has no accuracy; NaN says so instead of a misleading 0 or a ZeroDivisionError.
        return {"accuracy": float(correct / total) if total > 0 else float("nan")}
