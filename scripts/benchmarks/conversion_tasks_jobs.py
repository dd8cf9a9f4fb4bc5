"""The jobs of the conversion-tasks benchmark, each in a fresh process: fine-tuning the teacher, the plain and the
recipe conversion at K layers, the layer ranking and the frozen-embedding runs. The task and the table:
conversion_tasks.
"""

from __future__ import annotations

import copy
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from . import bbc_news, minilm, movie_reviews

SENSITIVITY_JSON = "conversion_sensitivity.json"
# Each task's corpus: the layer ranking and the unlabeled distillation text are the corpus's, shared by its tasks.
CORPUS = {"sentences": "bbc", "headlines": "bbc", "reviews": "reviews"}
CLASSES = {"bbc": len(bbc_news.TOPICS), "reviews": len(movie_reviews.LABELS)}
# The stopping rule's settings (full run, --quick): rows trained with others carry them in their options, so that a
# resumed run never takes a row stopped under other settings for its own.
STOP_SETTINGS = {"recipe_max_steps": 900, "recipe_eval_steps": 50, "recipe_patience": 3, "recipe_heldout": 400}
QUICK_STOP_SETTINGS = {**STOP_SETTINGS, "recipe_max_steps": 6, "recipe_eval_steps": 2, "recipe_heldout": 16}
RANK_MULTI = 10  # the benchmark's primal layers sample s * 10 tokens (another value is an option)
# The primal layers' shape and KSVD weight, and the steps after each progressive stage: another value names the row.
PRIMAL_SETTINGS = {"low_rank": 30, "eta": 0.1}
PROGRESSIVE_STEPS, QUICK_PROGRESSIVE_STEPS = 50, 2
DISTILL_WEIGHT = 1.0  # the recipe's distillation term beside the task loss (PrimalTrainer's default)


def setup():
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def primal_spec(args, layers=None):
    """The benchmark's primal-layer settings at `layers` (None: without layers, for `progressive_conversion`)."""
    from hf_primal import PrimalAttentionConfig

    extra = {"sampling": args.sampling} if getattr(args, "sampling", None) else {}
    extra.update({"layers": list(layers)} if layers is not None else {})
    return PrimalAttentionConfig(low_rank=args.low_rank, rank_multi=args.rank_multi, eta=args.eta, **extra)


def sensitivity_file(corpus: str) -> str:
    return SENSITIVITY_JSON if corpus == "bbc" else f"conversion_sensitivity_{corpus}.json"


def label_budget(args, task_name: str) -> int:
    return args.reviews_labels if task_name == "reviews" else args.labels


def task_data(args, task_name):
    """(task, unlabeled texts of its corpus) of one task of the benchmark."""
    if CORPUS[task_name] == "reviews":
        task, unlabeled = movie_reviews.load_task(args.reviews_labels, seed=0, test_size=2000 if not args.quick else 60,
                                                  path=args.reviews_file)
    else:
        tasks, unlabeled = bbc_news.load_tasks(args.labels, seed=0, test_size=1075 if not args.quick else 60)
        task = tasks[task_name]
    if args.quick:
        task.test = task.test[:60]
    return task, unlabeled[: args.unlabeled]


def tokenised(tokenizer, rows, max_length, labels=True):
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


def augmented(texts: list[str], copies: int, seed: int, drop: float = 0.1) -> list[str]:
    """`texts`, then `copies` perturbed versions of each, every word of a copy dropped with probability `drop` (a copy
    keeps at least one word). More distinct inputs for the teacher to label when the unlabeled pool is small: the
    student sees each original more rarely before the pool repeats."""
    rng = random.Random(seed)
    out = list(texts)
    for _ in range(copies):
        for text in texts:
            words = text.split()
            kept = [w for w in words if rng.random() >= drop]
            out.append(" ".join(kept or words[:1]))
    return out


