"""Metric scripts that `evaluate.load` can read from disk, so that evaluation works offline.

`evaluate.load("accuracy")` downloads the metric's script from the Hugging Face Hub; `load_metric("accuracy")`
loads the copy shipped here instead.
"""

from __future__ import annotations

import os
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
AVAILABLE = ("accuracy",)


def metric_path(name: str) -> str:
    """Path of the bundled metric script `name` (e.g. ``"accuracy"``), suitable for `evaluate.load`."""
    if name not in AVAILABLE:
        raise ValueError(f"hf_primal.tools.metrics: no bundled metric {name!r}; available: {list(AVAILABLE)}.")
    return os.path.join(_HERE, f"{name}.py")


def load_metric(name: str, **kwargs: Any):
    """`evaluate.load` of the bundled metric script `name`; no network access needed."""
    import evaluate

    return evaluate.load(metric_path(name), **kwargs)


__all__ = ["AVAILABLE", "metric_path", "load_metric"]
