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

    python scripts/benchmark.py                                  # full run, ~15 min on 2 CPU cores
    python scripts/benchmark.py --quick --out-dir /tmp/bench     # tiny shapes, seconds (used by the tests)
    python scripts/benchmark.py --device cuda --dtype bf16       # on a GPU: autocast steps, CUDA allocator peaks
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import math
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Workers are forked. By default torch.cuda.is_available() (`_device.resolve` calls it; libraries may too) runs
# cuInit, after which CUDA fails in every forked child; the NVML-based check leaves the parent uninitialised.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import BertConfig, BertModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _device  # noqa: E402

import hf_primal  # noqa: E402
from hf_primal.modeling.layers import run_primal  # noqa: E402

VARIANTS = ("primal-all", "primal-last", "sdpa", "eager")
KSVD_ETA = 0.05
NUM_CLASSES = 10


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    intermediate: int
    layers: int
    batch: int
    lengths: tuple[int, ...]
    low_rank: int = 30
    rank_multi: int = 10
    vocab: int = 512


@dataclass
class Settings:
    threads: int
    repeats: int
    budget_s: float
    eager_limit_gib: float
    fit_from: int
    sublayer_n: int
    sections: dict[str, Shape] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "fp32"  # autocast precision of the timed steps (`_device.DTYPES`)


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


# ------------------------------------------------------------------------------------------ models
def bert_config(shape: Shape, variant: str, max_len: int) -> BertConfig:
    config = BertConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=max_len,
        hidden_dropout_prob=0.0,  # dropout off everywhere: SDPA on CPU keeps its fused kernel only without it
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager" if variant == "eager" else "sdpa"
    if variant.startswith("primal"):
        layers = "all" if variant == "primal-all" else [-1]
        config.primal_attention = {"layers": layers, "low_rank": shape.low_rank, "rank_multi": shape.rank_multi}
    return config