def train_model(model, tokenizer, train_rows, args, seed, workdir, *, teacher=None, unlabeled=None, steps=None,
                heldout=None, learning_rate=None, primal_learning_rate=None):
    """Fine-tune `model` (plain `Trainer`, or `PrimalTrainer` once it has primal layers); with a teacher, distil
    on `unlabeled`. With `heldout` (unlabeled texts no step trains on), `steps` is a ceiling: the student is
    evaluated every --recipe-eval-steps, training stops after --recipe-patience evaluations without a better
    teacher agreement, and the best step's weights are restored (the recipe's stopping rule, docs/conversion.md).
    `learning_rate` (default --learning-rate) and `primal_learning_rate` (the primal layers' own parameters; default
    the same) are the recipe's."""
    from transformers import DataCollatorWithPadding, EarlyStoppingCallback, Trainer, TrainingArguments

    from hf_primal import PrimalTrainer

    stopping = {}
    if heldout is not None:
        stopping = dict(eval_strategy="steps", eval_steps=args.recipe_eval_steps, save_strategy="steps",
                        save_steps=args.recipe_eval_steps, save_total_limit=2, load_best_model_at_end=True,
                        metric_for_best_model=stopping_metric(args), per_device_eval_batch_size=128)
    training = TrainingArguments(
        output_dir=workdir, per_device_train_batch_size=args.batch_size,
        learning_rate=learning_rate or args.learning_rate, num_train_epochs=args.epochs, max_steps=steps or -1,
        warmup_steps=0.06, lr_scheduler_type="linear", report_to=[], seed=seed, use_cpu=True, disable_tqdm=True,
        logging_steps=10**6,
        **({"save_strategy": "no"} | stopping))
    kwargs = {"model": model, "args": training, "train_dataset": tokenised(tokenizer, train_rows, args.max_length),
              "data_collator": DataCollatorWithPadding(tokenizer)}
    primal = getattr(model.config, "primal_attention", None) is not None
    if primal and primal_learning_rate:
        kwargs["primal_learning_rate"] = primal_learning_rate
    if teacher is not None:
        kwargs.update(teacher=teacher, distill_target=args.recipe_distill_target,
                      distill_weight=args.recipe_distill_weight,
                      distill_dataset=tokenised(tokenizer, augmented(unlabeled, args.recipe_augment, seed),
                                                args.max_length, labels=False))
    if heldout is not None:
        kwargs.update(eval_dataset=tokenised(tokenizer, heldout, args.max_length, labels=False),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=args.recipe_patience)])
    (PrimalTrainer if primal else Trainer)(**kwargs).train()
    return model


def stopping_metric(args) -> str:
    """What the stopping rule follows on the held-out texts: top-1 agreement with the teacher's logits, or, when the
    recipe distils hidden states (no prediction to agree on), the held-out distillation loss (lower is better, which
    transformers infers from the name). The names are those `PrimalTrainer` logs."""
    from hf_primal.training.teacher_agreement import AGREEMENT, DISTILL

    return AGREEMENT if args.recipe_distill_target == "logits" else DISTILL


def job_teacher(args, task_name, seed):
    from transformers import BertForSequenceClassification

    from hf_primal.tools.data import minilm_path

    task, _ = task_data(args, task_name)
    tokenizer = minilm.tokenizer()
    started = time.time()
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(minilm_path(), num_labels=CLASSES[CORPUS[task_name]])
    with tempfile.TemporaryDirectory() as scratch:
        train_model(model, tokenizer, task.train, args, seed, scratch)
    model.save_pretrained(teacher_dir(args, task_name, seed))
    return [{"task": task_name, "variant": "stock", "selection": "", "k": 0, "layers": "", "seed": seed,
             "seconds": round(time.time() - started, 1), **scores(model, tokenizer, task, args)}]


def job_plain(args, task_name, seed):
    from transformers import BertForSequenceClassification

    from hf_primal.tools.data import minilm_path

    task, _ = task_data(args, task_name)
    tokenizer = minilm.tokenizer()
    started = time.time()
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(minilm_path(), num_labels=CLASSES[CORPUS[task_name]],
                                                          primal_attention=primal_spec(args, [-1]))
    with tempfile.TemporaryDirectory() as scratch:
        train_model(model, tokenizer, task.train, args, seed, scratch)
    return [{"task": task_name, "variant": "plain", "selection": "last", "k": 1, "layers": "5", "seed": seed,
             "seconds": round(time.time() - started, 1), **scores(model, tokenizer, task, args)}]


