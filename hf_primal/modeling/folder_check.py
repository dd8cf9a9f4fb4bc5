"""Refuse a saved folder whose config.json would load its primal checkpoint as softmax attention.

A config.json that lost its ``primal_attention`` entry (a hand edit, a tool that rewrites configs) would otherwise
load as a stock model: the primal tensors reported unexpected, the value projections freshly initialised, a corrupted
model that only a load report shows. Both loading paths call `check_saved_config`: the plugin's config hook and the
shareable config classes (remote code), so the refusal holds with and without hf_primal installed.

Imports only the standard library (a safetensors file starts with an 8-byte little-endian header length and a JSON
header naming its tensors): copied as remote code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any, Optional

from .config import VERSION, PrimalAttentionConfig

# The parameters every primal core adds (hf_primal.modeling.primal.PrimalCore), as they appear in a state dict.
_PRIMAL_TENSOR = re.compile(r"(^|\.)primal\.(We|Wr|Lambda|theta|m_u|tril|log_diag|head_map\.weight|head_map\.bias)$")


def primal_tensor_names(folder: str) -> list[str]:
    """Names of the primal-core tensors in a local folder's safetensors weights (single file or sharded index);
    [] when the folder holds none or no safetensors weights."""
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    names: list[str] = []
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            names = list(json.load(handle).get("weight_map", {}))
    elif os.path.isfile(single):
        try:
            with open(single, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                names = [n for n in json.loads(handle.read(size)) if n != "__metadata__"]
        except (OSError, ValueError):  # unreadable or truncated: safetensors itself reports that when loading
            return []
    return sorted(name for name in names if _PRIMAL_TENSOR.search(name))


def _layers_hint(names: list[str]) -> str:
    layers = sorted({int(m.group(1)) for m in (re.search(r"\.(\d+)\.(?:.*\.)?primal\.We$", n) for n in names) if m})
    return f'{{"layers": {layers}, ...}}' if layers else "{...}"


def check_saved_config(
    config_dict: Mapping[str, Any], source: Any, kwargs: Optional[Mapping[str, Any]] = None
) -> None:
    """Raise ValueError when `config_dict` (read from `source`) has no ``primal_attention`` entry although the folder
    is a primal one: its model_type is ``primal_<arch>`` or its weights hold primal tensors. Passing
    ``primal_attention=...`` to ``from_pretrained`` (in `kwargs`) supplies the entry and is accepted."""
    if (kwargs or {}).get("primal_attention") is not None:
        return
    if config_dict.get("primal_attention") is not None:
        _check_version(config_dict, source)
        return
    folder = str(source) if isinstance(source, (str, os.PathLike)) else None
    if folder is not None and (kwargs or {}).get("subfolder"):
        folder = os.path.join(folder, kwargs["subfolder"])
    names = primal_tensor_names(folder) if folder is not None and os.path.isdir(folder) else []
    model_type = str(config_dict.get("model_type", ""))
    if not names and not model_type.startswith("primal_"):
        return
    found = (f"its weights hold {len(names)} primal-attention tensors ({', '.join(names[:3])}"
             f"{', ...' if len(names) > 3 else ''})" if names else f"its model_type is {model_type!r}")
    raise ValueError(
        f"{folder or source}: config.json has no 'primal_attention' entry, but {found}. Loading it would build "
        f"softmax attention, drop the primal tensors and initialise the value projections afresh. Fix: put back the "
        f"'primal_attention' entry the checkpoint was saved with (for example \"primal_attention\": "
        f"{_layers_hint(names)} in config.json), or pass primal_attention={{...}} to from_pretrained."
    )


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for part in str(text).split("."):
        digits = re.match(r"\d+", part)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts)


def _check_version(config_dict: Mapping[str, Any], source: Any) -> None:
    """A folder written by a newer hf_primal whose primal_attention this version cannot read is refused naming both
    versions (instead of only the unknown field or rule)."""
    written = config_dict.get("hf_primal_version")
    if not written or _version_tuple(written) <= _version_tuple(VERSION):
        return
    try:
        PrimalAttentionConfig.from_dict(config_dict["primal_attention"])
    except ValueError as error:
        raise ValueError(
            f"{source}: saved by hf_primal {written}, newer than this hf_primal {VERSION}, and its primal_attention "
            f"uses what this version does not know: {error} Fix: upgrade hf_primal (pip install -U hf_primal), or "
            f"load the folder with trust_remote_code=True without importing hf_primal, which runs the code it was "
            f"saved with."
        ) from None
