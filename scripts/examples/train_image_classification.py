#!/usr/bin/env python
"""Fine-tune (or train from scratch) a ViT image classifier with Primal-Attention layers.

Data: ``--train_dir`` (and optionally ``--validation_dir``), image folders with one sub-folder per class read
by the `datasets` "imagefolder" builder, or ``--dataset digits``: scikit-learn's bundled 8x8 handwritten
digits, upsampled to the model's image size as 3-channel images. Without a validation folder,
``--validation_split`` of the training images is held out for evaluation.

When the model folder has no saved image processor, one is built from ``--image_size`` (default: the model
config's), ``--image_mean`` and ``--image_std``; it is saved with the model.

Example (a ViT built from scratch, every layer primal, on the digits)::

    echo '{"model_type": "vit", "image_size": 32, "patch_size": 4, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "intermediate_size": 128}' > vit.json
    HF_HUB_OFFLINE=1 python scripts/examples/train_image_classification.py --config_name vit.json --dataset digits \\
        --primal_layers all --low_rank 8 --rank_multi 4 --eta 0.05 \\
        --output_dir out/vit --num_train_epochs 5 --per_device_train_batch_size 64 --learning_rate 1e-3
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import common  # the examples' shared pieces, beside this file
import datasets
import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoModelForImageClassification,
    TrainingArguments,
    ViTImageProcessor,
    set_seed,
)

from hf_primal import PrimalTrainer

DATASETS = ("digits",)


@dataclass
class DataArguments:
    train_dir: Optional[str] = field(default=None, metadata={"help": "image folder: one sub-folder per class"})
    validation_dir: Optional[str] = field(default=None, metadata={"help": "image folder for evaluation"})
    dataset: Optional[str] = field(default=None, metadata={"help": f"a bundled dataset instead of folders: {DATASETS}"})
    validation_split: float = field(
        default=0.2, metadata={"help": "held-out fraction when there is no validation folder"}
    )
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "keep only the first N training images"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "keep only the first N evaluation images"})


@dataclass
class ImageArguments:
    image_size: Optional[int] = field(
        default=None, metadata={"help": "processor resize target (default: config.image_size)"}
    )
    image_mean: float = field(default=0.5, metadata={"help": "per-channel normalisation mean of a built processor"})
    image_std: float = field(default=0.5, metadata={"help": "per-channel normalisation std of a built processor"})


def digits_dataset() -> datasets.Dataset:
    """scikit-learn's 1797 8x8 digits as RGB PIL images (pixel values 0..16 stretched to 0..255)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    images = [Image.fromarray(p).convert("RGB") for p in pixels]
    labels = datasets.ClassLabel(names=[str(d) for d in range(10)])
    features = datasets.Features({"image": datasets.Image(), "label": labels})
    return datasets.Dataset.from_dict({"image": images, "label": digits.target.tolist()}, features=features)


def load_images(args: DataArguments, seed: int) -> datasets.DatasetDict:
    if args.dataset is not None and args.train_dir is not None:
        raise ValueError("give either --dataset or --train_dir, not both.")
    if args.dataset is not None:
        if args.dataset not in DATASETS:
            raise ValueError(
                f"--dataset {args.dataset!r} is not available; choose one of {list(DATASETS)} or use --train_dir."
            )
        full = digits_dataset()
        validation = None
    elif args.train_dir is not None:
        files = {"train": os.path.join(args.train_dir, "**")}
        if args.validation_dir is not None:
            files["validation"] = os.path.join(args.validation_dir, "**")
        loaded = datasets.load_dataset("imagefolder", data_files=files)
        full, validation = loaded["train"], loaded.get("validation")
    else:
        raise ValueError("give --train_dir (an image folder) or --dataset digits.")
    if validation is None:
        # Stratified so that a small held-out set still covers every class.
        split = full.train_test_split(test_size=args.validation_split, seed=seed, stratify_by_column="label")
        full, validation = split["train"], split["test"]
    return datasets.DatasetDict({"train": full, "validation": validation})


def image_processor(model_args: common.ModelArguments, image_args: ImageArguments, config: Any):
    """The processor saved with the model, else a ViTImageProcessor built from the flags."""
    source = model_args.model_name_or_path or model_args.config_name
    if source is not None and os.path.isfile(os.path.join(source, "preprocessor_config.json")):
        return AutoImageProcessor.from_pretrained(source)
    size = image_args.image_size or config.image_size
    return ViTImageProcessor(
        do_resize=True, size={"height": size, "width": size}, do_rescale=True, do_normalize=True,
        image_mean=[image_args.image_mean] * 3, image_std=[image_args.image_std] * 3,
    )


def collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
        "labels": torch.tensor([e["label"] for e in examples]),
    }


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    model_args, data_args, image_args, training_args = common.parse_args(
        (common.ModelArguments, DataArguments, ImageArguments, TrainingArguments), argv, __doc__
    )
    do_train, do_eval = common.phases(training_args)
    set_seed(training_args.seed)

    raw = load_images(data_args, training_args.seed)
    names = raw["train"].features["label"].names
    config = common.load_config(
        model_args, id2label={i: n for i, n in enumerate(names)}, label2id={n: i for i, n in enumerate(names)}
    )
    model = common.load_model(AutoModelForImageClassification, model_args, config)
    processor = image_processor(model_args, image_args, config)

    def transform(batch: dict[str, list[Any]]) -> dict[str, Any]:
        # Decoded lazily per batch: the pixel tensors of a real image folder would not fit in memory at once.
        pixels = processor([img.convert("RGB") for img in batch["image"]], return_tensors="pt")["pixel_values"]
        return {"pixel_values": list(pixels), "label": batch["label"]}

    train_dataset, eval_dataset = raw["train"], raw["validation"]
    if data_args.max_train_samples is not None:
        # Shuffled first: image folders list classes one after another, so the first N could be a single class.
        train_dataset = train_dataset.shuffle(seed=training_args.seed)
        train_dataset = train_dataset.select(range(min(data_args.max_train_samples, len(train_dataset))))
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(data_args.max_eval_samples, len(eval_dataset))))
    train_dataset, eval_dataset = train_dataset.with_transform(transform), eval_dataset.with_transform(transform)
    # Trainer would otherwise drop the "image" column (not a forward() argument) before the transform sees it.
    training_args.remove_unused_columns = False

    compute_metrics = common.accuracy_metrics()

    trainer = PrimalTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=processor, data_collator=collate, compute_metrics=compute_metrics,
    )

    return common.train_and_evaluate(trainer, model_args, do_train, do_eval, "image-classification")


if __name__ == "__main__":
    main()
