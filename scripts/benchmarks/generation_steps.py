"""What the generation benchmark measures (each measurement in a forked child): the GPT-2 of each variant, prefill
and decoding, and the memory and latency a measurement records. The task and the table: `generation`."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, StaticCache

import hf_primal  # noqa: F401  (lets GPT2Config take `primal_attention`)
from hf_primal.modeling.cache import cache_kwarg, cache_nbytes

# harness keeps the parent free of a CUDA context (the workers are forked): it sets the NVML-based check, read
# when torch.cuda.is_available() is first called.
from . import harness

VARIANTS: dict[str, Optional[dict]] = {
    "all-primal": {"layers": "all"},
    "last-layer-primal": {"layers": [-1]},
    "stock-sdpa": None,
}


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_positions: int


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
    """`harness.cuda_peak` on CUDA; on CPU nothing (the RSS high-water mark is read directly there)."""
    return harness.cuda_peak(device) if device.startswith("cuda") else contextlib.nullcontext({})


def build_model(variant: str, shape: Shape, seed: int, device: str = "cpu") -> GPT2LMHeadModel:
    """Randomly initialised GPT-2 of `shape`; `variant` picks which layers (if any) are primal."""
    torch.manual_seed(seed)
    config = GPT2Config(
        **asdict(shape),  # the fields are named as GPT2Config's arguments
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
    harness.synchronize(device)
    start = time.perf_counter()
    with harness.autocast(device, dtype):
        for _ in range(steps):
            logits = model(token, **{cache_kwarg(): cache}, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
    harness.synchronize(device)  # CUDA runs kernels asynchronously: wait for them before reading the clock
    return time.perf_counter() - start


def _prefill(model: GPT2LMHeadModel, prompt: torch.Tensor, device: str = "cpu",
             dtype: str = "fp32") -> tuple[DynamicCache, torch.Tensor, float]:
    cache = DynamicCache(config=model.config)
    harness.synchronize(device)
    start = time.perf_counter()
    # Only the last position's logits are needed, as in generate(); a full (context, vocab) logits tensor
    # would dominate the prefill memory of every variant alike.
    with harness.autocast(device, dtype):
        logits = model(prompt, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1).logits
    harness.synchronize(device)
    elapsed = time.perf_counter() - start
    return cache, logits[:, -1].argmax(-1, keepdim=True), elapsed


def _prompt(shape: Shape, context: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + context)
    return torch.randint(0, shape.vocab_size, (1, context), generator=generator)


def measure_memory(variant: str, context: int, shape: Shape, new_tokens: int, threads: int, seed: int,
                   device: str = "cpu", dtype: str = "fp32") -> dict:
    """Cache bytes, prefill time and peak memory of one (variant, context) pair; run it in its own process.

    On CUDA: the allocator's memory, as the level before a phase plus that phase's peak above it (`harness.cuda_peak`).
    """
    cuda = device.startswith("cuda")
    hwm_reset = True if cuda else harness.reset_rss_high_water()
    torch.set_num_threads(threads)
    model = build_model(variant, shape, seed, device)
    model_rss = _cuda_mb(device) if cuda else _rss_mb()
    with torch.no_grad():
        with _cuda_peak(device) as prefill:
            cache, first, prefill_s = _prefill(model, _prompt(shape, context, seed).to(device), device, dtype)
        nbytes = cache_nbytes(cache)
        peak_rss = model_rss + prefill["peak_mib"] if cuda else _peak_rss_mb()
        harness.release_free_memory()
        hwm_reset = (cuda or harness.reset_rss_high_water()) and hwm_reset
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
    with torch.no_grad(), harness.autocast(device, dtype):
        # Eager prefill, as generate() does with a compiled decode.
        logits = model(prompt, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)

        def step(token: torch.Tensor) -> torch.Tensor:
            position = torch.tensor([[context + len(tokens)]], device=device)
            tokens.append(token)
            out = forward(input_ids=token, **{cache_kwarg(): cache}, use_cache=True, position_ids=position)
            return out.logits[:, -1].argmax(-1, keepdim=True)

        harness.synchronize(device)  # each clock is read after the device has finished (CUDA runs asynchronously)
        start = time.perf_counter()
        token = step(token)  # traces and compiles
        harness.synchronize(device)
        compile_s = time.perf_counter() - start
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(new_tokens):
                token = step(token)
            harness.synchronize(device)
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
