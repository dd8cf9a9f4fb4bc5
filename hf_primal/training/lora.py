"""PEFT glue: LoRA on the q/k projections of a primal model, with the new primal parameters trained and saved."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..modeling.architecture import primal_layers
from ..models import find_architecture


def lora_config(model: nn.Module, r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0, **kwargs: Any):
    """A `peft.LoraConfig` for a primal model: LoRA on q/k, primal parameters in ``modules_to_save``.

    Example::

        model = get_peft_model(model, hf_primal.lora_config(model, task_type="SEQ_CLS"))

    Extra keyword arguments go to `LoraConfig` (e.g. ``task_type``, ``layers_to_transform``); entries you pass in
    ``modules_to_save`` are kept and ``"primal"`` is added, so the W_e/W_r/Lambda/head_map tensors are trainable
    and written to the adapter file (parameters unfrozen by hand would not be saved by PEFT).
    """
    from peft import LoraConfig

    architecture = find_architecture(model)
    if not primal_layers(model):
        raise ValueError(
            f"lora_config: {type(model).__name__} has no primal attention layer; "
            "build it with primal_attention=... first."
        )
    modules_to_save = list(kwargs.pop("modules_to_save", None) or [])
    if "primal" not in modules_to_save:
        modules_to_save.append("primal")
    # The modules that feed q and k (`Architecture.qk_names`). GPT-2 fuses q/k/v in one Conv1D; the primal forward
    # calls it whole when it is wrapped, so LoRA on it takes part.
    target_modules = kwargs.pop("target_modules", list(architecture.qk_names))
    if architecture.lora_fan_in_fan_out:
        kwargs.setdefault("fan_in_fan_out", True)
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        **kwargs,
    )
