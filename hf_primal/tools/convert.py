"""`convert()`: turn a loaded stock model (a registered architecture) into a primal model, then adapt it to the
original.

Primal-Attention has no value projection, so swapping a layer throws away what the softmax layer computed, and no
fit of the converted layer alone can bring it back (docs/method.md, "Capacity of one layer"). Two ways to adapt,
both measured on calibration batches held out from training:

* ``method="distill"`` (recommended): a frozen copy of the original model is the teacher, and every parameter of the
  converted model trains so that what the model serves (final hidden states and mean-pooled embeddings, or logits)
  matches the teacher; the rest of the network learns to work around the primal layers.
* ``method="transfer"``: each converted block (or attention module) alone is fitted to the original block's output
  on the same inputs (LoLCATs-style attention transfer); cheap, but bounded by the single-layer capacity.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from ..integration.hub import enable_remote_code
from ..modeling.architecture import Architecture, base_model, primal_attention_modules
from ..modeling.config import PrimalAttentionConfig
from ..modeling.layers import valid_tokens
from ..models import find_architecture, swap_to_primal
from ..training.calibration import as_batches, collect_batches, heldout_indices, text_batches
from ..training.distill import distill, frozen_copy
from .conversion_arguments import DEFAULT_LEARNING_RATE, METHODS, ConversionArguments
from .embedding_metrics import heldout_neighbour_overlap
from .selection import choose_layers

__all__ = ["METHODS", "ConversionArguments", "convert", "text_batches"]


def _relative_error(
    pred: torch.Tensor, target: torch.Tensor, valid: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    diff = (pred - target).float().square().sum(-1)
    ref = target.float().square().sum(-1)
    if valid is not None:
        diff, ref = diff * valid, ref * valid
    return diff.sum(), ref.sum()


# Below this relative improvement of the held-out error, a report says the adaptation achieved nothing meaningful.
MEANINGFUL_IMPROVEMENT = 0.02


def convert(model: nn.Module, config: Union[PrimalAttentionConfig, Mapping[str, Any], None] = None,
            calibration_data: Any = None, args: Optional[ConversionArguments] = None, *, progress: bool = True,
            **options: Any) -> nn.Module:
    """Make the layers chosen by `config` primal, in place, and return the model ready to save or share.

    Args:
        model: a loaded stock model of a registered architecture (hf_primal.SUPPORTED_ARCHITECTURES), any head.
        config: a `PrimalAttentionConfig` or dict (default: ``PrimalAttentionConfig()``, the last layer).
        calibration_data: unlabeled model inputs to adapt on: a DataLoader or iterable of dict batches, or a
            `datasets.Dataset` with tokenised ``input_ids`` (or ``pixel_values``). Every fifth batch is held out to
            measure the error and choose the kept step. None: the plain conversion (q/k and output weights reused,
            new primal parameters initialised as in the paper).
        args: a `ConversionArguments` (how layers are chosen and the model adapted; default: its defaults).
        progress: show tqdm progress bars.
        **options: any field of `ConversionArguments` as a keyword (``steps=150, layers="auto"``), applied on top of
            `args`.

    The report (held-out figures before and after, and for transfer the relative output error
    ||y - y_teacher|| / ||y_teacher|| of each layer) is printed and kept on ``model.primal_conversion_report``;
    `save_pretrained` puts it in the model card. When the held-out error improves by less than 2%, the report's
    ``"verdict"`` says so (and a warning is issued) with what to try next.
    """
    args = ConversionArguments.from_keywords(args, options)
    spec, architecture = _check_model(model, config)
    spec, sensitivity, calibration_data = _select_layers(model, spec, calibration_data, args, progress)
    reference = _capture_reference(model, architecture, spec, calibration_data, args, progress)
    swap_to_primal(model, spec)
    _adapt_and_report(model, reference, sensitivity, args, progress)
    return enable_remote_code(model)


def _check_model(model: nn.Module, config: Any) -> tuple[PrimalAttentionConfig, Architecture]:
    """Refuse a model convert cannot take, naming why; returns the config and the architecture."""
    spec = PrimalAttentionConfig.coerce(config if config is not None else PrimalAttentionConfig())
    architecture = find_architecture(model)
    if getattr(model.config, "primal_attention", None) is not None:
        raise ValueError(
            f"convert: {type(model).__name__} already has primal_attention={model.config.primal_attention}; "
            "convert a stock model (reload it without primal_attention)."
        )
    return spec, architecture


def _select_layers(
    model: nn.Module, spec: PrimalAttentionConfig, calibration_data: Any, args: ConversionArguments, progress: bool
) -> tuple[PrimalAttentionConfig, Any, Any]:
    """`choose_layers` for convert; returns the config with its layers, the sensitivity (or None) and the data."""
    if args.layers == "auto" and calibration_data is not None:  # measured and adapted on the same batches
        calibration_data = collect_batches(calibration_data, args.batch_size, args.max_batches)
    spec, sensitivity = choose_layers(
        model, spec, calibration_data, args.layers, args.num_primal_layers, steps=args.sensitivity_steps,
        learning_rate=args.adapt_learning_rate if args.method == "distill" else DEFAULT_LEARNING_RATE["distill"],
        primal_learning_rate=args.primal_learning_rate, pooled_weight=args.pooled_weight, progress=progress)
    return spec, sensitivity, calibration_data


@dataclass
class _Reference:
    """What adaptation compares the converted layers with, taken from the stock model before the swap."""

    selected: list[int]
    causal: bool
    fitted: dict[int, nn.Module]  # what transfer fits: whole blocks (target="layer") or attention modules
    names: dict[int, str]
    qk_names: tuple
    teacher: Optional[nn.Module] = None
    distill_batches: Optional[list] = None
    records: dict[int, dict] = field(default_factory=dict)


def _capture_reference(
    model: nn.Module, architecture: Architecture, spec: PrimalAttentionConfig, calibration_data: Any,
    args: ConversionArguments, progress: bool,
) -> _Reference:
    """The selected layers, and with calibration data a frozen copy of the model (distill) or its recorded outputs."""
    base, prefix = base_model(model)
    layer_list = architecture.list_layers(base)
    selected = spec.resolve_layers(len(layer_list))
    causal = architecture.causal(model.config)
    blocks = architecture.list_blocks(base)
    fitted = {i: (blocks[i] if args.target == "layer" else layer_list[i][1]) for i in selected}
    reference = _Reference(selected, causal, fitted, names={i: prefix + layer_list[i][0] for i in selected},
                           qk_names=architecture.qk_names if args.train_qk else ())
    if calibration_data is not None and args.method == "distill":
        reference.distill_batches = collect_batches(calibration_data, args.batch_size, args.max_batches)
        reference.teacher = frozen_copy(model)
    elif calibration_data is not None:
        reference.records = _record_teacher(model, [fitted[i] for i in selected], selected, calibration_data,
                                            args.batch_size, args.max_batches, progress, causal,
                                            architecture.attention_class)
    return reference


def _adapt_and_report(
    model: nn.Module, reference: _Reference, sensitivity: Any, args: ConversionArguments, progress: bool
) -> None:
    """Adapt the swapped `model` to `reference` by convert's method; report on ``model.primal_conversion_report``."""
    report: dict[str, Any] = {"calibration": "none", "method": "none", "layers": []}
    selected = reference.selected
    if sensitivity is not None:
        report["layer_selection"] = {**sensitivity.to_dict(), "chosen": selected}
        if progress:
            print(f"[hf_primal] layer sensitivity (cheapest first): {sensitivity.ranking}; converting {selected}")
    if reference.distill_batches is not None:
        report.update(_adapt_by_distillation(
            model, reference.teacher, reference.distill_batches, reference.causal, progress, steps=args.steps,
            learning_rate=args.adapt_learning_rate, primal_learning_rate=args.primal_learning_rate,
            target=args.distill_target, temperature=args.temperature, pooled_weight=args.pooled_weight))
    elif reference.records:
        report.update(_adapt_by_transfer(reference.fitted, reference.records, reference.names, args.steps,
                                         args.adapt_learning_rate, reference.qk_names, args.target, progress))
    if report.get("verdict", "").startswith("no meaningful"):
        # stacklevel 3: point at convert's caller, as when convert itself warned
        warnings.warn(f"hf_primal.convert: {report['verdict']}", stacklevel=3)
        if progress:
            print(f"[hf_primal] {report['verdict']}")
    model.primal_conversion_report = report


