"""What lets a primal layer learn from long documents: the cheap study behind the long-document table's settings.

Every run is one `long_documents_task.train_job` (the same data, model, budget and code as the table) at a short
length (default N = 512, where no article needs padding), read on the **validation** split: its training accuracy
(eval mode), its validation curve (after every epoch) and its final validation accuracy. Test accuracy is recorded
but never read to choose. Three grids:

* ``options``: the primal variants with each sampling rule of ``PrimalAttentionConfig.sampling`` (``even``: the
  paper's single tokens; ``jitter``: a random token of each interval while training; ``segment_mean``: the mean of
  each interval), fewer slots (m), and weight decay, against the trained no-attention floor and sdpa;
* ``lr``: learning rates 1e-4, 3e-4, 1e-3 with the benchmark's warm-up, and the paper's LRA recipe (lr 1e-4, AdamW
  eps 1e-6, 40% warm-up: 8,000 of 20,000 steps), for sdpa, Primal., Primal.+ and no-attention alike;
* ``data``: 25 / 50 / 100% of the training articles (stratified; the same number of steps) for the same four;
* ``budget``: 8 / 16 / 32 epochs (41 steps each) for the same four, with the chosen primal rule: whether a variant
  is limited by what it can learn or by the steps it gets (the study runs at 8 epochs; the table at 16, the budget
  this grid chose on validation);
* ``capacity``: segment means with m = 1, 2, 4 (p = m s slots) for Primal. and Primal.+, run at the table's length
  (``--length 2048``): with m = 1 each slot summarises N / s bytes, so the slot width grows with N; m = 4 at 2048
  keeps the width that won at 512. A run the long-document table already holds with the same arguments (its
  ``long_documents.csv`` in ``--out-dir``) is read from there, not run again.

Outputs in ``--out-dir``: ``long_documents_study.csv`` (one row per run; a rerun resumes),
``long_documents_study_summary.csv`` (mean and std over seeds per grid, setting and variant) and
``long_documents_study.png`` (validation accuracy per grid).

    python -m scripts.benchmarks.long_documents_study --grid options
    python -m scripts.benchmarks.long_documents_study --grid lr,data --sampling segment_mean
    python -m scripts.benchmarks.long_documents_study --only report
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

from hf_primal import PrimalAttentionConfig

from . import harness
from . import long_documents_model as model
from . import long_documents_task as task

STUDY_CSV, STUDY_SUMMARY_CSV, STUDY_PNG = ("long_documents_study.csv", "long_documents_study_summary.csv",
                                          "long_documents_study.png")
FOUR = ("sdpa", "primal", "primal-last", task.NO_ATTENTION)
# The benchmark's own recipe; a run's setting names only what it changes, so a run shared by two grids runs once.
DEFAULTS = {"learning_rate": 1e-3, "adam_eps": 1e-8, "warmup": 0.1, "weight_decay": 0.0, "train_fraction": 1.0,
            "sampling": "even", "rank_multi": 10, "epochs": 8.0}
PRIMAL_ONLY = ("sampling", "rank_multi")
PAPER = {"learning_rate": 1e-4, "adam_eps": 1e-6, "warmup": 0.4}  # LRA Text: 8,000 warm-up steps of 20,000


def setting_name(variant: str, overrides: dict[str, Any]) -> str:
    """The canonical name of a run's setting: the fields changed from `DEFAULTS` (the benchmark's recipe with the
    paper's slots, sampling="even" and m = 10) in a fixed order, or "baseline"."""
    changed = {k: v for k, v in overrides.items() if v != DEFAULTS[k] and (variant in model.PRIMAL or k not in
                                                                           PRIMAL_ONLY)}
    return ",".join(f"{k}={changed[k]:g}" if isinstance(changed[k], float) else f"{k}={changed[k]}"
                    for k in DEFAULTS if k in changed) or "baseline"