def job_sensitivity(args, corpus="bbc"):
    """The layer ranking of `layer_sensitivity` on the unlabeled text of one corpus (its tasks' "auto" layers)."""
    from transformers import BertModel

    from hf_primal import layer_sensitivity, text_batches
    from hf_primal.tools.data import minilm_path

    _, unlabeled = task_data(args, next(t for t, c in CORPUS.items() if c == corpus))
    batches = text_batches(minilm.tokenizer(), unlabeled[:1600], 32, args.max_length)  # 40 to train on, 10 held out
    sensitivity = layer_sensitivity(BertModel.from_pretrained(minilm_path()), batches, primal_spec(args, [-1]),
                                    steps=args.sensitivity_steps, progress=False)
    Path(args.out_dir, sensitivity_file(corpus)).write_text(json.dumps(sensitivity.to_dict(), indent=1))
    return []


def job_recipe(args, task_name, seed, selection, k):
    from transformers import BertForSequenceClassification

    from hf_primal import progressive_conversion
    from hf_primal.training.teacher_agreement import AGREEMENT

    task, unlabeled = task_data(args, task_name)
    tokenizer = minilm.tokenizer()
    order = conversion_order(args, selection, k, CORPUS[task_name])
    teacher = BertForSequenceClassification.from_pretrained(teacher_dir(args, task_name, seed)).eval()
    started = time.time()
    torch.manual_seed(seed)
    stop = args.recipe_stop == "agreement"
    # The stopping rule's held-out texts are the first --recipe-heldout unlabeled ones; distillation never sees them.
    heldout = unlabeled[: args.recipe_heldout] if stop else None
    unlabeled = unlabeled[args.recipe_heldout:] if stop else unlabeled
    warm = {}
    if args.warm_start == "transfer":  # attention transfer on unlabeled text before any distillation
        from hf_primal import text_batches

        warm = dict(calibration_data=text_batches(tokenizer, unlabeled[:1600], 32, args.max_length),
                    method="transfer", steps=args.warm_start_steps)
    with tempfile.TemporaryDirectory() as scratch:
        def distil(model, steps, heldout=None):
            train_model(model, tokenizer, task.train, args, seed, scratch, teacher=teacher, unlabeled=unlabeled,
                        steps=steps, heldout=heldout, learning_rate=args.recipe_learning_rate,
                        primal_learning_rate=args.recipe_primal_learning_rate)

        stages = order if args.recipe_progressive else [order]
        converted = progressive_conversion(teacher, primal_spec(args), order=stages, progress=False, **warm)
        for stage, student in enumerate(converted):
            if stage < len(stages) - 1:
                distil(student, args.progressive_steps)
        distil(student, args.recipe_max_steps if stop else args.recipe_steps, heldout)
    trained = student.primal_conversion_report.get("training") or {}
    return [{"task": task_name, "variant": recipe_variant(args), "options": recipe_options(args),
             "selection": selection, "k": k, "layers": " ".join(map(str, sorted(order))),
             "order": " ".join(map(str, order)), "seed": seed, "seconds": round(time.time() - started, 1),
             "steps_run": trained.get("steps_run", ""), "best_step": trained.get("best_step") or "",
             # StoppingRecord names a metric only when it restored a best step.
             "best_agreement": trained.get("best_value") if trained.get("metric") == AGREEMENT else "",
             **scores(student, tokenizer, task, args)}]


def scores(model, tokenizer, task, args) -> dict:
    """Test accuracy and macro-F1, and validation accuracy (what settings are chosen on)."""
    validation = evaluate(model, tokenizer, task.validation, args.max_length)["accuracy"]
    return {**evaluate(model, tokenizer, task.test, args.max_length), "val_accuracy": validation}


def conversion_order(args, selection, k, corpus="bbc") -> list[int]:
    """The K layers of a row in the order a progressive conversion converts them: the measured ranking's (cheapest
    first) for "auto", from the top layer down for "last"."""
    if selection == "last":
        return list(range(minilm.LAYERS - 1, minilm.LAYERS - 1 - k, -1))
    return json.loads(Path(args.out_dir, sensitivity_file(corpus)).read_text())["ranking"][:k]


def recipe_variant(args) -> str:
    """The rows' name for the recipe: `recipe` trains a fixed number of steps, `recipe-stop` follows agreement."""
    return "recipe-stop" if args.recipe_stop == "agreement" else "recipe"