def _adapt_by_distillation(model, teacher, batches, causal, progress, *, steps, learning_rate, **kwargs) -> dict:
    """Distil the swapped `model` from `teacher`; the report entries (figures on the held-out batches)."""
    held_out = heldout_indices(len(batches))
    n_train = len(batches) - len(held_out)
    steps = steps if steps is not None else max(1, 4 * n_train)
    result = distill(model, teacher, batches, steps=steps, learning_rate=learning_rate, progress=progress,
                     causal=causal, **kwargs)
    overlap = heldout_neighbour_overlap(model, teacher, [b for i, b in enumerate(batches) if i in held_out], causal)
    if progress:
        cos = (f"; mean-pooled embedding cosine {result.cosine_before:.4f} -> {result.cosine_after:.4f}"
               if result.cosine_after is not None else "")
        print(f"[hf_primal] distillation: held-out loss {result.loss_before:.4f} -> {result.loss_after:.4f}{cos}")
        if overlap is not None:
            print(f"[hf_primal] held-out {overlap['k']}-nearest-neighbour overlap with the original: "
                  f"{overlap['overlap']:.3f} ({overlap['queries']} queries)")
    return {
        "method": "distill",
        "calibration": (f"{len(batches)} batches ({n_train} trained on, the rest held out), distillation from the "
                        f"original model, {steps} AdamW steps (lr {learning_rate}, primal lr "
                        f"{kwargs['primal_learning_rate']}), kept step {result.best_step}"),
        "distillation": {**result.to_dict(), "neighbour_overlap": overlap},
        "verdict": _verdict(result.loss_before, result.loss_after, "distillation"),
    }


