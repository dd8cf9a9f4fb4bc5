"""scripts/benchmarks/conversion.py and its data: no leakage between splits, and a small end-to-end run."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from scripts.benchmarks import bbc_news  # noqa: E402


def test_bbc_splits_do_not_share_sentences_or_articles():
    train, test, unlabeled = bbc_news.load(train_size=3200, test_size=1075, unlabeled_size=4000, seed=0)
    assert len(train.texts) == 3200 and len(test.texts) == 1075 and len(unlabeled) == 4000
    assert not set(train.texts) & set(test.texts)
    assert not set(unlabeled) & set(test.texts) and not set(unlabeled) & set(train.texts)
    assert sorted(set(train.labels)) == list(range(len(bbc_news.TOPICS)))
    # Split by article: no test sentence comes from an article that gave a training sentence.
    assert not set(train.articles) & set(test.articles)
    assert len(set(test.articles)) > 100


def test_sentences_used_for_choosing_settings_are_left_out_of_the_test_set():
    from scripts.benchmarks.conversion import SELECTION

    excluded = frozenset(bbc_news.read_hashes(SELECTION))
    _, plain, _ = bbc_news.load(test_size=1075, unlabeled_size=4000)
    _, clean, _ = bbc_news.load(test_size=1075, unlabeled_size=4000, exclude=excluded)
    assert len(excluded) > 1000 and sum(bbc_news.sentence_hash(t) in excluded for t in plain.texts) == 1075
    assert not any(bbc_news.sentence_hash(t) in excluded for t in clean.texts) and len(clean.texts) == 1075


def test_small_end_to_end_run(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.conversion",
         "--variants", "stock,naive-last,recipe-last",
         "--train-size", "48", "--test-size", "24", "--unlabeled", "48", "--cosine-sentences", "16",
         "--distill-steps", "4", "--epochs", "0.5", "--batch-size", "16", "--max-length", "48",
         "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "conversion_benchmark.csv", newline="") as handle:
        rows = {r["variant"]: r for r in csv.DictReader(handle)}
    assert list(rows) == ["stock", "naive-last", "recipe-last"]
    assert float(rows["stock"]["embedding_cosine"]) == 1.0
    assert 0 < float(rows["naive-last"]["embedding_cosine"]) < 0.99  # converting the layer changes the embeddings
    assert int(rows["recipe-last"]["distill_steps"]) == 4 and int(rows["naive-last"]["distill_steps"]) == 0
    curves = json.loads((tmp_path / "conversion_curves.json").read_text())
    assert [c["step"] for c in curves["recipe-last"]][0] == 0 and curves["recipe-last"][-1]["step"] == 4
    # The held-out cosine that distillation reports at step 0 is the plain conversion's (same initialisation).
    assert abs(curves["recipe-last"][0]["heldout_cosine"] - float(rows["naive-last"]["embedding_cosine"])) < 0.1
    assert (tmp_path / "conversion_benchmark.png").stat().st_size > 10_000
    for r in rows.values():
        assert 24 * float(r["accuracy"]) == pytest.approx(round(24 * float(r["accuracy"])), abs=1e-6)


def test_unknown_variant_is_named():
    result = subprocess.run([sys.executable, "-m", "scripts.benchmarks.conversion", "--variants",
                             "stock,best"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "unknown ['best']" in result.stderr
