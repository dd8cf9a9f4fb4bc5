"""Training-step and inference time and peak memory of Primal-Attention versus stock eager and SDPA attention.

Sections (all BERT encoders built from a `BertConfig`, random init, dropout 0, no padding, fp32):

* ``lra``        the paper's LRA backbone: 2 layers, hidden 64, 2 heads, intermediate 128, batch 2;
* ``bert-base``  BERT-base width (hidden 768, 12 heads, intermediate 3072) with ``--bert-layers`` layers
                 (2 by default: 12 layers at N = 8192 do not fit the time budget of two CPU cores), batch 1;
* ``sublayer``   the BERT-base attention sub-layer alone (``BertAttention``: q/k(/v) projections, attention,
                 output projection, residual + LayerNorm) at one length, batch 1;
* ``breakdown``  inside a primal layer: the time spent between the q/k projections and the output projection
                 (`run_primal`: feature map, sampled weights, scores, head map, KSVD sums), as a share of the
                 attention sub-layer and of the whole transformer layer, forward + backward.

Variants: ``primal-all`` (every layer primal, the paper's "Primal."), ``primal-last`` (last layer only,
"Primal.+"), ``sdpa`` and ``eager`` (stock attention). Primal uses the paper's s = 30, m = 10 (p = 300).

A training step is: zero grads, forward, mean-pool, a 10-class linear head, cross-entropy (+ 0.05 x KSVD
loss for primal variants), backward; no optimiser step. Inference is one forward under
``torch.inference_mode`` in eval mode.

How it measures. The parent process only imports; all torch work runs in worker processes forked from it.
* Time: one worker per section holds every variant and times them round-robin (one unrecorded warm-up
  step each, then up to ``--repeats`` timed steps per variant, fewer for steps slower than
  ``--budget-s`` / repeats), so load from other processes hits all variants alike. Reported: the median
  (``time_ms``) and the minimum (``time_ms_min``) wall time; ratios and fits use the median. ``load1`` is
  the 1-minute load average after timing a length: above the thread count, other processes competed.
* Peak memory: one fresh worker per (section, variant, N). glibc is told to serve every allocation above
  128 KiB with mmap (fixed threshold), so freed tensors go back to the OS; after building the model and
  inputs the worker trims the heap, reads its resident set (VmRSS), resets the kernel's high-water mark
  (``/proc/self/clear_refs``) and runs one training step; ``peak_mib`` = VmHWM after the step minus that
  baseline: the step's activations, gradients and temporaries (not the weights or libraries).
* Eager configurations whose estimated attention memory exceeds ``--eager-limit-gib`` are skipped and
  marked as such in the table (estimate: (3 x layers + 2) x batch x heads x N^2 x 4 bytes).

Outputs (in ``--out-dir``): ``benchmark.csv`` (every measurement), ``benchmark_summary.csv`` (scaling
exponents, sub-layer ratios, breakdown shares, the targets), ``benchmark.png``; a table on stdout.

    python -m scripts.benchmarks.layers                          # full run, ~15 min on 2 CPU cores
    python -m scripts.benchmarks.layers --quick --out-dir /tmp/b # tiny shapes, seconds (used by the tests)
    python -m scripts.benchmarks.layers --device cuda --dtype bf16 # on a GPU: autocast steps, CUDA allocator peaks
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import harness
from .encoder import Shape
from .layers_steps import VARIANTS, Settings, memory_job, skip_reason, sublayer_job, timing_job

KSVD_ETA = 0.05
NUM_CLASSES = 10


def full_settings(args: argparse.Namespace) -> Settings:
    lengths = tuple(n for n in (512, 1024, 2048, 4096, 8192) if n <= args.max_n)
    return Settings(
        threads=args.threads,
        repeats=args.repeats,
        budget_s=args.budget_s,
        eager_limit_gib=args.eager_limit_gib,
        fit_from=1024,
        sublayer_n=4096,
        sections={
            "lra": Shape("lra", 64, 2, 128, 2, 2, lengths),
            "bert-base": Shape("bert-base", 768, 12, 3072, args.bert_layers, 1, lengths),
        },
        device=args.device,
        dtype=args.dtype,
    )


def quick_settings(args: argparse.Namespace) -> Settings:
    return Settings(
        threads=args.threads,
        repeats=3,  # more than one, so that a median and a minimum differ and the tests can tell them apart
        budget_s=5.0,
        eager_limit_gib=args.eager_limit_gib,
        fit_from=64,
        sublayer_n=128,
        sections={
            "lra": Shape("lra", 16, 2, 32, 2, 2, (64, 128), low_rank=4, rank_multi=4, vocab=64),
            "bert-base": Shape("bert-base", 32, 4, 64, 2, 1, (64, 128), low_rank=4, rank_multi=4, vocab=64),
        },
        device=args.device,
        dtype=args.dtype,
    )


# ------------------------------------------------------------------------------------------ analysis
def fit_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(time) against log(N)."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


def add_ratios(rows: list[dict]) -> None:
    for row in rows:
        for base in ("eager", "sdpa"):
            ref = harness.lookup(rows, section=row["section"], n=row["n"], mode=row["mode"], variant=base)
            ok = ref is not None and ref.get("time_ms") and row.get("time_ms")
            row[f"speedup_vs_{base}"] = ref["time_ms"] / row["time_ms"] if ok else None
            okm = ref is not None and ref.get("peak_mib") and row.get("peak_mib")
            row[f"mem_ratio_vs_{base}"] = ref["peak_mib"] / row["peak_mib"] if okm else None


def summarise(settings: Settings, rows: list[dict], quick: bool) -> list[dict[str, Any]]:
    summary = []
    for section in settings.sections:
        for mode in ("train", "infer"):
            for variant in VARIANTS:
                points = [(r["n"], r["time_ms"]) for r in rows if r["section"] == section and r["mode"] == mode
                          and r["variant"] == variant and r.get("time_ms") and r["n"] >= settings.fit_from]
                if len(points) >= 2:
                    lo, hi = min(p[0] for p in points), max(p[0] for p in points)
                    summary.append({"name": f"exponent {section} {variant} {mode} (N {lo}-{hi})",
                                    "value": fit_exponent(points),
                                    # primal-last keeps a softmax layer: quadratic by design, no target
                                    "target": "<= 1.1" if variant == "primal-all" and mode == "train" else "",
                                    "met": None})
    n_ref = 4096 if not quick else max(settings.sections["lra"].lengths)
    primal = harness.lookup(rows, section="lra", variant="primal-all", mode="train", n=n_ref)
    for base, speed_target, mem_target in (("eager", 20.0, 15.0), ("sdpa", 6.0, None)):
        if primal and primal.get(f"speedup_vs_{base}"):
            summary.append({"name": f"lra primal-all train speedup vs {base} (N={n_ref})",
                            "value": primal[f"speedup_vs_{base}"], "target": f">= {speed_target:g}", "met": None})
        if mem_target and primal and primal.get(f"mem_ratio_vs_{base}"):
            summary.append({"name": f"lra primal-all peak memory ratio vs {base} (N={n_ref})",
                            "value": primal[f"mem_ratio_vs_{base}"], "target": f">= {mem_target:g}", "met": None})
    n = settings.sublayer_n
    for section in ("bert-base", "lra"):
        att = {v: harness.lookup(rows, section=f"attention:{section}", variant=v, n=n)
               for v in ("primal-all", "sdpa", "eager")}
        for base in ("sdpa", "eager"):
            if att["primal-all"] and att[base]:
                summary.append({"name": f"{section} attention sub-layer train speedup vs {base} (N={n})",
                                "value": att[base]["time_ms"] / att["primal-all"]["time_ms"],
                                "target": ">= 5" if (section, base) == ("bert-base", "sdpa") else "", "met": None})
        middle = harness.lookup(rows, section=f"middle:{section}", n=n)
        layer = harness.lookup(rows, section=f"layer:{section}", n=n)
        if middle and att["primal-all"]:
            summary.append({"name": f"{section} primal middle share of attention sub-layer fwd+bwd (N={n})",
                            "value": middle["time_ms"] / att["primal-all"]["time_ms"],
                            "target": "<= 0.2" if section == "bert-base" else "", "met": None})
        if middle and layer:
            summary.append({"name": f"{section} primal middle share of transformer layer fwd+bwd (N={n})",
                            "value": middle["time_ms"] / layer["time_ms"], "target": "", "met": None})
    loads = [r["load1"] for r in rows if r.get("load1") is not None]
    if loads:
        busy = max(loads) > settings.threads + 1
        summary.append({"name": "max 1-minute load average while timing" + (
            " (ABOVE threads + 1: other processes competed, times are inflated)" if busy else ""),
            "value": max(loads), "target": "", "met": None})
    for item in summary:
        target = item["target"]
        if target:
            op, bound = target.split()
            item["met"] = item["value"] <= float(bound) if op == "<=" else item["value"] >= float(bound)
    return summary


# ------------------------------------------------------------------------------------------ output
CSV_FIELDS = ["section", "variant", "n", "batch", "mode", "time_ms", "time_ms_min", "reps", "peak_mib",
              "speedup_vs_eager", "speedup_vs_sdpa", "mem_ratio_vs_eager", "mem_ratio_vs_sdpa", "load1", "status",
              "device", "dtype"]


def print_table(rows: list[dict], summary: list[dict], header: str) -> None:
    print(header)
    cols = ["section", "variant", "n", "mode", "time_ms", "time_ms_min", "reps", "peak_mib", "speedup_vs_eager",
            "speedup_vs_sdpa", "mem_ratio_vs_eager", "load1", "status"]
    widths = [11, 11, 5, 5, 10, 11, 4, 9, 16, 15, 18, 5, 10]
    print(" ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print(" ".join(harness.fmt(row.get(c), 2 if c.startswith(("speed", "mem_")) else 1).rjust(w)
                       for c, w in zip(cols, widths)))
    print("\nSummary")
    for item in summary:
        met = "" if item["met"] is None else ("  MET" if item["met"] else "  NOT MET")
        target = f"  (target {item['target']})" if item["target"] else ""
        print(f"  {item['name']}: {item['value']:.3f}{target}{met}")


def write_outputs(out_dir: Path, rows: list[dict], summary: list[dict], header: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "benchmark.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    with open(out_dir / "benchmark_summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["name", "value", "target", "met"])
        writer.writeheader()
        writer.writerows(summary)
        writer.writerow({"name": f"environment: {header}", "value": "", "target": "", "met": ""})
    plot(out_dir / "benchmark.png", rows)


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = ["lra", "bert-base"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    styles = {"primal-all": ("tab:red", "o"), "primal-last": ("tab:orange", "s"), "sdpa": ("tab:blue", "^"),
              "eager": ("tab:gray", "v")}
    for col, section in enumerate(sections):
        for variant, (color, marker) in styles.items():
            for mode, line in (("train", "-"), ("infer", ":")):
                pts = sorted((r["n"], r["time_ms"]) for r in rows if r["section"] == section
                             and r["variant"] == variant and r["mode"] == mode and r.get("time_ms"))
                if pts:
                    axes[0, col].plot(*zip(*pts), line, color=color, marker=marker,
                                      label=f"{variant} {'train step' if mode == 'train' else 'inference'}")
            pts = sorted((r["n"], r["peak_mib"]) for r in rows if r["section"] == section and r["variant"] == variant
                         and r["mode"] == "train" and r.get("peak_mib"))
            if pts:
                axes[1, col].plot(*zip(*pts), "-", color=color, marker=marker, label=variant)
        axes[0, col].set_title(f"{section}: time per step")
        axes[0, col].set_ylabel("ms (median)")
        axes[1, col].set_title(f"{section}: peak memory of a training step")
        axes[1, col].set_ylabel("MiB above baseline")
        for row in (0, 1):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].set_yscale("log")
            axes[row, col].set_xlabel("sequence length N")
            axes[row, col].grid(True, which="both", alpha=0.3)
            if axes[row, col].get_legend_handles_labels()[0]:
                axes[row, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = harness.timing_parser(__doc__.split("\n\n")[0], ["lra", "bert-base", "sublayer"], budget_s=12.0,
                                   eager_limit_gib=12.0)
    parser.add_argument("--bert-layers", type=int, default=2, help="layers of the BERT-base-width encoder")
    args = parser.parse_args(argv)
    args.device, args.dtype = harness.resolve_device(args)
    settings = quick_settings(args) if args.quick else full_settings(args)
    parts = set(args.only or ["lra", "bert-base", "sublayer"])
    started = time.time()
    header = harness.machine_line(settings.device, settings.dtype, settings.threads)
    print(f"Primal-Attention benchmark ({'quick' if args.quick else 'full'}): {header}", flush=True)

    rows: list[dict[str, Any]] = []
    for section, shape in settings.sections.items():
        if section not in parts:
            continue
        rows += harness.with_memory(
            harness.in_child(timing_job, settings, section), shape.lengths, VARIANTS,
            lambda variant, n, shape=shape: skip_reason(settings, shape, variant, n),
            lambda variant, n, mode, shape=shape, section=section: {
                "section": section, "variant": variant, "n": n, "batch": shape.batch, "mode": mode},
            None if args.no_memory else
            lambda variant, n, section=section: harness.in_child(memory_job, settings, section, variant, n)["peak_mib"])
        print(f"  [{section}] memory done ({time.time() - started:.0f} s)", flush=True)
    if "sublayer" in parts:
        rows += harness.in_child(sublayer_job, settings)
    for row in rows:
        row.setdefault("status", "ok")
        row.update(device=settings.device, dtype=settings.dtype)
    order = {v: i for i, v in enumerate(VARIANTS)}
    parts_by_section = [f"{part}:{s}" for s in ("bert-base", "lra") for part in ("attention", "middle", "layer")]
    sections = ["lra", "bert-base"] + parts_by_section
    rows.sort(key=lambda r: (sections.index(r["section"]), r["mode"] != "train", r["n"], order.get(r["variant"], 9)))
    add_ratios(rows)
    summary = summarise(settings, rows, args.quick)
    header = f"{header}; end load average {harness.load_average()}; {time.time() - started:.0f} s"
    print_table(rows, summary, header)
    write_outputs(args.out_dir, rows, summary, header)
    print(f"\nwrote {args.out_dir / 'benchmark.csv'}, benchmark_summary.csv and benchmark.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