def _adapt_by_transfer(fitted, records, names, steps, learning_rate, qk_names, target, progress) -> dict:
    """Fit each converted block (or attention module) alone to the stock one's recorded outputs; report entries."""
    steps = 300 if steps is None else steps
    rows = []
    for index, name in names.items():
        before, after = _fit_layer(fitted[index], records[index], steps, learning_rate, qk_names, progress, name)
        rows.append({"layer": name, "error_before": before, "error_after": after})
        if progress:
            print(f"[hf_primal] {name}: relative output error {before:.4f} -> {after:.4f}")
    first = next(iter(names))
    return {
        "method": "transfer",
        "calibration": (f"{len(records[first]['call'])} batches, target={target}, {steps} Adam steps per layer "
                        f"(lr {learning_rate}), errors on held-out batches"),
        "layers": rows,
        "verdict": _verdict(sum(r["error_before"] for r in rows), sum(r["error_after"] for r in rows),
                            "attention transfer"),
    }


def _verdict(before: float, after: float, what: str) -> str:
    gain = (before - after) / before if before > 0 else 0.0
    if gain >= MEANINGFUL_IMPROVEMENT:
        return f"{what} lowered the held-out error by {100 * gain:.1f}%"
    advice = (
        "try method='distill' (the rest of the network adapts around the primal layer; a single layer cannot match "
        "softmax attention alone), more or more varied calibration data, or more steps"
        if what != "distillation"
        else "try more (and more varied) unlabeled data, more steps, or a higher learning_rate"
    )
    return f"no meaningful improvement: {what} changed the held-out error by {100 * gain:.1f}% only; {advice}"


@torch.no_grad()
def _record_teacher(model, modules, indices, data, batch_size, max_batches, progress, causal,
                    attention_class) -> dict[int, dict]:
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
        attention = next(m for m in module.modules() if isinstance(m, attention_class))

        def mask_hook(mod, args, kwargs, output, index=index):
            records[index]["mask"].append(kwargs.get("attention_mask", args[2] if len(args) > 2 else None))
        handles.append(attention.register_forward_hook(mask_hook, with_kwargs=True))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        batches = as_batches(data, batch_size)
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


def _fit_parameters(
    module: nn.Module, attention: nn.Module, qk_names: tuple
) -> tuple[list[nn.Parameter], dict[nn.Parameter, bool]]:
    """The parameters `_fit_layer` trains, the only ones left requiring grad; and every parameter's previous flag."""
    if attention is module:
        params = list(module.primal.parameters())
        params += [p for name in qk_names for p in getattr(module, name).parameters()]
    else:  # a whole transformer block: everything in it adapts to the new attention
        params = [p for p in module.parameters() if p.dtype.is_floating_point]
    states = {p: p.requires_grad for p in module.parameters()}
    for p in module.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params, states


def _output_error(module: nn.Module, batches: list[tuple]) -> float:
    """Relative output error ||y - y_teacher|| / ||y_teacher|| of `module` over recorded (call, mask, y) batches."""
    num = den = 0.0
    with torch.no_grad():
        for call, mask, y in batches:
            valid = valid_tokens(mask, y.shape[0], y.shape[1])
            a, b = _relative_error(_call(module, call), y, valid)
            num, den = num + float(a), den + float(b)
    return (num / max(den, 1e-30)) ** 0.5


def _fit_layer(module, record, steps, learning_rate, qk_names, progress, name) -> tuple[float, float]:
    """Fit one primal layer to its teacher's outputs; returns the relative error before and after.

    Every fifth recorded batch, counting from the last, is held out (when there are at least two): the errors are
    measured on it and the parameters kept are those with the lowest held-out error, so a small calibration set
    cannot be over-fitted.
    """
    attention = primal_attention_modules(module)[0][1]
    params, states = _fit_parameters(module, attention, qk_names)
    was_training = module.training
    module.eval()  # no dropout while fitting

    batches = list(zip(record["call"], record["mask"], record["y"]))
    held_out = heldout_indices(len(batches)) if len(batches) >= 2 else set()
    held = [b for i, b in enumerate(batches) if i in held_out] or batches
    train = [b for i, b in enumerate(batches) if i not in held_out] or batches

    before = best = _output_error(module, held)
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
            current = _output_error(module, held)
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