def grid(name: str, sampling: str, learning_rate: float = 1e-3, rank_multi: int = 10
         ) -> list[tuple[str, dict[str, Any]]]:
    """(variant, overrides of the benchmark's arguments) of every run of one grid; the lr and data grids run the
    primal variants with `sampling` and `rank_multi`."""
    if name == "options":
        out = [(variant, {"sampling": rule}) for variant in ("primal", "primal-last")
               for rule in ("even", "jitter", "segment_mean")]
        out += [("primal", {"sampling": rule, "rank_multi": m}) for rule in ("even", "segment_mean") for m in (1, 3)]
        out += [("primal", {"sampling": rule, "weight_decay": 0.1}) for rule in ("even", "segment_mean")]
        out += [("primal", {"sampling": "jitter", "rank_multi": 1}), ("primal-last", {"sampling": "segment_mean",
                                                                                     "rank_multi": 1})]
        return out + [("sdpa", {}), (task.NO_ATTENTION, {})]
    chosen = {"sampling": sampling, "rank_multi": rank_multi}
    if name == "lr":
        out = [(v, {"learning_rate": lr, **chosen}) for lr in (1e-4, 3e-4, 1e-3) for v in FOUR]
        return out + [(v, {**PAPER, **chosen}) for v in FOUR]
    if name == "data":
        return [(v, {"train_fraction": frac, "learning_rate": learning_rate, **chosen})
                for frac in (0.25, 0.5, 1.0) for v in FOUR]
    if name == "budget":
        return [(v, {"epochs": epochs, **chosen}) for epochs in (8.0, 16.0, 32.0) for v in FOUR]
    if name == "capacity":
        return [(v, {"sampling": "segment_mean", "rank_multi": m}) for v in ("primal", "primal-last")
                for m in (1, 2, 4)]
    raise ValueError(f"grid {name!r} is not allowed: use options, lr, data, budget or capacity")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default="options,lr,data", help="comma-separated: options, lr, data, budget, capacity")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--sampling", default="even", help="the primal sampling rule of the lr and data grids")
    p.add_argument("--rank-multi", type=int, default=10, help="the primal m of the lr and data grids")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="the learning rate of the data grid")
    p.add_argument("--match", default=None,
                   help="run only the runs whose 'variant setting' matches this regular expression")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", choices=("train", "report"), default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny data and budgets")
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    args = p.parse_args(argv)
    args.grid = [g.strip() for g in args.grid.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def _bench_args(args: argparse.Namespace, overrides: dict[str, Any]) -> argparse.Namespace:
    out = task.parse_args(["--lengths", str(args.length), "--workers", "1"] + (["--quick"] if args.quick else []))
    if args.quick:
        out.lengths = [args.length]
    for key, value in {**DEFAULTS, **overrides}.items():
        if not (args.quick and key == "epochs" and key not in overrides):  # a smoke run keeps its own short budget
            setattr(out, key, value)
    return out


def _run(job: tuple) -> dict[str, Any]:
    args, variant, overrides, seed = job
    row = task.train_job(_bench_args(args, overrides), variant, args.length, seed)
    return {"setting": setting_name(variant, overrides), **row}


def _key(row: dict) -> tuple[str, ...]:
    return tuple(str(row[k]) for k in ("setting", "variant", "n", "seed"))


def planned(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], int]]:
    """(variant, overrides, seed) of every run the chosen grids need, each once, first seed first."""
    out, seen = [], set()
    for seed in args.seeds:
        for grid_name in args.grid:
            for variant, overrides in grid(grid_name, args.sampling, args.learning_rate, args.rank_multi):
                key = (setting_name(variant, overrides), variant, seed)
                if args.match and not re.search(args.match, f"{variant} {key[0]}"):
                    continue
                if key not in seen:
                    seen.add(key)
                    out.append((variant, overrides, seed))
    return out


def from_table(args: argparse.Namespace, variant: str, overrides: dict[str, Any], seed: int) -> Optional[dict]:
    """The long-document table's run of (variant, N, seed) as a study row when the table trained it with exactly the
    arguments this run would have (the table's recipe, at this run's budget), else None."""
    table = task.parse_args(["--lengths", str(args.length)])
    table.sampling = table.sampling or PrimalAttentionConfig().sampling
    mine = _bench_args(args, overrides)
    # The table keeps runs of several budgets side by side, each row naming its own; a row without one is not reused.
    if any(getattr(mine, key) != getattr(table, key) for key in DEFAULTS if key != "epochs"):
        return None
    for row in harness.read_rows(Path(args.out_dir) / task.RUNS_CSV):
        if ((row["variant"], row["n"], row["seed"], row["status"]) == (variant, str(args.length), str(seed), "ok")
                and task.run_epochs(row) == float(mine.epochs)):
            return {"setting": setting_name(variant, overrides), **row}
    return None


def run(args: argparse.Namespace) -> None:
    path = Path(args.out_dir) / STUDY_CSV
    rows = harness.read_rows(path)
    done = {_key(r) for r in rows}
    for variant, overrides, seed in planned(args):
        row = from_table(args, variant, overrides, seed)
        if row is not None and _key(row) not in done:
            rows.append(row)
            done.add(_key(row))
            harness.write_rows(path, rows)
    todo = [(args, variant, overrides, seed) for variant, overrides, seed in planned(args)
            if (setting_name(variant, overrides), variant, str(args.length), str(seed)) not in done]
    for row in harness.run_jobs(_run, todo, args.workers, "long-document study"):
        rows = harness.replace_row(rows, row, _key)
        harness.write_rows(path, rows)
        print(f"  {row['setting']} {row['variant']} seed {row['seed']}: val {row['val_accuracy']:.3f}", flush=True)