def recipe_options(args) -> str:
    """What a recipe row changes from the benchmark's recipe ("" for none): progressive conversion, an
    attention-transfer warm start, the primal layers' sampling rule, slots, rank and KSVD weight, a hidden-state
    distillation target or another distillation weight, perturbed copies of the unlabeled text, the recipe's learning
    rates, and the stopping rule's ceiling, evaluation interval, patience and held-out texts."""
    stage_steps = QUICK_PROGRESSIVE_STEPS if args.quick else PROGRESSIVE_STEPS
    parts = (["progressive"] if args.recipe_progressive else []) + (
        [f"progressive_steps={args.progressive_steps}"]
        if args.recipe_progressive and args.progressive_steps != stage_steps else []) + (
        [f"transfer={args.warm_start_steps}"] if args.warm_start == "transfer" else [])
    parts += [f"sampling={args.sampling}"] if args.sampling else []
    parts += [f"rank_multi={args.rank_multi}"] if args.rank_multi != RANK_MULTI else []
    parts += [f"{name}={getattr(args, name):g}" for name, value in PRIMAL_SETTINGS.items()
              if getattr(args, name) != value]
    parts += [f"distill={args.recipe_distill_target}"] if args.recipe_distill_target != "logits" else []
    parts += [f"distill_weight={args.recipe_distill_weight:g}"] if args.recipe_distill_weight != DISTILL_WEIGHT else []
    parts += [f"augment={args.recipe_augment}"] if args.recipe_augment else []
    parts += [f"lr={args.recipe_learning_rate:g}"] if args.recipe_learning_rate else []
    parts += [f"primal_lr={args.recipe_primal_learning_rate:g}"] if args.recipe_primal_learning_rate else []
    if args.recipe_stop == "agreement":
        defaults = QUICK_STOP_SETTINGS if args.quick else STOP_SETTINGS
        parts += [f"{name[len('recipe_'):]}={getattr(args, name)}" for name, value in defaults.items()
                  if getattr(args, name) != value]
    return " ".join(parts)


def job_embeddings(args, selection, k):
    from transformers import BertModel

    from hf_primal import convert, knn_accuracy, neighbour_overlap, text_batches
    from hf_primal.tools.data import minilm_path

    sentences, unlabeled = task_data(args, "sentences")
    tokenizer = minilm.tokenizer()
    index_rows, _ = bbc_news.load_tasks(args.knn_index + args.labels, seed=0)
    index_rows = index_rows["sentences"].train[: args.knn_index]
    queries = sentences.test
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
        batches = text_batches(tokenizer, unlabeled[:2400], 32, args.max_length)
        model = convert(copy.deepcopy(original), primal_spec(args, layers), batches, method="distill",
                        steps=args.embed_steps, progress=False)
        row.update(layers=" ".join(map(str, layers)), seconds=round(time.time() - started, 1))
    index, found = (embed(model, tokenizer, [r[0] for r in rows], args.max_length) for rows in (index_rows, queries))
    labels = ([r[1] for r in index_rows], [r[1] for r in queries])
    row.update(cosine=float(torch.nn.functional.cosine_similarity(found, ref_queries).mean()),
               knn_accuracy=knn_accuracy(index, labels[0], found, labels[1], k=10),
               neighbour_overlap=neighbour_overlap(ref_index, ref_queries, index, found, k=10))
    return [row]


def embed(model, tokenizer, texts, max_length) -> torch.Tensor:
    """Mean-pooled final hidden states in the order of `texts` (the conversion benchmark's, in batches of 128)."""

    return minilm.embeddings(model, tokenizer, texts, max_length, batch_size=128)


def chosen_layers(args, selection, k, corpus="bbc") -> list[int]:
    """The K layers a row converts: the last K, or the K cheapest of the corpus's measured ranking ("auto")."""
    return sorted(conversion_order(args, selection, k, corpus))


def teacher_dir(args, task_name, seed) -> str:
    # Named by everything that shapes the teacher, so a run with other settings never reuses it.
    settings = (f"labels{label_budget(args, task_name)}_epochs{args.epochs:g}_lr{args.learning_rate:g}_"
                f"bs{args.batch_size}_len{args.max_length}")
    return os.path.join(args.work_dir, f"teacher_{task_name}_{seed}_{settings}")


def run_job(job):
    setup()
    name, args, params = job
    return name, params, globals()[f"job_{name}"](args, *params)
