"""scripts/benchmarks/conversion_tasks.py: the small-label tasks' splits, and a --quick run checked independently."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

from scripts.benchmarks import bbc_news  # noqa: E402


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
        [sys.executable, "-m", "scripts.benchmarks.conversion_tasks", "--quick", "--out-dir", str(out),
         "--work-dir", str(out / "teachers")],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The same rows again with the stopping rule (a resumed run: the teachers and the ranking are reused).
    result = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.conversion_tasks", "--quick", "--only", "accuracy",
         "--recipe-stop", "agreement", "--out-dir", str(out), "--work-dir", str(out / "teachers")],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def read(name):
        with open(out / name, newline="") as handle:
            return list(csv.DictReader(handle))

    return out, read


def test_quick_run_stock_rows_equal_an_independent_evaluation(quick_run):
    from transformers import AutoTokenizer, BertForSequenceClassification

    from hf_primal.tools.data import minilm_path

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


def test_quick_run_records_what_the_stopping_rule_chose(quick_run):
    out, read = quick_run
    rows = read("conversion_tasks.csv")
    fixed = [r for r in rows if r["variant"] == "recipe"]
    stopped = [r for r in rows if r["variant"] == "recipe-stop"]
    # The fixed recipe rows stay as they were; the stopping rule adds rows of its own for the same task, layers, seed.
    assert {(r["task"], r["selection"], r["layers"]) for r in stopped} == {
        (r["task"], r["selection"], r["layers"]) for r in fixed}
    assert all(r["steps_run"] == "2" and r["best_step"] == "" for r in fixed)
    for r in stopped:  # --quick: evaluations every 2 steps, at most 6 steps
        assert int(r["best_step"]) in (2, 4, 6) and int(r["best_step"]) <= int(r["steps_run"]) <= 6


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


def test_summary_equals_hand_computed_means_and_sample_stds():
    from scripts.benchmarks import conversion_tasks as bench

    def row(task, seed, acc, f1, seconds, variant="recipe", selection="auto", k=3, layers="1 2 4"):
        return {"task": task, "variant": variant, "selection": selection, "k": str(k), "layers": layers,
                "seed": str(seed), "accuracy": str(acc), "macro_f1": str(f1), "seconds": str(seconds)}

    rows = [row("sentences", 0, 0.70, 0.60, 10), row("sentences", 1, 0.80, 0.70, 20),
            row("sentences", 2, 0.90, 0.80, 30),
            row("headlines", 0, 0.5, 0.4, 5, variant="stock", selection="", k=0, layers="")]
    summary = {(s["task"], s["variant"]): s for s in bench.summarise(rows)}
    recipe = summary[("sentences", "recipe")]
    assert recipe["seeds"] == 3 and recipe["accuracy_mean"] == 0.8 and recipe["accuracy_std"] == 0.1  # sample std
    assert recipe["macro_f1_mean"] == 0.7 and recipe["seconds_mean"] == 20.0 and recipe["layers"] == "1 2 4"
    stock = summary[("headlines", "stock")]
    assert stock["seeds"] == 1 and stock["accuracy_std"] == 0.0 and stock["k"] == 0


def test_schedule_runs_every_row_once_first_seeds_first_both_selections_alike():
    from scripts.benchmarks import conversion_tasks as bench

    args = bench.parse_args([])
    first, second = bench.accuracy_jobs(args)
    recipes = [params for name, params in second if name == "recipe"]
    assert len(recipes) == len(set(recipes))
    # Every K for both selections (K = 6 once: every layer is the same model either way), every seed.
    expected = {(task, seed, selection, k) for task in ("sentences", "headlines") for seed in (0, 1, 2)
                for k in (1, 2, 3, 4, 6) for selection in ("auto", "last") if not (k == 6 and selection == "auto")}
    assert set(recipes) == expected
    # The first seed of every row comes before any other seed, so an interrupted run already shows every K.
    last_first_seed = max(i for i, p in enumerate(recipes) if p[1] == 0)
    assert all(p[1] == 0 for p in recipes[: last_first_seed + 1])
    # Then K = 3 (the K the targets name) for both selections before any other K.
    extra = [p for p in recipes if p[1] != 0]
    assert {p[3] for p in extra[:8]} == {3} and {p[2] for p in extra[:8]} == {"auto", "last"}