def summarise(rows: list[dict], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Mean over seeds per (grid, setting, variant) of the chosen grids: train, validation and test accuracy, and the
    epoch of the best validation accuracy on the mean curve."""
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for grid_name in args.grid:
        for variant, overrides in grid(grid_name, args.sampling, args.learning_rate, args.rank_multi):
            setting = setting_name(variant, overrides)
            runs = [r for r in rows if r["setting"] == setting and r["variant"] == variant
                    and str(r["n"]) == str(args.length)]
            if runs:
                groups[(grid_name, setting, variant, str(args.length))] = runs
    out = []
    for (grid_name, setting, variant, n), runs in groups.items():
        item: dict[str, Any] = {"grid": grid_name, "setting": setting, "variant": variant, "n": n, "seeds": len(runs)}
        for field in ("train_accuracy", "val_accuracy", "accuracy"):
            # The table's earliest rows have no training accuracy: a mean over the runs that have it (NaN if none).
            values = [float(r[field]) for r in runs if r.get(field) not in (None, "")]
            item[f"{field}_mean"] = statistics.mean(values) if values else float("nan")
            item[f"{field}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        curves = [[float(point.split(":")[1]) for point in r["val_curve"].split()] for r in runs if r.get("val_curve")]
        if curves and len({len(c) for c in curves}) == 1:
            mean_curve = [statistics.mean(values) for values in zip(*curves)]
            item["val_curve_mean"] = " ".join(f"{v:.4f}" for v in mean_curve)
            item["best_epoch"] = 1 + max(range(len(mean_curve)), key=mean_curve.__getitem__)
        out.append(item)
    return out


def _field(setting: str, name: str, default: float) -> float:
    for part in setting.split(","):
        key, _, value = part.partition("=")
        if key == name:
            return float(value)
    return default


def plot(path: Path, summary: list[dict]) -> None:
    """Options as bars (validation, with the training accuracy marked); the lr and data grids as curves of
    validation accuracy against the learning rate and the share of training articles, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("options", "capacity", "lr", "data", "budget")
    panels = sorted({(s["grid"], int(s["n"])) for s in summary if s["grid"] in order},
                    key=lambda panel: (order.index(panel[0]), panel[1]))  # one panel per grid and length
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    colors = {"sdpa": "tab:blue", "primal": "tab:red", "primal-last": "tab:pink", task.NO_ATTENTION: "tab:gray"}
    for ax, (grid_name, n) in zip(axes[0], panels):
        items = [s for s in summary if s["grid"] == grid_name and int(s["n"]) == n]
        if grid_name in ("options", "capacity"):
            ax.bar(range(len(items)), [100 * s["val_accuracy_mean"] for s in items],
                   yerr=[100 * s["val_accuracy_std"] for s in items],
                   color=[colors.get(s["variant"], "black") for s in items], alpha=0.7)
            ax.plot(range(len(items)), [100 * s["train_accuracy_mean"] for s in items], "k_", markersize=14,
                    label="training accuracy (eval mode)")
            ax.set_xticks(range(len(items)), [f"{s['variant']}\n{s['setting']}" for s in items], rotation=90,
                          fontsize=6)
            ax.legend(fontsize=7)
        else:
            field, default, label = {"lr": ("learning_rate", DEFAULTS["learning_rate"], "learning rate"),
                                     "data": ("train_fraction", 1.0, "share of the training articles"),
                                     "budget": ("epochs", DEFAULTS["epochs"], "epochs (41 steps each)")}[grid_name]
            for variant in FOUR:
                points = sorted((_field(s["setting"], field, default), 100 * s["val_accuracy_mean"])
                                for s in items if s["variant"] == variant and "adam_eps" not in s["setting"])
                if points:
                    ax.plot(*zip(*points), "o-", color=colors[variant], label=variant)
                paper = [s for s in items if s["variant"] == variant and "adam_eps" in s["setting"]]
                for s in paper:
                    ax.plot(PAPER["learning_rate"], 100 * s["val_accuracy_mean"], "*", markersize=11,
                            color=colors[variant], label=f"{variant}, paper recipe")
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.legend(fontsize=6)
        ax.set_ylabel("validation accuracy (%)")
        ax.set_title(f"{grid_name} (N = {items[0]['n']}, mean over seeds)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merged(previous: list[dict], summary: list[dict], grids: list[str], n: int) -> list[dict]:
    """The summary file's entries of the grids and lengths not run this time (each grid is run with its own options,
    the same grid at several lengths), then this run's: a study run grid by grid ends with every grid in the file."""
    return [item for item in previous if item["grid"] not in grids or str(item["n"]) != str(n)] + summary


def report(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out_dir)
    summary = summarise(harness.read_rows(out / STUDY_CSV), args)
    if summary:
        previous = [{k: (float(v) if k.endswith(("accuracy_mean", "accuracy_std")) else v) for k, v in item.items()}
                    for item in harness.read_rows(out / STUDY_SUMMARY_CSV)]
        harness.write_rows(out / STUDY_SUMMARY_CSV, merged(previous, summary, args.grid, args.length))
        plot(out / STUDY_PNG, merged(previous, summary, args.grid, args.length))
    for s in summary:
        print(f"{s['grid']:<8} {s['setting']:<40} {s['variant']:<13} seeds {s['seeds']}  "
              f"train {100 * s['train_accuracy_mean']:5.1f}  val {100 * s['val_accuracy_mean']:5.1f} "
              f"± {100 * s['val_accuracy_std']:.1f}  best epoch {s.get('best_epoch', '-')}")
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    print(f"long-document study: grids {args.grid}, N = {args.length}, seeds {args.seeds}, {args.workers} workers; "
          f"load average {harness.load_average()}", flush=True)
    return harness.run_phases(args, {"train": run}, report)


if __name__ == "__main__":
    sys.exit(main())
