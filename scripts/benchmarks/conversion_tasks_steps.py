"""The timing phase of the conversion-tasks benchmark: inference time per batch of MiniLM (N = 128, 512) and of a
BERT-base-width 6-layer stack (N = 4096) with K primal layers, relative to stock, in one process (run alone). The
task and the table: conversion_tasks.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from . import harness, minilm
from .conversion_tasks_jobs import chosen_layers, primal_spec, setup


def _time_forward(model, batch, repeats, device: str = "cpu", dtype: str = "fp32") -> float:
    with torch.no_grad(), harness.autocast(device, dtype):
        model(**batch)
        times = []
        for _ in range(repeats):
            harness.synchronize(device)  # CUDA runs kernels asynchronously: the clock waits for them at both ends
            started = time.perf_counter()
            model(**batch)
            harness.synchronize(device)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_timing(args, selections, path: Path) -> None:
    """Inference time per batch of each K relative to stock, all in this process (`--timing-threads`), for each of
    `selections` ("auto", "last"); the rows go to `path`."""
    from transformers import BertConfig, BertModel

    from hf_primal.tools.data import minilm_path

    setup()
    torch.set_num_threads(args.timing_threads)
    rows = []
    shapes = [("MiniLM-L6", 128, 16), ("MiniLM-L6", 512, 4), ("BERT-base width, 6 layers", 4096, 1)]
    if args.quick:
        shapes = [("MiniLM-L6", 32, 2)]
    for name, length, batch_size in shapes:
        if name.startswith("MiniLM"):
            def build(spec=None):
                extra = {"primal_attention": spec} if spec is not None else {}
                return BertModel.from_pretrained(minilm_path(), **extra).eval().to(args.device)
        else:
            config = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                          num_hidden_layers=minilm.LAYERS, max_position_embeddings=length, attn_implementation="sdpa")

            def build(spec=None, config=config):
                torch.manual_seed(0)
                model = BertModel(BertConfig(**config, **({"primal_attention": spec} if spec is not None else {})))
                return model.to(args.device)
        g = torch.Generator().manual_seed(0)
        batch = {"input_ids": torch.randint(1000, 20000, (batch_size, length), generator=g).to(args.device),
                 "attention_mask": torch.ones(batch_size, length, dtype=torch.long).to(args.device)}
        repeats = 2 if args.quick else (3 if length >= 4096 else 9)
        stock = _time_forward(build(), batch, repeats, args.device, args.dtype)
        for selection in selections:
            for k in args.ks:
                if k == minilm.LAYERS and selection == "auto":
                    continue
                layers = chosen_layers(args, selection, k)
                model = build(primal_spec(args, layers).to_dict())
                seconds = _time_forward(model, batch, repeats, args.device, args.dtype)
                rows.append({"model": name, "tokens": length, "batch": batch_size, "selection": selection, "k": k,
                             "layers": " ".join(map(str, layers)), "stock_seconds": round(stock, 5),
                             "primal_seconds": round(seconds, 5), "time_vs_stock": round(seconds / stock, 4),
                             "threads": args.timing_threads, "load_average": round(os.getloadavg()[0], 2),
                             "device": args.device, "dtype": args.dtype})
    harness.write_rows(path, rows)
