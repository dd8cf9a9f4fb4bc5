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

    python scripts/benchmark_generation.py                      # full run (~6-9 min on 2 busy CPU cores)
    python scripts/benchmark_generation.py --quick --out-dir /tmp/bench   # tiny model, seconds
    python scripts/benchmark_generation.py --device cuda --dtype bf16      # on a GPU (autocast, allocator peaks)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import multiprocessing
import os
import random
import resource
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

# Workers are forked. By default torch.cuda.is_available() (`_device.resolve` calls it; libraries may too) runs
# cuInit, after which CUDA fails in every forked child; the NVML-based check leaves the parent uninitialised.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, StaticCache  # noqa: E402

import hf_primal  # noqa: E402, F401  (lets GPT2Config take `primal_attention`)
from hf_primal.modeling.cache import cache_kwarg, cache_nbytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded from a file by the tests
import _device  # noqa: E402

VARIANTS: dict[str, Optional[dict]] = {
    "all-primal": {"layers": "all"},
    "last-layer-primal": {"layers": [-1]},
    "stock-sdpa": None,
}
BASELINE = "stock-sdpa"
CSV_NAME = "generation_benchmark.csv"
PNG_NAME = "generation_benchmark.png"
COMPILED_CSV_NAME = "generation_compiled.csv"
COMPILED_VARIANTS = ("all-primal", BASELINE)


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_positions: int


GPT2_SMALL = Shape(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=4608)
TINY = Shape(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)


# ----------------------------------------------------------------------------------------- memory probes
def _reset_peak_rss() -> bool:
    """Restart the kernel's RSS high-water mark at the current RSS (Linux >= 4.0); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def _cuda_mb(device: str) -> float:
    return torch.cuda.memory_allocated(device) / 2**20


def _cuda_peak(device: str) -> contextlib.AbstractContextManager[dict]:
    """`_device.cuda_peak` on CUDA; on CPU nothing (the RSS high-water mark is read directly there)."""
    return _device.cuda_peak(device) if device.startswith("cuda") else contextlib.nullcontext({})


def _release_free_memory() -> None:
    # glibc keeps freed prefill buffers mapped; hand them back so that they do not count as decode memory.
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------------------- one measurement
def build_model(variant: str, shape: Shape, seed: int, device: str = "cpu") -> GPT2LMHeadModel:
    """Randomly initialised GPT-2 of `shape`; `variant` picks which layers (if any) are primal."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_head,
        vocab_size=shape.vocab_size,
        n_positions=shape.n_positions,
        bos_token_id=shape.vocab_size - 1,  # GPT-2's <|endoftext|> id, kept inside smaller test vocabularies
        eos_token_id=shape.vocab_size - 1,
        primal_attention=VARIANTS[variant],
    )
    config._attn_implementation = "sdpa"  # canonical layers of every variant run SDPA, like stock
    return GPT2LMHeadModel(config).eval().to(device)  # built on the CPU: the same weights on every device


def _branch(cache: DynamicCache) -> DynamicCache:
    """A cache that starts from `cache`'s contents without copying them.

    DynamicLayer and PrimalCacheLayer replace their tensors on every update instead of writing into them,
    so shallow copies of the layers can be decoded from while the original stays at the prefill state.
    """
    branch = DynamicCache.__new__(DynamicCache)
    branch.__dict__.update(cache.__dict__)
    branch.layers = [layer.__class__.__new__(layer.__class__) for layer in cache.layers]
    for new, old in zip(branch.layers, cache.layers):
        new.__dict__.update(old.__dict__)
    return branch


