"""`convert()`: turn a loaded stock BERT / ViT / GPT-2 into a primal model, optionally by attention transfer.

Primal-Attention has no value projection, so swapping a layer throws away what the softmax layer computed. With
calibration data, each converted layer is fitted so that its output matches the original softmax layer's output
on the same hidden states (the original layer is the teacher; LoLCATs-style attention transfer), and the relative
output error is reported before and after.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from .config import PrimalAttentionConfig
from .hub import enable_remote_code
from .modeling_primal import apply_primal_attention, find_adapter, init_primal_core, valid_tokens


def _batches(data: Any, batch_size: int) -> Iterable[Mapping[str, torch.Tensor]]:
    """Accept a DataLoader / iterable of dict batches, or a `datasets.Dataset` of model inputs."""
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        Dataset = ()
    if isinstance(data, Dataset):
        columns = [c for c in ("input_ids", "attention_mask", "token_type_ids", "pixel_values") if c in data.column_names]
        if not columns:
            raise ValueError(
                f"calibration_data: the dataset has columns {data.column_names}; expected tokenised model inputs "
                "(input_ids[, attention_mask]) or pixel_values."
            )
        data = data.with_format("torch", columns=columns)
        return torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=_pad_collate)
    if isinstance(data, Mapping):
        return [data]
    return data


def _pad_collate(rows: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
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


def _relative_error(pred: torch.Tensor, target: torch.Tensor, valid: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    diff = (pred - target).float().square().sum(-1)
    ref = target.float().square().sum(-1)
    if valid is not None:
        diff, ref = diff * valid, ref * valid
    return diff.sum(), ref.sum()


def _blocks(base: nn.Module, layer_list) -> list[nn.Module]:
    """The transformer block that holds each attention module (BertLayer / ViTLayer / GPT2Block)."""
    modules = dict(base.named_modules())
    blocks = []
    for path, _ in layer_list:
        parts = path.split(".")
        # encoder.layer.3.attention.self -> encoder.layer.3 ; layers.3.attention -> layers.3 ; h.3.attn -> h.3
        index = next(i for i, part in enumerate(parts) if part.isdigit())
        blocks.append(modules[".".join(parts[: index + 1])])
    return blocks


def _qk_modules(module: nn.Module) -> list[nn.Module]:
    return [getattr(module, n) for n in ("query", "key", "q_proj", "k_proj", "c_attn") if hasattr(module, n)]


def convert(
    model: nn.Module,
    config: Union[PrimalAttentionConfig, Mapping[str, Any], None] = None,
    calibration_data: Any = None,
    *,
    steps: int = 300,
    learning_rate: float = 3e-3,
    batch_size: int = 8,
    max_batches: Optional[int] = None,
    train_qk: bool = True,
    target: str = "layer",
    progress: bool = True,
) -> nn.Module:
    """Make the layers chosen by `config` primal, in place, and return the model ready to save or share.

    Args:
        model: a loaded stock BERT / ViT / GPT-2 model (any head).
        config: a `PrimalAttentionConfig` or dict (default: ``PrimalAttentionConfig()``, the last layer).
        calibration_data: model inputs for attention transfer: a DataLoader or iterable of dict batches, or a
            `datasets.Dataset` with tokenised ``input_ids`` (or ``pixel_values``). None: the plain conversion
            (q/k and output weights reused, new primal parameters initialised as in the paper).
        steps: Adam steps of attention transfer per converted layer.
        learning_rate: Adam learning rate of attention transfer.
        batch_size: batch size when `calibration_data` is a `datasets.Dataset`.
        max_batches: use at most this many calibration batches.
        train_qk: with ``target="attention"``, also fit the q/k projections.
        target: ``"layer"`` (default) fits each converted transformer block (attention + MLP + norms) to the stock
            block's output; ``"attention"`` fits only the primal attention module (its parameters, plus q/k) to the
            softmax attention module's output. Primal-Attention cannot mimic softmax outputs exactly (it has no
            value projection), so letting the rest of the block adapt recovers much more of the original model.
        progress: show tqdm progress bars.

    The per-layer report (relative output error ||y - y_teacher|| / ||y_teacher|| over the valid tokens of held-out
    calibration batches, before and after fitting) is printed and kept on ``model.primal_conversion_report``; `save_pretrained` puts it in the
    model card.
    """
    spec = PrimalAttentionConfig.coerce(config if config is not None else PrimalAttentionConfig())
    adapter = find_adapter(model)
    if getattr(model.config, "primal_attention", None) is not None:
        raise ValueError(
            f"convert: {type(model).__name__} already has primal_attention={model.config.primal_attention}; "
            "convert a stock model (reload it without primal_attention)."
        )
    if target not in ("layer", "attention"):
        raise ValueError(f"convert: target={target!r} is not allowed: use 'layer' or 'attention'.")
    if steps < 0 or learning_rate <= 0:
        raise ValueError(f"convert: steps={steps} must be >= 0 and learning_rate={learning_rate} > 0.")
    base = getattr(model, model.base_model_prefix, model)
    layer_list = adapter.list_layers(base)
    selected = spec.resolve_layers(len(layer_list))
    prefix = f"{model.base_model_prefix}." if base is not model else ""

    blocks = _blocks(base, layer_list)
    fitted = {i: (blocks[i] if target == "layer" else layer_list[i][1]) for i in selected}
    records: dict[int, dict] = {}
    if calibration_data is not None:
        records = _record_teacher(model, [fitted[i] for i in selected], selected, calibration_data,
                                  batch_size, max_batches, progress, adapter.causal(model.config))

    model.config.primal_attention = spec.to_dict()
    ignore = apply_primal_attention(model)
    model._keys_to_ignore_on_load_unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) | set(ignore)
    std = getattr(model.config, "initializer_range", 0.02)
    for index in selected:
        core = layer_list[index][1].primal
        with torch.no_grad():
            core.reset_parameters()
            init_primal_core(core)
            core.head_map.weight.normal_(0.0, std)
            core.head_map.bias.zero_()

    report = {"calibration": "none", "layers": []}
    if records:
        report["calibration"] = (
            f"{len(records[selected[0]]['call'])} batches, target={target}, {steps} Adam steps per layer "
            f"(lr {learning_rate}), errors on held-out batches"
        )
        for index in selected:
            name = prefix + layer_list[index][0]
            before, after = _fit_layer(fitted[index], records[index], steps, learning_rate, train_qk, progress, name)
            report["layers"].append({"layer": name, "error_before": before, "error_after": after})
            if progress:
                print(f"[hf_primal] {name}: relative output error {before:.4f} -> {after:.4f}")
    model.primal_conversion_report = report
    return enable_remote_code(model)


@torch.no_grad()
def _record_teacher(model, modules, indices, data, batch_size, max_batches, progress, causal) -> dict[int, dict]:
    """Run the stock model once, keeping each selected module's call (args, kwargs), output and attention mask.

    `modules` are what gets fitted (attention modules or whole transformer blocks); the mask is read from the
    attention module inside, wherever the block passes it.
    """
    records = {i: {"call": [], "mask": [], "y": []} for i in indices}
    handles = []
    for index, module in zip(indices, modules):
        def hook(mod, args, kwargs, output, index=index):
            records[index]["call"].append((args, kwargs))
            records[index]["y"].append((output[0] if isinstance(output, tuple) else output).detach())
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
        attention = next(m for m in module.modules() if any(hasattr(m, n) for n in ("query", "q_proj", "c_attn")))

        def mask_hook(mod, args, kwargs, output, index=index):
            records[index]["mask"].append(kwargs.get("attention_mask", args[2] if len(args) > 2 else None))
        handles.append(attention.register_forward_hook(mask_hook, with_kwargs=True))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        batches = _batches(data, batch_size)
        for n, batch in enumerate(tqdm(batches, desc="calibration: teacher outputs", disable=not progress)):
            if max_batches is not None and n >= max_batches:
                break
            inputs = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}
            model(**inputs, **({"use_cache": False} if causal else {}))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not records[indices[0]]["call"]:
        raise ValueError("convert: calibration_data produced no batches.")
    return records


def _call(module, call) -> torch.Tensor:
    args, kwargs = call
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _fit_layer(module, record, steps, learning_rate, train_qk, progress, name) -> tuple[float, float]:
    """Fit one primal layer to its teacher's outputs; returns the relative error before and after.

    Every fifth recorded batch, counting from the last, is held out (when there are at least two): the errors are measured on it and the
    parameters kept are those with the lowest held-out error, so a small calibration set cannot be over-fitted.
    """
    attention = next(m for m in module.modules() if getattr(m, "_is_primal_attention", False))
    if attention is module:
        params = list(module.primal.parameters())
        if train_qk:
            params += [p for m in _qk_modules(module) for p in m.parameters()]
    else:  # a whole transformer block: everything in it adapts to the new attention
        params = [p for p in module.parameters() if p.dtype.is_floating_point]
    states = {p: p.requires_grad for p in module.parameters()}
    for p in module.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    was_training = module.training
    module.eval()  # no dropout while fitting

    batches = list(zip(record["call"], record["mask"], record["y"]))
    held_out = set(range(len(batches) - 1, -1, -5)) if len(batches) >= 2 else set()
    held = [b for i, b in enumerate(batches) if i in held_out] or batches
    train = [b for i, b in enumerate(batches) if i not in held_out] or batches

    def error(subset) -> float:
        num = den = 0.0
        with torch.no_grad():
            for call, mask, y in subset:
                valid = valid_tokens(mask, y.shape[0], y.shape[1])
                a, b = _relative_error(_call(module, call), y, valid)
                num, den = num + float(a), den + float(b)
        return (num / max(den, 1e-30)) ** 0.5

    before = best = error(held)
    best_state = {id(p): p.detach().clone() for p in params}
    optimizer = torch.optim.Adam([p for p in params if p.dtype.is_floating_point], lr=learning_rate)
    bar = tqdm(range(steps), desc=f"attention transfer {name}", disable=not progress)
    check_every = max(1, min(25, steps // 10 or 1))
    for step in bar:
        call, mask, y = train[step % len(train)]
        valid = valid_tokens(mask, y.shape[0], y.shape[1])
        num, den = _relative_error(_call(module, call), y, valid)
        loss = num / den.clamp(min=1e-30)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % check_every == 0 or step + 1 == steps:
            current = error(held)
            if current < best:
                best = current
                best_state = {id(p): p.detach().clone() for p in params}
            bar.set_postfix(train_rel_mse=f"{loss.item():.4f}", heldout_rel_err=f"{current:.4f}")
    with torch.no_grad():
        for p in params:
            p.copy_(best_state[id(p)])
    for p, flag in states.items():
        p.requires_grad_(flag)
    module.train(was_training)
    attention.ksvd_terms = None
    return before, best