class Classifier(torch.nn.Module):
    """Encoder + mean pooling + linear head, the LRA classification setup."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.head = torch.nn.Linear(config.hidden_size, NUM_CLASSES)
        self.primal = bool(hf_primal.primal_layers(self.encoder))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids=ids).last_hidden_state.mean(dim=1))


def make_step(model: Classifier, ids: torch.Tensor, labels: torch.Tensor, mode: str, device: str = "cpu",
              dtype: str = "fp32") -> Callable[[], None]:
    """One training or inference step; it synchronises at its end, so that a wall clock read after it is right."""
    if mode == "infer":
        model.eval()

        def infer() -> None:
            with torch.inference_mode(), _device.autocast(device, dtype):
                model(ids)
            _device.synchronize(device)

        return infer
    model.train()

    def train() -> None:
        model.zero_grad(set_to_none=True)
        with _device.autocast(device, dtype):
            loss = F.cross_entropy(model(ids), labels)
            if model.primal:
                loss = loss + KSVD_ETA * hf_primal.ksvd_loss(model.encoder)
        loss.backward()
        _device.synchronize(device)

    return train


def build(shape: Shape, variant: str, n: int, seed: int = 0,
          device: str = "cpu") -> tuple[Classifier, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)  # drawn on the CPU, so every device gets the same weights and inputs
    model = Classifier(bert_config(shape, variant, max(shape.lengths))).to(device)
    ids = torch.randint(1, shape.vocab, (shape.batch, n)).to(device)
    labels = torch.randint(0, NUM_CLASSES, (shape.batch,)).to(device)
    return model, ids, labels


def eager_estimate_gib(shape: Shape, n: int) -> float:
    return (3 * shape.layers + 2) * shape.batch * shape.heads * n * n * 4 / 2**30


def skip_reason(settings: Settings, shape: Shape, variant: str, n: int) -> Optional[str]:
    if variant == "eager":
        estimate = eager_estimate_gib(shape, n)
        if estimate > settings.eager_limit_gib:
            return f"skipped: eager attention needs ~{estimate:.0f} GiB > {settings.eager_limit_gib:g} GiB"
    return None


# ------------------------------------------------------------------------------------------ sub-layer pieces
def sublayer_module(shape: Shape, variant: str, n: int) -> torch.nn.Module:
    one_layer = replace(shape, layers=1, lengths=(n,))
    torch.manual_seed(0)
    return BertModel(bert_config(one_layer, variant, n), add_pooling_layer=False).encoder.layer[0].train()


def sublayer_steps(shape: Shape, n: int, device: str = "cpu", dtype: str = "fp32") -> dict[str, Callable[[], None]]:
    """Forward + backward of the attention sub-layer per variant, and of the primal middle / whole layer."""
    torch.manual_seed(0)
    x = torch.randn(shape.batch, n, shape.hidden).to(device).requires_grad_()
    grad = torch.randn(shape.batch, n, shape.hidden).to(device)
    steps: dict[str, Callable[[], None]] = {}
    layers = {}
    for variant in ("primal-all", "sdpa", "eager"):
        layer = sublayer_module(shape, variant, n).to(device)
        layers[variant] = layer

        def attention_step(layer=layer) -> None:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with _device.autocast(device, dtype):
                out = layer.attention(x)[0]
            out.backward(grad.to(out.dtype))
            _device.synchronize(device)

        steps[f"attention {variant}"] = attention_step
    primal = layers["primal-all"]

    def layer_step() -> None:
        primal.zero_grad(set_to_none=True)
        x.grad = None
        with _device.autocast(device, dtype):
            out = primal(x)
        out.backward(grad.to(out.dtype))
        _device.synchronize(device)

    steps["layer primal-all"] = layer_step
    attn = primal.attention.self
    head_dim = shape.hidden // shape.heads
    split = (shape.batch, n, shape.heads, head_dim)
    # Detached leaves shaped exactly like the projections inside the layer (in its autocast precision too).
    with torch.no_grad(), _device.autocast(device, dtype):
        q = attn.query(x).view(split).transpose(1, 2).requires_grad_()
        k = attn.key(x).view(split).transpose(1, 2).requires_grad_()
    x_in = x.detach().requires_grad_()

    def middle_step() -> None:
        attn.zero_grad(set_to_none=True)
        q.grad = k.grad = x_in.grad = None
        with _device.autocast(device, dtype):
            out = run_primal(attn, q, k, x_in, None)[0]
        out.backward(grad.to(out.dtype))
        _device.synchronize(device)

    steps["middle primal-all"] = middle_step
    return steps


# ------------------------------------------------------------------------------------------ measuring
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _fix_malloc() -> None:
    # A fixed mmap threshold (glibc raises it dynamically otherwise) returns every freed tensor above
    # 128 KiB to the OS at once, so the resident set tracks live memory.
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def memory_job(settings: Settings, section: str, variant: str, n: int) -> dict[str, Any]:
    torch.set_num_threads(settings.threads)
    device, dtype = settings.device, settings.dtype
    cuda = device.startswith("cuda")
    if not cuda:
        _fix_malloc()
    shape = settings.sections[section]
    model, ids, labels = build(shape, variant, n, device=device)
    # A short warm-up step first: lazy one-time allocations (kernel libraries, autograd engine) are not the
    # step's memory, and would otherwise add a constant ~17 MiB to every configuration.
    make_step(model, ids[:, : min(n, 128)], labels, "train", device, dtype)()
    step = make_step(model, ids, labels, "train", device, dtype)
    model.zero_grad(set_to_none=True)
    if cuda:  # the allocator's high-water mark; the resident set of a CUDA process says nothing about tensors
        with _device.cuda_peak(device) as peak:
            step()
        return {"peak_mib": peak["peak_mib"]}
    _trim()
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current resident set
    step()
    peak = _status_kib("VmHWM")
    return {"peak_mib": (peak - base) / 1024}


def _time_round_robin(
    steps: dict[str, Callable[[], None]], repeats: int, budget_s: float
) -> dict[str, tuple[float, float, int]]:
    """name -> (median ms, min ms, timed repeats); warm-up first, then randomised round-robin passes."""
    first: dict[str, float] = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        first[name] = time.perf_counter() - start
    wanted = {name: max(1, min(repeats, int(budget_s / max(t, 1e-9)))) for name, t in first.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    rng = random.Random(0)
    while any(len(samples[name]) < wanted[name] for name in steps):
        order = [name for name in steps if len(samples[name]) < wanted[name]]
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            steps[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: (statistics.median(v) * 1e3, min(v) * 1e3, len(v)) for name, v in samples.items()}


def timing_job(settings: Settings, section: str) -> list[dict[str, Any]]:
    torch.set_num_threads(settings.threads)
    shape = settings.sections[section]
    rows = []
    for n in shape.lengths:
        built = {}
        for variant in VARIANTS:
            if skip_reason(settings, shape, variant, n) is None:
                built[variant] = build(shape, variant, n, device=settings.device)
        for mode in ("train", "infer"):
            steps = {v: make_step(m, ids, labels, mode, settings.device, settings.dtype)
                     for v, (m, ids, labels) in built.items()}
            times = _time_round_robin(steps, settings.repeats, settings.budget_s)
            load = os.getloadavg()[0]  # > threads means other processes competed for the cores meanwhile
            for variant, (median, low, reps) in times.items():
                rows.append({"section": section, "variant": variant, "n": n, "batch": shape.batch, "mode": mode,
                             "time_ms": median, "time_ms_min": low, "reps": reps, "load1": load})
            gc.collect()
        print(f"  [{section}] N={n} timed", flush=True)
        del built
        gc.collect()
    return rows


def sublayer_job(settings: Settings) -> list[dict[str, Any]]:
    torch.set_num_threads(settings.threads)
    rows = []
    n = settings.sublayer_n
    for section in ("bert-base", "lra"):
        shape = settings.sections[section]
        steps = sublayer_steps(shape, n, settings.device, settings.dtype)
        times = _time_round_robin(steps, settings.repeats, settings.budget_s)
        load = os.getloadavg()[0]
        for name, (median, low, reps) in times.items():
            part, variant = name.split(" ")
            rows.append({"section": f"{part}:{section}", "variant": variant, "n": n, "batch": shape.batch,
                         "mode": "train", "time_ms": median, "time_ms_min": low, "reps": reps, "load1": load})
    return rows


# ------------------------------------------------------------------------------------------ workers
def _worker(conn, fn, args) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # report instead of hanging the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def in_worker(fn: Callable, *args) -> Any:
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_worker, args=(child, fn, args))
    process.start()
    child.close()
    status, payload = parent.recv()
    process.join()
    if status != "ok":
        raise RuntimeError(f"worker {fn.__name__}{args[1:]} failed:\n{payload}")
    return payload


# ------------------------------------------------------------------------------------------ analysis
def fit_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(time) against log(N)."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


def lookup(rows: list[dict], **match) -> Optional[dict]:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def add_ratios(rows: list[dict]) -> None:
    for row in rows:
        for base in ("eager", "sdpa"):
            ref = lookup(rows, section=row["section"], n=row["n"], mode=row["mode"], variant=base)
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
    primal = lookup(rows, section="lra", variant="primal-all", mode="train", n=n_ref)
    for base, speed_target, mem_target in (("eager", 20.0, 15.0), ("sdpa", 6.0, None)):
        if primal and primal.get(f"speedup_vs_{base}"):
            summary.append({"name": f"lra primal-all train speedup vs {base} (N={n_ref})",
                            "value": primal[f"speedup_vs_{base}"], "target": f">= {speed_target:g}", "met": None})
        if mem_target and primal and primal.get(f"mem_ratio_vs_{base}"):
            summary.append({"name": f"lra primal-all peak memory ratio vs {base} (N={n_ref})",
                            "value": primal[f"mem_ratio_vs_{base}"], "target": f">= {mem_target:g}", "met": None})
    n = settings.sublayer_n
    for section in ("bert-base", "lra"):
        att = {v: lookup(rows, section=f"attention:{section}", variant=v, n=n) for v in ("primal-all", "sdpa", "eager")}
        for base in ("sdpa", "eager"):
            if att["primal-all"] and att[base]:
                summary.append({"name": f"{section} attention sub-layer train speedup vs {base} (N={n})",
                                "value": att[base]["time_ms"] / att["primal-all"]["time_ms"],
                                "target": ">= 5" if (section, base) == ("bert-base", "sdpa") else "", "met": None})
        middle = lookup(rows, section=f"middle:{section}", n=n)
        layer = lookup(rows, section=f"layer:{section}", n=n)
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


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(rows: list[dict], summary: list[dict], header: str) -> None:
    print(header)
    cols = ["section", "variant", "n", "mode", "time_ms", "time_ms_min", "reps", "peak_mib", "speedup_vs_eager",
            "speedup_vs_sdpa", "mem_ratio_vs_eager", "load1", "status"]
    widths = [11, 11, 5, 5, 10, 11, 4, 9, 16, 15, 18, 5, 10]
    print(" ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print(" ".join(_fmt(row.get(c), 2 if c.startswith(("speed", "mem_")) else 1).rjust(w)
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


def environment(settings: Settings) -> str:
    load = os.getloadavg()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    # The device by name only: asking CUDA for its GPU's name would initialise it in the parent before it forks.
    return (f"torch {torch.__version__}, {settings.device} {settings.dtype}, {settings.threads} threads, "
            f"{os.cpu_count()} CPUs ({cpu}), load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and three repeats (for tests)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration at most")
    parser.add_argument("--budget-s", type=float, default=12.0,
                        help="fewer repeats for configurations whose steps take longer than this / repeats")
    parser.add_argument("--max-n", type=int, default=8192, help="longest sequence (full run)")
    parser.add_argument("--bert-layers", type=int, default=2, help="layers of the BERT-base-width encoder")
    parser.add_argument("--eager-limit-gib", type=float, default=12.0)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory workers")
    parser.add_argument("--only", action="append", choices=["lra", "bert-base", "sublayer"],
                        help="run only these parts (repeatable); default: all")
    _device.add_arguments(parser)
    args = parser.parse_args(argv)
    args.device, args.dtype = _device.resolve(args)
    settings = quick_settings(args) if args.quick else full_settings(args)
    parts = set(args.only or ["lra", "bert-base", "sublayer"])
    started = time.time()
    header = environment(settings)
    print(f"Primal-Attention benchmark ({'quick' if args.quick else 'full'}): {header}", flush=True)

    rows: list[dict[str, Any]] = []
    for section, shape in settings.sections.items():
        if section not in parts:
            continue
        rows += in_worker(timing_job, settings, section)
        for n in shape.lengths:
            for variant in VARIANTS:
                reason = skip_reason(settings, shape, variant, n)
                if reason is not None:
                    for mode in ("train", "infer"):
                        rows.append({"section": section, "variant": variant, "n": n, "batch": shape.batch,
                                     "mode": mode, "status": reason})
                    continue
                if args.no_memory:
                    continue
                memory = in_worker(memory_job, settings, section, variant, n)
                row = lookup(rows, section=section, variant=variant, n=n, mode="train")
                row["peak_mib"] = memory["peak_mib"]
        print(f"  [{section}] memory done ({time.time() - started:.0f} s)", flush=True)
    if "sublayer" in parts:
        rows += in_worker(sublayer_job, settings)
    for row in rows:
        row.setdefault("status", "ok")
        row.update(device=settings.device, dtype=settings.dtype)
    order = {v: i for i, v in enumerate(VARIANTS)}
    parts_by_section = [f"{part}:{s}" for s in ("bert-base", "lra") for part in ("attention", "middle", "layer")]
    sections = ["lra", "bert-base"] + parts_by_section
    rows.sort(key=lambda r: (sections.index(r["section"]), r["mode"] != "train", r["n"], order.get(r["variant"], 9)))
    add_ratios(rows)
    summary = summarise(settings, rows, args.quick)
    header = f"{header}; end {environment(settings).split('load average ')[1]}; {time.time() - started:.0f} s"
    print_table(rows, summary, header)
    write_outputs(args.out_dir, rows, summary, header)
    print(f"\nwrote {args.out_dir / 'benchmark.csv'}, benchmark_summary.csv and benchmark.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