def _decode(model: GPT2LMHeadModel, cache: DynamicCache, token: torch.Tensor, steps: int, device: str = "cpu",
            dtype: str = "fp32") -> float:
    _device.synchronize(device)
    start = time.perf_counter()
    with _device.autocast(device, dtype):
        for _ in range(steps):
            logits = model(token, **{cache_kwarg(): cache}, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
    _device.synchronize(device)  # CUDA runs kernels asynchronously: wait for them before reading the clock
    return time.perf_counter() - start


def _prefill(model: GPT2LMHeadModel, prompt: torch.Tensor, device: str = "cpu",
             dtype: str = "fp32") -> tuple[DynamicCache, torch.Tensor, float]:
    cache = DynamicCache(config=model.config)
    _device.synchronize(device)
    start = time.perf_counter()
    # Only the last position's logits are needed, as in generate(); a full (context, vocab) logits tensor
    # would dominate the prefill memory of every variant alike.
    with _device.autocast(device, dtype):
        logits = model(prompt, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1).logits
    _device.synchronize(device)
    elapsed = time.perf_counter() - start
    return cache, logits[:, -1].argmax(-1, keepdim=True), elapsed


def _prompt(shape: Shape, context: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + context)
    return torch.randint(0, shape.vocab_size, (1, context), generator=generator)


def measure_memory(variant: str, context: int, shape: Shape, new_tokens: int, threads: int, seed: int,
                   device: str = "cpu", dtype: str = "fp32") -> dict:
    """Cache bytes, prefill time and peak memory of one (variant, context) pair; run it in its own process.

    On CUDA: the allocator's memory, as the level before a phase plus that phase's peak above it (`_device.cuda_peak`).
    """
    cuda = device.startswith("cuda")
    hwm_reset = True if cuda else _reset_peak_rss()
    torch.set_num_threads(threads)
    model = build_model(variant, shape, seed, device)
    model_rss = _cuda_mb(device) if cuda else _rss_mb()
    with torch.no_grad():
        with _cuda_peak(device) as prefill:
            cache, first, prefill_s = _prefill(model, _prompt(shape, context, seed).to(device), device, dtype)
        nbytes = cache_nbytes(cache)
        peak_rss = model_rss + prefill["peak_mib"] if cuda else _peak_rss_mb()
        _release_free_memory()
        hwm_reset = (cuda or _reset_peak_rss()) and hwm_reset
        decode_start = _cuda_mb(device) if cuda else 0.0
        with _cuda_peak(device) as decode:
            _decode(model, cache, first, new_tokens, device, dtype)
        decode_peak_rss = decode_start + decode["peak_mib"] if cuda else _peak_rss_mb()
    return {
        "prefill_s": prefill_s,
        "cache_bytes": nbytes,
        "model_rss_mb": model_rss,
        "peak_rss_mb": max(peak_rss, decode_peak_rss),
        "decode_peak_rss_mb": decode_peak_rss,
        "rss_high_water_reset": hwm_reset,
    }


def measure_latency(
    contexts: list[int], shape: Shape, new_tokens: int, repeats: int, threads: int, seed: int, device: str = "cpu",
    dtype: str = "fp32",
) -> dict[tuple[str, int], list[float]]:
    """Per-token decode seconds of every (variant, context) pair, `repeats` samples each.

    All pairs live in one process and are timed round-robin, in a new shuffled order every round: a burst
    of load from other processes then spoils one sample of a few pairs (which the median discards) instead
    of every sample of whichever pair happened to be running.
    """
    torch.set_num_threads(threads)
    models = {variant: build_model(variant, shape, seed, device) for variant in VARIANTS}
    prefilled = {}
    with torch.no_grad():
        for context in contexts:
            prompt = _prompt(shape, context, seed).to(device)
            for variant, model in models.items():
                cache, first, _ = _prefill(model, prompt, device, dtype)
                prefilled[variant, context] = (cache, first)
        samples: dict[tuple[str, int], list[float]] = {pair: [] for pair in prefilled}
        order = list(prefilled)
        for round_ in range(repeats + 1):  # round 0 warms up kernels and the allocator; not recorded
            random.Random(seed + round_).shuffle(order)
            for variant, context in order:
                cache, first = prefilled[variant, context]
                elapsed = _decode(models[variant], _branch(cache), first, new_tokens, device, dtype)
                if round_:
                    samples[variant, context].append(elapsed / new_tokens)
        for (_variant, context), (cache, _) in prefilled.items():
            if cache.get_seq_length() != context:
                raise RuntimeError("decoding from a branch modified a prefilled cache; latencies would be wrong")
    return samples


def measure_compiled(
    variant: str, context: int, shape: Shape, new_tokens: int, repeats: int, threads: int, seed: int, backend: str,
    device: str = "cpu", dtype: str = "fp32",
) -> dict:
    """Per-token decode latency through ``torch.compile(model.forward, fullgraph=True)`` on a static cache."""
    torch.set_num_threads(threads)
    model = build_model(variant, shape, seed, device)
    prompt = _prompt(shape, context, seed).to(device)
    steps = 1 + new_tokens * repeats
    cache = StaticCache(config=model.config, max_cache_len=context + steps)
    forward = torch.compile(model.forward, fullgraph=True, backend=backend)
    tokens = []
    with torch.no_grad(), _device.autocast(device, dtype):
        # Eager prefill, as generate() does with a compiled decode.
        logits = model(prompt, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)

        def step(token: torch.Tensor) -> torch.Tensor:
            position = torch.tensor([[context + len(tokens)]], device=device)
            tokens.append(token)
            out = forward(input_ids=token, **{cache_kwarg(): cache}, use_cache=True, position_ids=position)
            return out.logits[:, -1].argmax(-1, keepdim=True)

        _device.synchronize(device)  # each clock is read after the device has finished (CUDA runs asynchronously)
        start = time.perf_counter()
        token = step(token)  # traces and compiles
        _device.synchronize(device)
        compile_s = time.perf_counter() - start
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(new_tokens):
                token = step(token)
            _device.synchronize(device)
            samples.append((time.perf_counter() - start) / new_tokens)
        tokens.append(token)
        # The same greedy tokens from eager decoding on the default dynamic cache (first pass only: cheap).
        check = 1 + new_tokens
        cache, first, _ = _prefill(model, prompt, device, dtype)
        eager = [first]
        for _ in range(check - 1):
            logits = model(eager[-1], **{cache_kwarg(): cache}, use_cache=True).logits
            eager.append(logits[:, -1].argmax(-1, keepdim=True))
    if not torch.equal(torch.cat(tokens[:check], 1), torch.cat(eager, 1)):
        raise RuntimeError(f"{variant} at context {context}: compiled static-cache tokens differ from eager decoding")
    return {
        "variant": variant, "context": context, "backend": backend, "threads": threads, "new_tokens": new_tokens,
        "repeats": repeats, "compile_s": compile_s, "compiled_ms": 1e3 * statistics.median(samples),
        "compiled_ms_min": 1e3 * min(samples), "compiled_ms_max": 1e3 * max(samples), "tokens_match": True,
    }


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


def _child(conn, fn: Callable, args: tuple) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # report any failure to the parent instead of dying silently
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_isolated(fn: Callable, *args: Any) -> Any:
    """Run `fn(*args)` in a forked child so that its peak memory is its own and nothing leaks between runs."""
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, fn, args))
    proc.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"benchmark worker died with exit code {proc.exitcode} (out of memory?)") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"benchmark worker failed:\n{payload}")
    return payload


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
    _device.add_arguments(parser)
    args = parser.parse_args(argv)
    args.device, args.dtype = _device.resolve(args)
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
            row.update(run_isolated(measure_memory, variant, context, shape, args.new_tokens, args.threads, args.seed,
                                    args.device, args.dtype))
            rows.append(row)
            print(
                f"  {variant:<18} context {context:>5}: cache {row['cache_bytes'] / 2**20:9.3f} MiB, decode peak RSS "
                f"{row['decode_peak_rss_mb']:7.0f} MiB, prefill {row['prefill_s']:6.2f} s",
                flush=True,
            )
    print(f"latency: one worker, {args.repeats} rounds over all pairs", flush=True)
    load_before = os.getloadavg()[0]
    samples = run_isolated(
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
            run_isolated(measure_compiled, variant, context, shape, args.new_tokens, args.repeats, args.threads,
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
