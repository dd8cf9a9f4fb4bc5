"""Calibration data for conversion: the forms `convert` and `layer_sensitivity` accept, turned into model batches.

Plain torch (datasets is imported only to recognise a `datasets.Dataset`); no transformers import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch

# Every HELDOUT_EVERY-th calibration batch, counting from the last, is held out: never trained on, used to measure
# the error and to choose the kept step.
HELDOUT_EVERY = 5
# The columns of a `datasets.Dataset` that are model inputs (everything else, labels included, is left out).
MODEL_INPUT_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "pixel_values")


def heldout_indices(num_batches: int, every: int = HELDOUT_EVERY) -> set[int]:
    """Positions of the held-out batches among `num_batches` (every `every`-th, counting from the last)."""
    return set(range(num_batches - 1, -1, -every))


def input_columns(column_names: list[str], what: str) -> list[str]:
    """The model-input columns among a dataset's `column_names`; a ValueError starting with `what` if there are none."""
    columns = [c for c in MODEL_INPUT_COLUMNS if c in column_names]
    if not columns:
        raise ValueError(
            f"{what} has columns {column_names}; expected tokenised model inputs "
            "(input_ids[, attention_mask]) or pixel_values."
        )
    return columns


def as_batches(data: Any, batch_size: int) -> Iterable[Mapping[str, torch.Tensor]]:
    """Accept a DataLoader / iterable of dict batches, or a `datasets.Dataset` of model inputs."""
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        Dataset = ()
    if isinstance(data, Dataset):
        data = data.with_format("torch", columns=input_columns(data.column_names, "calibration_data: the dataset"))
        return torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=pad_collate)
    if isinstance(data, Mapping):
        return [data]
    return data


def text_batches(
    tokenizer: Any, texts: list[str], batch_size: int = 32, max_length: int = 128
) -> list[dict[str, torch.Tensor]]:
    """Tokenised batches of `texts` for `convert`, grouped by length so that little compute goes to padding.

    Sorting by length before batching makes distillation on short sentences about twice as fast as random batches
    padded to their longest member; the batch order is still mixed during training.
    """
    if not texts:
        raise ValueError("text_batches: no texts given.")
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    lengths = [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    return [
        dict(tokenizer([texts[i] for i in order[start:start + batch_size]], padding=True, truncation=True,
                       max_length=max_length, return_tensors="pt"))
        for start in range(0, len(order), batch_size)
    ]


def pad_collate(rows: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for key in rows[0]:
        values = [torch.as_tensor(r[key]) for r in rows]
        if values[0].dim() == 1 and len({v.shape[0] for v in values}) > 1:
            out[key] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=0)
        else:
            out[key] = torch.stack(values)
    if "input_ids" in out and "attention_mask" not in out:
        lengths = torch.tensor([torch.as_tensor(r["input_ids"]).shape[0] for r in rows])
        out["attention_mask"] = (torch.arange(out["input_ids"].shape[1])[None] < lengths[:, None]).long()
    return out


def collect_batches(data: Any, batch_size: int, max_batches: Optional[int]) -> list[dict[str, torch.Tensor]]:
    batches = []
    for n, batch in enumerate(as_batches(data, batch_size)):
        if max_batches is not None and n >= max_batches:
            break
        batches.append({k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"})
    if len(batches) < 2:
        raise ValueError(
            f"calibration_data produced {len(batches)} batch(es); distillation needs at least 2 (one is held "
            "out to choose the kept step)."
        )
    return batches
