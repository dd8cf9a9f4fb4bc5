"""The two tasks of the uncertainty benchmark (a fine-tuned MiniLM on BBC News sentences with one topic held out, and a
digits ViT trained from scratch), how each trains a model, and the KEP-SVGP settings. The benchmark and its table:
uncertainty.
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch

from . import bbc_news


def train(model, data, collator, args, seed, epochs, learning_rate, teacher=None, primal_learning_rate=None):
    """Trainer (stock) or PrimalTrainer (primal layers: + eta * KSVD + eta_kl * KL, and the teacher if given; the
    primal layers' own parameters at `primal_learning_rate`, default `learning_rate`)."""
    from transformers import Trainer, TrainingArguments

    from hf_primal import PrimalTrainer

    with tempfile.TemporaryDirectory() as workdir:
        training = TrainingArguments(
            output_dir=workdir, per_device_train_batch_size=args.batch_size, learning_rate=learning_rate,
            num_train_epochs=epochs, warmup_steps=0.06, lr_scheduler_type="linear", save_strategy="no",
            report_to=[], seed=seed, use_cpu=True, disable_tqdm=True, logging_steps=10**6)
        kwargs = dict(model=model, args=training, train_dataset=data, data_collator=collator)
        if getattr(model.config, "primal_attention", None) is None:
            Trainer(**kwargs).train()
        else:
            extra = dict(teacher=teacher, distill_target="logits") if teacher is not None else {}
            PrimalTrainer(**kwargs, **extra, primal_learning_rate=primal_learning_rate).train()
    return model.eval()


class TextTask:
    """BBC News sentences, MiniLM fine-tuned; KEP-SVGP by converting the fine-tuned model's last layer and training
    it against that model (the conversion recipe)."""

    name = "bbc_sentences"

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        from hf_primal.tools.data import minilm_path

        self.args, self.path = args, minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        tasks, _ = bbc_news.load_tasks(num_labels=10**9, seed=0)
        task, ood = tasks["sentences"], bbc_news.TOPICS.index(args.ood_topic)
        relabel = {old: new for new, old in enumerate(i for i in range(len(bbc_news.TOPICS)) if i != ood)}
        limit = 48 if args.quick else 10**9

        def inside(rows):
            return [(text, relabel[label]) for text, label in rows if label != ood]

        self.rows = {"train": inside(task.train)[: args.labels], "validation": inside(task.validation)[:limit],
                     "test": inside(task.test)[:limit], "ood": [(t, 0) for t, y in task.test if y == ood][:limit]}

    def batches(self, split: str, size: int = 64) -> list[dict]:
        rows = self.rows[split]
        return [dict(self.tokenizer([r[0] for r in rows[i:i + size]], padding=True, truncation=True,
                                    max_length=self.args.max_length, return_tensors="pt"))
                for i in range(0, len(rows), size)]

    def _train(self, model, seed, epochs, learning_rate, teacher=None, primal_learning_rate=None):
        from datasets import Dataset
        from transformers import DataCollatorWithPadding

        rows = self.rows["train"]
        enc = self.tokenizer([r[0] for r in rows], truncation=True, max_length=self.args.max_length)
        data = Dataset.from_dict({**enc, "labels": [r[1] for r in rows]})
        return train(model, data, DataCollatorWithPadding(self.tokenizer), self.args, seed, epochs, learning_rate,
                     teacher, primal_learning_rate)

    def stock(self, seed: int):
        from transformers import AutoModelForSequenceClassification

        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(self.path, num_labels=len(bbc_news.TOPICS) - 1)
        return self._train(model, seed, self.args.epochs, self.args.learning_rate)

    def kep(self, stock, seed: int, eta_kl: float):
        from hf_primal.tools.selection import swap_to_primal

        torch.manual_seed(seed)
        student = copy.deepcopy(stock)
        swap_to_primal(student, kep_spec(self.args, eta_kl))
        # The new layer's variational parameters start far from where the data puts them (standard normal); at the
        # rest of the network's 1e-4 they barely move in one epoch (--kep-primal-learning-rate, docs/benchmarks.md).
        return self._train(student.train(), seed, self.args.kep_epochs, self.args.kep_learning_rate, teacher=stock,
                           primal_learning_rate=self.args.kep_primal_learning_rate)


class DigitsTask:
    """scikit-learn's 8x8 digits (1,797 images; BSD licence), a small ViT trained from scratch on nine digits, the
    tenth (``--ood-digit``) out of distribution; KEP-SVGP as the last layer of the same ViT, also from scratch."""

    name = "digits_vit"

    def __init__(self, args: argparse.Namespace) -> None:
        from sklearn.datasets import load_digits

        self.args = args
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
        labels = torch.tensor(digits.target)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        cut = [int(f * len(order)) for f in (0.6, 0.75)]
        parts = {"train": order[:cut[0]], "validation": order[cut[0]:cut[1]], "test": order[cut[1]:]}
        keep = [d for d in range(10) if d != args.ood_digit]
        relabel = torch.full((10,), -1, dtype=torch.long)
        relabel[keep] = torch.arange(9)
        limit = 48 if args.quick else 10**9
        self.rows = {split: [(images[i], int(relabel[labels[i]])) for i in idx if labels[i] != args.ood_digit][:limit]
                     for split, idx in parts.items()}
        self.rows["ood"] = [(images[i], 0) for i in parts["test"] if labels[i] == args.ood_digit][:limit]

    def batches(self, split: str, size: int = 64) -> list[dict]:
        rows = self.rows[split]
        return [{"pixel_values": torch.stack([r[0] for r in rows[i:i + size]])} for i in range(0, len(rows), size)]

    def _model(self, seed: int, spec=None):
        from transformers import ViTConfig, ViTForImageClassification

        torch.manual_seed(seed)
        config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128, num_labels=9, hidden_dropout_prob=0.1,
                           **({"primal_attention": spec.to_dict()} if spec is not None else {}))
        return ViTForImageClassification(config)

    def _train(self, model, seed):
        from datasets import Dataset

        rows = self.rows["train"]
        data = Dataset.from_dict({"pixel_values": [r[0].tolist() for r in rows], "labels": [r[1] for r in rows]})

        def collate(items):
            return {"pixel_values": torch.tensor([x["pixel_values"] for x in items]),
                    "labels": torch.tensor([x["labels"] for x in items])}

        epochs = 2.0 if self.args.quick else self.args.digits_epochs
        return train(model, data, collate, self.args, seed, epochs, self.args.digits_learning_rate)

    def stock(self, seed: int):
        return self._train(self._model(seed), seed)

    def kep(self, stock, seed: int, eta_kl: float):
        return self._train(self._model(seed, kep_spec(self.args, eta_kl)), seed)


def kep_spec(args: argparse.Namespace, eta_kl: float):
    from hf_primal import PrimalAttentionConfig

    return PrimalAttentionConfig(layers=[-1], low_rank=args.low_rank, rank_multi=10, variant="kep_svgp",
                                 eta_kl=eta_kl, covariance=args.covariance)
