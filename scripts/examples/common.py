"""Pieces shared by the `train_*.py` scripts: model/primal flags, their validation, model and tokenizer loading.

Not a script itself; the training scripts import it from their own folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from transformers import AutoConfig, AutoTokenizer, HfArgumentParser, PreTrainedConfig, PreTrainedModel

# Importing hf_primal installs the hooks that make `primal_attention` a config option of every registered architecture.
from hf_primal import PrimalAttentionConfig
from hf_primal.modeling.config import parse_layers

LAYERS_HELP = (
    'which attention layers run Primal-Attention: "all", or comma-separated indices such as "-1" or "0,3" '
    '(write --primal_layers=-2,-1 when a list starts with a minus sign)'
)

UNSET = "unset means the loaded model's setting, else"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults like HfArgumentParser does, and the script docstring's example command unwrapped."""


@dataclass
class ModelArguments:
    """Where the model comes from, and which of its layers are made primal."""

    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "folder of a saved model to fine-tune (its weights are loaded)"}
    )
    config_name: Optional[str] = field(
        default=None,
        metadata={"help": "config.json file or folder; without --model_name_or_path the model is built from scratch"},
    )
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "tokenizer folder (default: --model_name_or_path)"}
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={"help": "re-initialise checkpoint tensors whose shapes differ (e.g. another label count)"},
    )
    # None = not given: keep what a saved primal model's config.json says, else PrimalAttentionConfig's default,
    # so that evaluating or resuming a primal checkpoint needs no flags repeated.
    primal_layers: Optional[str] = field(default=None, metadata={"help": LAYERS_HELP + f"; {UNSET} -1"})
    low_rank: Optional[int] = field(
        default=None, metadata={"help": f"s, KSVD projection directions per head; {UNSET} 30"}
    )
    rank_multi: Optional[int] = field(
        default=None, metadata={"help": f"m, encoders sample min(N_max, s*m) tokens; {UNSET} 10"}
    )
    eta: Optional[float] = field(default=None, metadata={"help": f"weight of the KSVD loss; {UNSET} 0.1"})
    ksvd_reduction: Optional[str] = field(default=None, metadata={"help": f'"sequence" or "batch"; {UNSET} "sequence"'})


def parse_primal_layers(value: str) -> Any:
    """`hf_primal.modeling.config.parse_layers` (the CLI's parser too), with errors naming ``--primal_layers``."""
    try:
        return parse_layers(value)
    except ValueError as error:
        raise ValueError(f"--primal_{error}") from None


def primal_config(args: ModelArguments, saved: Optional[Mapping[str, Any]] = None) -> PrimalAttentionConfig:
    """The `PrimalAttentionConfig` the flags describe, on top of `saved` (a loaded config's settings) if any.

    A ValueError names the offending flag.
    """
    values = dict(saved) if saved else {}
    if args.primal_layers is not None:
        values["layers"] = parse_primal_layers(args.primal_layers)
    given = {
        "low_rank": args.low_rank, "rank_multi": args.rank_multi, "eta": args.eta,
        "ksvd_reduction": args.ksvd_reduction,
    }
    values.update({k: v for k, v in given.items() if v is not None})
    try:
        return PrimalAttentionConfig.from_dict(values)
    except ValueError as err:
        # The config speaks of its own fields (``PrimalAttentionConfig.low_rank``); users typed flags.
        field_name = next((f for f in ("layers", *given) if f"Config.{f}=" in str(err)), None)
        flag = {"layers": "--primal_layers", None: "primal attention flags"}.get(field_name, f"--{field_name}")
        raise ValueError(f"{flag}: {err}") from None


def parse_args(
    dataclass_types: Sequence[type], argv: Optional[Sequence[str]], doc: Optional[str] = None
) -> tuple[Any, ...]:
    """Parse `argv` into the dataclasses (a single ``.json`` argument is read as a file, as in HF examples).

    Bad primal flags end the program like any other bad flag: usage, the message, exit status 2.
    """
    parser = HfArgumentParser(dataclass_types, description=doc, formatter_class=_HelpFormatter)
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        parsed = parser.parse_json_file(os.path.abspath(argv[0]))
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    model_args = next(a for a in parsed if isinstance(a, ModelArguments))
    if model_args.model_name_or_path is None and model_args.config_name is None:
        parser.error("give --model_name_or_path (a saved model) or --config_name (to train from scratch).")
    try:
        primal_config(model_args)
    except ValueError as err:
        parser.error(str(err))
    return tuple(parsed)


def load_config(args: ModelArguments, **overrides: Any) -> PreTrainedConfig:
    """The model config with primal attention requested as the flags say (plus task-specific `overrides`)."""
    config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path, **overrides)
    config.primal_attention = primal_config(args, config.primal_attention).to_dict()
    return config


