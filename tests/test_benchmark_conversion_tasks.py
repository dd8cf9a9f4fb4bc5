"""scripts/benchmark_conversion_tasks.py: the small-label tasks' splits, and a --quick run checked independently."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bbc_news  # noqa: E402


def test_tasks_split_by_article_and_never_share_texts():
    tasks, unlabeled = bbc_news.load_tasks(400, seed=0)
    articles = bbc_news._article_splits(0)
    assert {len(a) for a in articles.values()} and sum(len(a) for a in articles.values()) == 2225
    for name, task in tasks.items():
        assert len(task.train) == 400 and len(task.validation) >= 300 and len(task.test) >= 500
        texts = [{t for t, _ in split} for split in (task.train, task.validation, task.test)]
        assert not texts[0] & texts[1] and not texts[0] & texts[2] and not texts[1] & texts[2], name
        assert not set(unlabeled) & (texts[1] | texts[2]), name  # distillation text never comes from held-out articles
        assert sorted({label for _, label in task.train}) == list(range(5)), name
    # Headlines are an article's first line; every test headline comes from a test article.
    test_headlines = {h for h, _, _ in articles["test"]}
    assert {t for t, _ in tasks["headlines"].test} <= test_headlines
    assert not {h for h, _, _ in articles["train"]} & {t for t, _ in tasks["headlines"].test}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark_conversion_tasks.py"), "--quick", "--out-dir", str(out),
         "--work-dir", str(out / "teachers")],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def read(name):
        with open(out / name, newline="") as handle:
            return list(csv.DictReader(handle))

    return out, read


def test_quick_run_stock_rows_equal_an_independent_evaluation(quick_run):
    from transformers import AutoTokenizer, BertForSequenceClassification

    from hf_primal.tools.demo import minilm_path

    out, read = quick_run
    rows = read("conversion_tasks.csv")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tasks, _ = bbc_news.load_tasks(24, seed=0)
    for task_name in ("sentences", "headlines"):
        stock = [r for r in rows if r["task"] == task_name and r["variant"] == "stock"]
        assert len(stock) == 1
        teacher_dir = next((out / "teachers").glob(f"teacher_{task_name}_0_*"))
        model = BertForSequenceClassification.from_pretrained(teacher_dir).eval()
        test = tasks[task_name].test[:60]
        correct = 0
        with torch.no_grad():
            for text, label in test:  # one text at a time: no padding, no batching shared with the script
                correct += int(model(**tokenizer(text, return_tensors="pt", truncation=True,
                                                 max_length=64)).logits.argmax()) == label
        assert float(stock[0]["accuracy"]) == pytest.approx(correct / len(test), abs=1e-9)


def test_quick_run_converts_the_layers_the_ranking_or_last_k_names(quick_run):
    out, read = quick_run
    sensitivity = json.loads((out / "conversion_sensitivity.json").read_text())
    costs = sensitivity["costs"]
    assert len(costs) == 6
    assert sensitivity["ranking"] == [c["index"] for c in sorted(costs, key=lambda c: (c["loss_after"], c["index"]))]
    recipes = [r for r in read("conversion_tasks.csv") if r["variant"] == "recipe"]
    assert {(r["task"], r["selection"]) for r in recipes} == {(t, s) for t in ("sentences", "headlines")
                                                              for s in ("auto", "last")}
    for r in recipes:
        assert r["layers"] == str(sensitivity["ranking"][0] if r["selection"] == "auto" else 5)
    summary = read("conversion_tasks_summary.csv")
    assert {(s["task"], s["variant"]) for s in summary} >= {("sentences", "stock"), ("headlines", "plain")}
    assert (out / "conversion_tasks.png").stat().st_size > 10_000


def test_quick_run_embedding_measures(quick_run):
    out, read = quick_run
    rows = {(r["selection"], r["k"]): r for r in read("conversion_embeddings.csv")}
    stock = rows[("", "0")]
    # The original against itself: identical vectors, identical neighbours.
    assert float(stock["cosine"]) == pytest.approx(1.0, abs=1e-6) and float(stock["neighbour_overlap"]) == 1.0
    assert 0.2 < float(stock["knn_accuracy"]) <= 1.0  # 5 topics: chance is 0.2
    for key in (("auto", "1"), ("last", "1")):
        assert float(rows[key]["cosine"]) < 0.9999 and 0 <= float(rows[key]["neighbour_overlap"]) <= 1
    timing = read("conversion_timing.csv")
    # Each timed model converts the layers its row names (the same choice as the accuracy rows).
    assert {(t["selection"], t["layers"]) for t in timing} == {(r["selection"], r["layers"]) for r in rows.values()
                                                               if r["k"] != "0"}
