"""What one run of the causal-LM benchmark does, in a fresh process: train a row's GPT-2 and score it
(`train_job`), or time the decoding of every row (`decode_rows`)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from hf_primal.modeling.cache import cache_kwarg, cache_nbytes

from .. import harness
from .corpus import load_streams
from .model import Recipe, build, perplexity, train


def train_job(job: tuple) -> tuple[dict, list[dict]]:
    """(tokenization, variant, seed, recipe, threads) -> (the run's row, its curve)."""
    tokenization, variant, seed, recipe, threads = job
    torch.set_num_threads(threads)
    streams = load_streams(tokenization)
    model = build(variant, streams.vocab_size, recipe, seed)
    history = train(model, streams.splits["train"], streams.splits["validation"], recipe, seed)
    scores = {f"{name}_ppl": perplexity(model, streams.splits[split], recipe.context, recipe.final_tokens)
              for name, split in (("valid", "validation"), ("test", "test"))}
    row = {"tokenization": tokenization, "variant": variant, "seed": seed, **scores,
           "train_ppl": history[-1]["train_ppl"], "steps": recipe.steps, "batch": recipe.batch,
           "context": recipe.context, "train_minutes": history[-1]["train_seconds"] / 60.0,
           "parameters": sum(p.numel() for p in model.parameters()),
           "machine": harness.machine_line("cpu", "fp32", threads)}
    return row, history


@torch.no_grad()
def _decode_once(model, prompt: torch.Tensor, steps: int) -> tuple[list[float], int]:
    """Prefill `prompt`, then `steps` greedy one-token steps: per-step seconds and the cache's bytes at the end."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, use_cache=True, **{cache_kwarg(): cache})
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        out = model(input_ids=token, use_cache=True, **{cache_kwarg(): cache})
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - began)
    return times, cache_nbytes(cache)


def decode_rows(variants: list[str], recipe: Recipe, contexts: list[int], steps: int, threads: int,
                vocab_size: int = 257, rounds: int = 3) -> list[dict]:
    """Median per-token decode time and the cache's bytes for each row's GPT-2 (batch 1) decoding the last `steps`
    tokens of each context length, the rows alternating round-robin `rounds` times in this process; ratios to
    softmax."""
    torch.set_num_threads(threads)
    models = {variant: build(variant, vocab_size, recipe, 0).eval() for variant in variants}
    rows = []
    for context in contexts:
        # The prompt leaves room for the decoded tokens, so the context ends at `context` tokens (the position table).
        prompt = torch.randint(0, vocab_size - 1, (1, context - steps),
                               generator=torch.Generator().manual_seed(context))
        times: dict[str, list[float]] = {variant: [] for variant in variants}
        nbytes: dict[str, int] = {}
        for _ in range(rounds):
            for variant, model in models.items():
                step_times, nbytes[variant] = _decode_once(model, prompt, steps)
                times[variant] += step_times
        for variant in variants:
            rows.append({"variant": variant, "context": context, "state_bytes": nbytes[variant],
                         "ms_per_token": 1000 * statistics.median(times[variant]), "new_tokens": steps,
                         "machine": harness.machine_line("cpu", "fp32", threads)})
    for row in rows:
        base = next((r for r in rows if r["variant"] == "softmax" and r["context"] == row["context"]), None)
        if base is not None:
            row["speedup_vs_softmax"] = base["ms_per_token"] / row["ms_per_token"]
            row["state_ratio_vs_softmax"] = base["state_bytes"] / row["state_bytes"]
    return rows
