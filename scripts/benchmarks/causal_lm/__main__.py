"""Causal language modelling from scratch on real text: softmax, Primal.+, Primal. and its causal mixing rules.

Task: next-token prediction on BBC News articles (`corpus`: bytes, or all-MiniLM-L6-v2's word pieces), split by
article (train / validation / test). Model (`model`): GPT-2 with 4 layers, width 128, 4 heads, context 256, trained
from scratch for 1,200 AdamW steps of 16 windows (about 1.6 passes over the 3 MB of training bytes), identical data
order, optimiser and seed for every row. Rows: ``softmax``, ``primal-last`` (Primal.+), ``primal`` (Primal.,
hf_primal's defaults), ``primal-decay`` / ``primal-prefix_mean`` (Primal. with each ``causal_mixing`` rule),
``no-mixing`` (every attention block removed: the floor any token mixing must beat) and ``bigram`` (add-one byte
bigram counts, no network). Settings are chosen on the validation split; the test split is scored once at the end.

Measured per run (a fresh one-thread process each, ``--workers`` side by side): validation perplexity every 200 steps
(on its first 200k tokens) and training perplexity of the batches since the last point (`causal_lm_curves.csv`);
at the end perplexity on the whole validation and test splits and the training time (`causal_lm.csv`); mean and std
over seeds, the ratio to softmax and the share of the gap from the no-mixing floor to softmax closed
(`causal_lm_summary.csv`); validation curves (`causal_lm.png`). ``--only decode`` times greedy decoding of each row's
GPT-2 (one process, one thread, round-robin, same prompt) after a prompt of 256 / 1,024 / 4,096 tokens and records
the generation state's bytes (`causal_lm_decode.csv`). Finished runs are not rerun.

    pip install -e ".[bench]"
    python -m scripts.benchmarks.causal_lm                               # bytes, seed 0, every row (about an hour)
    python -m scripts.benchmarks.causal_lm --only train --seeds 1,2 --variants softmax,primal,primal-last,no-mixing
    python -m scripts.benchmarks.causal_lm --only train --tokenization wordpiece --variants softmax,primal-last,primal
    python -m scripts.benchmarks.causal_lm --only decode                 # state bytes and decode time (minutes)
    python -m scripts.benchmarks.causal_lm --only report
    python -m scripts.benchmarks.causal_lm --quick --out-dir /tmp/clm    # smoke run (what the test executes)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Optional

from .. import harness
from .corpus import TOKENIZATIONS, bigram_perplexity, load_streams
from .model import VARIANTS, Recipe
from .report import report
from .steps import decode_rows, train_job

RUNS, CURVES, DECODE = "causal_lm.csv", "causal_lm_curves.csv", "causal_lm_decode.csv"


def _key(row: dict) -> tuple:
    return row["tokenization"], row["variant"], str(row["seed"])


def train_phase(args: argparse.Namespace) -> None:
    out = Path(args.out_dir)
    runs, curves = harness.read_rows(out / RUNS), harness.read_rows(out / CURVES)
    done = {_key(row) for row in runs}
    for tokenization in args.tokenization:
        streams = load_streams(tokenization)
        for seed in args.seeds:
            if (tokenization, "bigram", str(seed)) not in done:
                ppl = {f"{split}_ppl": bigram_perplexity(streams.splits["train"], streams.splits[split],
                                                         streams.vocab_size) for split in ("validation", "test")}
                runs.append({"tokenization": tokenization, "variant": "bigram", "seed": seed,
                             "valid_ppl": ppl["validation_ppl"], "test_ppl": ppl["test_ppl"]})
        jobs = [(tokenization, variant, seed, args.recipe, args.threads) for seed in args.seeds
                for variant in args.variants if (tokenization, variant, str(seed)) not in done]
        for row, history in harness.run_jobs(train_job, jobs, args.workers, f"causal LM ({tokenization})",
                                             separate=True):
            runs.append(row)
            curves = [c for c in curves if _key(c) != _key(row)]
            curves += [{**{k: row[k] for k in ("tokenization", "variant", "seed")}, **point} for point in history]
            harness.write_rows(out / RUNS, runs)
            harness.write_rows(out / CURVES, curves)
            print(f"{row['tokenization']} {row['variant']} seed {row['seed']}: validation {row['valid_ppl']:.3f}, "
                  f"test {row['test_ppl']:.3f}, {row['train_minutes']:.1f} min", flush=True)
        harness.write_rows(out / RUNS, runs)


def decode_phase(args: argparse.Namespace) -> None:
    rows = decode_rows([v for v in args.variants if v != "no-mixing"], args.recipe, args.contexts, args.new_tokens,
                       args.threads)
    harness.write_rows(Path(args.out_dir) / DECODE, rows)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["train", "decode", "report"])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--tokenization", default="bytes", help=f"comma-separated, from {list(TOKENIZATIONS)}")
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--contexts", default="256,1024,4096", help="prompt lengths the decode phase times")
    parser.add_argument("--new-tokens", type=int, default=32, help="decoding steps timed per context")
    parser.add_argument("--workers", type=int, default=2, help="training runs side by side (one thread each)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny budget: a smoke test whose figures mean nothing")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.tokenization = [t.strip() for t in args.tokenization.split(",") if t.strip()]
    for name, values, allowed in (("variant", args.variants, VARIANTS), ("tokenization", args.tokenization,
                                                                         TOKENIZATIONS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.error(f"{name} {bad} not allowed: use {list(allowed)}")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    recipe = Recipe(steps=args.steps)
    if args.quick:
        recipe = dataclasses.replace(recipe, steps=4, eval_every=2, batch=2, eval_tokens=2048, final_tokens=4096,
                                     n_positions=512,
                                     n_layer=2, n_embd=32, n_head=2, context=32, low_rank=4)
        args.contexts, args.new_tokens = [64, 256], 2
    args.recipe = recipe
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    return harness.run_phases(args, {"train": train_phase, "decode": decode_phase}, report)


if __name__ == "__main__":
    sys.exit(main())