def load_model(auto_class: Any, args: ModelArguments, config: PreTrainedConfig) -> PreTrainedModel:
    """Fine-tune `--model_name_or_path` when given, else build from `config` with fresh weights."""
    if args.model_name_or_path:
        return auto_class.from_pretrained(
            args.model_name_or_path, config=config, ignore_mismatched_sizes=args.ignore_mismatched_sizes
        )
    return auto_class.from_config(config)


def adopt_tokenizer(config: PreTrainedConfig, tokenizer: Any) -> None:
    """Give a from-scratch text model the tokenizer's vocabulary size and special-token ids.

    Any tokenizer folder can then serve any architecture (MiniLM's WordPiece for GPT-2: the stock GPT-2
    bos/eos id 50256 would not even exist in that vocabulary).
    """
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    config.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id


def load_tokenizer(args: ModelArguments):
    """AutoTokenizer from ``--tokenizer_name`` or the model folder (reads tokenizer.json, so words stay words)."""
    source = args.tokenizer_name or args.model_name_or_path
    if source is None:
        raise ValueError("a model built from --config_name needs --tokenizer_name (a tokenizer folder).")
    return AutoTokenizer.from_pretrained(source)


def data_files(train_file: Optional[str], validation_file: Optional[str]) -> tuple[str, dict[str, str]]:
    """`datasets` builder name (from the file extension) and its ``data_files`` mapping."""
    files = {k: v for k, v in (("train", train_file), ("validation", validation_file)) if v}
    if not files:
        raise ValueError("give --train_file and/or --validation_file.")
    extensions = {os.path.splitext(path)[1].lower().lstrip(".") for path in files.values()}
    if len(extensions) != 1:
        raise ValueError(f"--train_file and --validation_file must have the same extension; got {sorted(extensions)}.")
    extension = extensions.pop()
    builders = {"csv": "csv", "tsv": "csv", "json": "json", "jsonl": "json", "txt": "text", "text": "text"}
    builder = builders.get(extension)
    if builder is None:
        raise ValueError(f"unsupported data file extension {extension!r}; use .csv, .tsv, .json, .jsonl or .txt.")
    return builder, files


def phases(training_args: Any) -> tuple[bool, bool]:
    """(train, evaluate): ``--do_train`` / ``--do_eval`` select phases; with neither given, both run."""
    if not training_args.do_train and not training_args.do_eval:
        return True, True
    return bool(training_args.do_train), bool(training_args.do_eval)


def train_and_evaluate(
    trainer: Any,
    model_args: ModelArguments,
    do_train: bool,
    do_eval: bool,
    task: str,
    add_eval_metrics: Optional[Callable[[dict[str, float]], None]] = None,
) -> dict[str, float]:
    """Train, save the model and state, evaluate, save/print the metrics, push if asked; returns the metrics.

    Writes ``train_results.json``, ``eval_results.json`` and ``all_results.json`` (`Trainer.save_metrics`) and
    prints one ``final metrics: {...}`` JSON line, easy to grep from logs.
    """
    metrics: dict[str, float] = {}
    if do_train:
        if trainer.train_dataset is None:
            raise ValueError("training needs training data (--train_file / --train_dir / --dataset).")
        result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
        trainer.save_model()
        trainer.save_state()
        train_metrics = {**result.metrics, "train_samples": len(trainer.train_dataset)}
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        metrics.update(train_metrics)
    if do_eval:
        if trainer.eval_dataset is None:
            raise ValueError("evaluation needs evaluation data (--validation_file / --validation_dir / --dataset).")
        eval_metrics = {**trainer.evaluate(), "eval_samples": len(trainer.eval_dataset)}
        if add_eval_metrics is not None:
            add_eval_metrics(eval_metrics)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    if trainer.args.push_to_hub:
        trainer.push_to_hub(finetuned_from=model_args.model_name_or_path, tasks=task)
    if trainer.is_world_process_zero():
        # json would write inf/nan as bare Infinity/NaN, which strict JSON readers reject.
        printable = {k: v if not isinstance(v, float) or math.isfinite(v) else str(v) for k, v in metrics.items()}
        print("final metrics: " + json.dumps(printable, sort_keys=True))
    return metrics


def accuracy_metrics() -> Callable[[Any], dict[str, float]]:
    """`compute_metrics` for a classifier: accuracy of the arg-max class (`evaluate`'s metric, offline)."""
    import numpy as np

    from hf_primal.tools.metrics import load_metric

    accuracy = load_metric("accuracy")

    def compute_metrics(prediction: Any) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return accuracy.compute(predictions=np.argmax(logits, axis=-1), references=prediction.label_ids)

    return compute_metrics
