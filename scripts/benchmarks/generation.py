"""Decode latency and memory of GPT-2 with Primal-Attention versus stock SDPA, as the context grows.

Three variants of one GPT-2 shape (GPT-2-small by default: 12 layers, n_embd 768, 12 heads, random init):

* ``all-primal``         ``primal_attention={"layers": "all"}`` - every layer keeps a constant-size state;
* ``last-layer-primal``  ``primal_attention={"layers": [-1]}``  - 11 KV-cache layers + 1 primal layer;
* ``stock-sdpa``         plain ``GPT2LMHeadModel`` with SDPA attention and the usual KV cache.

Every measurement prefills a random prompt of ``context`` tokens into a ``DynamicCache`` (last-position
logits only, as ``generate`` does) and then decodes ``--new-tokens`` tokens with single-token forwards on
that cache (batch 1, ``torch.no_grad``, greedy token fed back). Work runs in worker processes forked from
this one (imports are shared, not re-paid; the parent does no torch work before forking). Two phases:

Memory - one fresh worker per (context, variant) pair, so that every peak is that pair's own:

* ``cache_bytes``: bytes of the storage behind every tensor the cache object holds right after the
  prefill (`hf_primal.modeling.cache.cache_nbytes`: keys/values of KV layers, running sums of primal layers);
* ``peak_rss_mb``: the worker's peak resident set size over its whole life (model build, prefill,
  decoding), from ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after resetting the kernel's high-water
  mark when the worker starts (``/proc/self/clear_refs``, Linux). It includes the imported libraries and
  the model weights, alike for all variants (``model_rss_mb``: RSS right after building the model);
* ``decode_peak_rss_mb``: the same high-water mark, reset again (after handing freed prefill buffers
  back to the OS) right before decoding on the prefilled cache: the process's peak while generating;
* ``prefill_s``: wall time of the prefill forward.

On CUDA (``--device cuda``) the three memory figures are the caching allocator's tensor memory instead (weights
included, like the RSS figures; not the CUDA context or libraries), and every timed forward runs under autocast.

Latency - one worker holding the three models and a prefilled cache for every pair:

* ``latency_ms``: per-token decode latency, the median over ``--repeats`` rounds of (pass time / new
  tokens); ``latency_ms_min`` / ``_max`` give the spread. Each round times one pass of every pair in a
  fresh random order, after one unrecorded warm-up round. Every pass starts from the same post-prefill
  cache through a shallow copy (cache layers replace their tensors on update, never write into them).

* ``load1``: the 1-minute load average around the latency phase; above ``--threads``, other processes
  competed for the cores and the latencies are inflated.

Primal layers decode through `PrimalCore._decode_step` (no KSVD terms, no per-step prefix-sum buffers);
stock layers through transformers' SDPA path with a `DynamicCache`.

Compiled decoding - one fresh worker per (context, variant) for ``all-primal`` and ``stock-sdpa`` at
``--compiled-contexts``: a ``StaticCache`` (fixed-size buffers; primal layers get `PrimalStaticCacheLayer`),
eager prefill as ``generate`` does, then ``torch.compile(model.forward, fullgraph=True)`` decodes
(``--compile-backend``, inductor by default). ``compiled_ms``: median per-token latency over ``--repeats``
passes after the compiling first step (``compile_s``); ``tokens_match``: the compiled greedy tokens equal the
eager dynamic-cache ones for the same prompt (the worker raises otherwise). Written to ``generation_compiled.csv``.

Outputs: a table on stdout (absolute numbers and ratios to stock SDPA at the same context), a CSV and a
PNG plot in ``--out-dir``. Latencies depend on the machine and its load; run on an idle machine.

    python -m scripts.benchmarks.generation                      # full run (~6-9 min on 2 busy CPU cores)
    python -m scripts.benchmarks.generation --quick --out-dir /tmp/bench   # tiny model, seconds
    python -m scripts.benchmarks.generation --device cuda --dtype bf16      # on a GPU (autocast, allocator peaks)
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

import hf_primal  # noqa: F401  (lets GPT2Config take `primal_attention`)

# harness keeps the parent free of a CUDA context (the workers are forked): it sets the NVML-based check, read
# when torch.cuda.is_available() is first called.
from . import harness
from .generation_steps import (
    VARIANTS,
    Shape,
    measure_compiled,
    measure_latency,
    measure_memory,
)

BASELINE = "stock-sdpa"
CSV_NAME = "generation_benchmark.csv"
PNG_NAME = "generation_benchmark.png"
COMPILED_CSV_NAME = "generation_compiled.csv"
COMPILED_VARIANTS = ("all-primal", BASELINE)


GPT2_SMALL = Shape(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=4608)
TINY = Shape(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)


# ----------------------------------------------------------------------------------------- one measurement


def compiled_table(rows: list[dict], eager: list[dict]) -> str:
    """Compiled static-cache latency per (variant, context), next to eager dynamic-cache latency where measured."""
    stock = {r["context"]: r["compiled_ms"] for r in rows if r["variant"] == BASELINE}
    eager_ms = {(r["variant"], r["context"]): r["latency_ms"] for r in eager}
    header = f"{'variant':<12} {'context':>7} {'compiled ms':>11} {'x stock':>8} {'eager ms':>9} {'compile s':>9}"
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: (r["context"], COMPILED_VARIANTS.index(r["variant"]))):
        row["compiled_ms_vs_stock"] = stock[row["context"]] / row["compiled_ms"]
        measured = eager_ms.get((row["variant"], row["context"]))
        lines.append(
            f"{row['variant']:<12} {row['context']:>7} {row['compiled_ms']:>11.2f} {row['compiled_ms_vs_stock']:>8.2f} "
            f"{measured if measured is not None else float('nan'):>9.2f} {row['compile_s']:>9.1f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- reporting
def add_ratios(rows: list[dict]) -> None:
    """Ratios of each row to the stock-SDPA row at the same context (1.0 for stock itself)."""
    base = {row["context"]: row for row in rows if row["variant"] == BASELINE}
    for row in rows:
        ref = base.get(row["context"])
        for key in ("latency_ms", "cache_bytes", "peak_rss_mb", "decode_peak_rss_mb"):
            row[f"{key}_vs_stock"] = row[key] / ref[key] if ref and ref[key] else float("nan")


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'variant':<18} {'context':>7} {'ms/token':>9} {'x stock':>8} {'cache MB':>10} {'x stock':>8} "
        f"{'peak RSS MB':>11} {'decode peak MB':>14} {'x stock':>8} {'prefill s':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: (list(VARIANTS).index(r["variant"]), r["context"])):
        lines.append(
            f"{row['variant']:<18} {row['context']:>7} {row['latency_ms']:>9.2f} {row['latency_ms_vs_stock']:>8.2f} "
            f"{row['cache_bytes'] / 2**20:>10.3f} {row['cache_bytes_vs_stock']:>8.4f} {row['peak_rss_mb']:>11.0f} "
            f"{row['decode_peak_rss_mb']:>14.0f} {row['decode_peak_rss_mb_vs_stock']:>8.3f} {row['prefill_s']:>9.2f}"
        )
    return "\n".join(lines)


def growth_summary(rows: list[dict]) -> str:
    """Per-token latency at the longest context over the shortest, per variant."""
    lines = []
    for variant in VARIANTS:
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["context"])
        if len(mine) >= 2:
            lo, hi = mine[0], mine[-1]
            lines.append(
                f"{variant}: {hi['latency_ms'] / lo['latency_ms']:.2f}x per-token latency from context "
                f"{lo['context']} to {hi['context']}; cache {hi['cache_bytes'] / lo['cache_bytes']:.1f}x"
            )
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """Rows written by `write_csv`, with their numeric types back."""
    ints = {"context", "new_tokens", "repeats", "threads", "cache_bytes", "n_layer", "n_embd", "n_head"}
    rows = []
    with open(path, newline="") as handle:
        for raw in csv.DictReader(handle):
            row = {}
            for key, value in raw.items():
                if key in ("variant", "device", "dtype"):
                    row[key] = value
                elif key == "rss_high_water_reset":
                    row[key] = value == "True"
                else:
                    row[key] = int(value) if key in ints else float(value)
            rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = rows[0]
    device = first.get("device", "cpu")  # CSVs written before the --device option have no such column
    memory = "CUDA allocator peak" if device.startswith("cuda") else "process peak RSS"
    panels = (
        ("latency_ms", "ms", "per-token decode latency", False),
        ("cache_bytes", "MiB", "cache size after prefill", True),
        ("decode_peak_rss_mb", "MiB", f"{memory}: decoding (solid), whole run (dashed)", False),
    )
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.4))
    for ax, (key, unit, title, log) in zip(axes, panels):
        for variant in VARIANTS:
            mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["context"])
            xs = [r["context"] for r in mine]
            ys = [r[key] / 2**20 if key == "cache_bytes" else r[key] for r in mine]
            line = ax.plot(xs, ys, marker="o", label=variant)[0]
            if key == "decode_peak_rss_mb":  # the whole-run peak includes the prefill activations
                ax.plot(xs, [r["peak_rss_mb"] for r in mine], linestyle="--", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    threads = f"{first['threads']} thread" + ("s" if first["threads"] > 1 else "")
    fig.suptitle(
        f"GPT-2 ({first['n_layer']} layers, n_embd {first['n_embd']}, {first['n_head']} heads), batch 1, {device} "
        f"{first.get('dtype', 'fp32')}, {threads}; latency = median of {first['repeats']} passes x "
        f"{first['new_tokens']} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: list[dict], out_dir: Path) -> None:
    """Print the table and write the CSV and the plot."""
    print()
    print(format_table(rows))
    print()
    print(growth_summary(rows))
    csv_path, png_path = out_dir / CSV_NAME, out_dir / PNG_NAME
    write_csv(rows, csv_path)
    plot(rows, png_path)
    print(f"\nwrote {csv_path} and {png_path}")


# ----------------------------------------------------------------------------------------- entry point
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=str, default=None,
                        help="comma-separated prompt lengths (default 128,...,4096)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per timed pass (default 8)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per configuration (default 7)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each worker (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled-contexts", type=str, default=None,
                        help="contexts for the compiled static-cache phase (default 128,512,2048; 16 with --quick; "
                             "'' to skip)")
    parser.add_argument("--compile-backend", type=str, default=None,
                        help="torch.compile backend (default inductor; aot_eager with --quick)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--quick", action="store_true", help="tiny 2-layer model and short contexts (for tests)")
    parser.add_argument("--replot", action="store_true", help="only redraw table and plot from the CSV in --out-dir")
    harness.add_device_arguments(parser)
    args = parser.parse_args(argv)
    args.device, args.dtype = harness.resolve_device(args)
    default_contexts = "16,32,64" if args.quick else "128,256,512,1024,2048,4096"
    args.contexts = sorted({int(c) for c in (args.contexts or default_contexts).split(",")})
    compiled = ("16" if args.quick else "128,512,2048") if args.compiled_contexts is None else args.compiled_contexts
    args.compiled_contexts = sorted({int(c) for c in compiled.split(",") if c.strip()})
    args.compile_backend = args.compile_backend or ("aot_eager" if args.quick else "inductor")
    args.new_tokens = args.new_tokens or (3 if args.quick else 8)
    args.repeats = args.repeats or (2 if args.quick else 7)
    if min(args.contexts) < 1 or args.new_tokens < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("contexts, --new-tokens, --repeats and --threads must be positive")
    base = TINY if args.quick else GPT2_SMALL
    # Positions must cover the prompt plus every decoded token; GPT-2 has learned absolute positions.
    needed = max([*args.contexts, *args.compiled_contexts]) + args.new_tokens * (args.repeats + 1) + 1
    args.shape = Shape(base.n_layer, base.n_embd, base.n_head, base.vocab_size, max(base.n_positions, needed))
    return args


def main(argv: Optional[list[str]] = None) -> list[dict]:
    args = parse_args(argv)
    if args.replot:
        rows = read_csv(args.out_dir / CSV_NAME)
        report(rows, args.out_dir)
        return rows
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shape = args.shape
    print(
        f"GPT-2 n_layer={shape.n_layer} n_embd={shape.n_embd} n_head={shape.n_head} vocab={shape.vocab_size} "
        f"n_positions={shape.n_positions}; contexts {args.contexts}; {args.new_tokens} new tokens x "
        f"{args.repeats} repeats; {args.threads} thread(s); {args.device} {args.dtype}; torch {torch.__version__}",
        flush=True,
    )
    started = time.perf_counter()
    rows = []
    print("memory: one forked worker per (context, variant)", flush=True)
    for context in args.contexts:
        for variant in VARIANTS:
            row = {
                "variant": variant, "context": context, "n_layer": shape.n_layer, "n_embd": shape.n_embd,
                "n_head": shape.n_head, "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
                "device": args.device, "dtype": args.dtype,
            }
            row.update(harness.in_child(measure_memory, variant, context, shape, args.new_tokens, args.threads,
                                        args.seed, args.device, args.dtype))
            rows.append(row)
            print(
                f"  {variant:<18} context {context:>5}: cache {row['cache_bytes'] / 2**20:9.3f} MiB, decode peak RSS "
                f"{row['decode_peak_rss_mb']:7.0f} MiB, prefill {row['prefill_s']:6.2f} s",
                flush=True,
            )
    print(f"latency: one worker, {args.repeats} rounds over all pairs", flush=True)
    load_before = os.getloadavg()[0]
    samples = harness.in_child(
        measure_latency, args.contexts, shape, args.new_tokens, args.repeats, args.threads, args.seed, args.device,
        args.dtype,
    )
    # Above the thread count, other processes competed for the cores while latencies were timed.
    load = max(load_before, os.getloadavg()[0])
    for row in rows:
        mine = samples[row["variant"], row["context"]]
        row["latency_ms"] = 1e3 * statistics.median(mine)
        row["latency_ms_min"] = 1e3 * min(mine)
        row["latency_ms_max"] = 1e3 * max(mine)
        row["load1"] = load
    add_ratios(rows)
    report(rows, args.out_dir)
    busy = " (above the thread count: other processes competed, latencies are inflated)" if load > args.threads else ""
    print(f"1-minute load average while timing: {load:.2f}{busy}")
    if args.compiled_contexts:
        print(f"compiled decoding ({args.compile_backend}, static cache): one worker per (context, variant)",
              flush=True)
        compiled = [
            harness.in_child(measure_compiled, variant, context, shape, args.new_tokens, args.repeats, args.threads,
                         args.seed, args.compile_backend, args.device, args.dtype)
            for context in args.compiled_contexts for variant in COMPILED_VARIANTS
        ]
        load = os.getloadavg()[0]
        for row in compiled:
            row.update(load1=load, device=args.device, dtype=args.dtype)
        print(compiled_table(compiled, rows))
        path = args.out_dir / COMPILED_CSV_NAME
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(compiled[0]))
            writer.writeheader()
            writer.writerows(compiled)
        print(f"wrote {path}")
    print(f"total {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
