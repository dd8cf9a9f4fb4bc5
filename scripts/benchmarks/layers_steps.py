"""What the layer benchmark measures, each part in a forked child: the timed training and inference steps of every
variant (round-robin), one training step's peak memory, and the attention sub-layer's pieces. The task and the
table: layers.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from hf_primal.modeling.layers import run_primal

from . import harness
from .encoder import Shape, build, eager_estimate_gib, make_step, sublayer_module

VARIANTS = ("primal-all", "primal-last", "sdpa", "eager")


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
    dtype: str = "fp32"  # autocast precision of the timed steps (`harness.DTYPES`)


def skip_reason(settings: Settings, shape: Shape, variant: str, n: int) -> Optional[str]:
    if variant == "eager":
        estimate = eager_estimate_gib(shape, n)
        if estimate > settings.eager_limit_gib:
            return f"skipped: eager attention needs ~{estimate:.0f} GiB > {settings.eager_limit_gib:g} GiB"
    return None


def sublayer_steps(shape: Shape, n: int, device: str = "cpu", dtype: str = "fp32") -> dict[str, Callable[[], None]]:
    """Forward + backward of the attention sub-layer per variant, and of the primal middle / whole layer."""
    torch.manual_seed(0)
    x = torch.randn(shape.batch, n, shape.hidden).to(device).requires_grad_()
    grad = torch.randn(shape.batch, n, shape.hidden).to(device)
    steps: dict[str, Callable[[], None]] = {}
    layers = {}
    for variant in ("primal-all", "sdpa", "eager"):
        layer = layers[variant] = sublayer_module(shape, variant, n).to(device)
        steps[f"attention {variant}"] = harness.backward_step(layer, lambda layer=layer: layer.attention(x)[0], grad,
                                                              (x,), device, dtype)
    primal = layers["primal-all"]
    steps["layer primal-all"] = harness.backward_step(primal, lambda: primal(x), grad, (x,), device, dtype)
    attn = primal.attention.self
    head_dim = shape.hidden // shape.heads
    split = (shape.batch, n, shape.heads, head_dim)
    # Detached leaves shaped exactly like the projections inside the layer (in its autocast precision too).
    with torch.no_grad(), harness.autocast(device, dtype):
        q = attn.query(x).view(split).transpose(1, 2).requires_grad_()
        k = attn.key(x).view(split).transpose(1, 2).requires_grad_()
    x_in = x.detach().requires_grad_()

    steps["middle primal-all"] = harness.backward_step(attn, lambda: run_primal(attn, q, k, x_in, None)[0], grad,
                                                       (q, k, x_in), device, dtype)
    return steps


def memory_job(settings: Settings, section: str, variant: str, n: int) -> dict[str, Any]:
    device, dtype = settings.device, settings.dtype
    harness.start_worker(settings.threads, device)
    shape = settings.sections[section]
    model, ids, labels = build(shape, variant, n, device=device)
    # A short warm-up step first: lazy one-time allocations (kernel libraries, autograd engine) are not the
    # step's memory, and would otherwise add a constant ~17 MiB to every configuration.
    make_step(model, ids[:, : min(n, 128)], labels, "train", device, dtype)()
    step = make_step(model, ids, labels, "train", device, dtype)
    model.zero_grad(set_to_none=True)
    return {"peak_mib": harness.step_peak_mib(step, device)}


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
            times = harness.time_round_robin(steps, settings.repeats, settings.budget_s)
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
        times = harness.time_round_robin(steps, settings.repeats, settings.budget_s)
        load = os.getloadavg()[0]
        for name, (median, low, reps) in times.items():
            part, variant = name.split(" ")
            rows.append({"section": f"{part}:{section}", "variant": variant, "n": n, "batch": shape.batch,
                         "mode": "train", "time_ms": median, "time_ms_min": low, "reps": reps, "load1": load})
    return rows
