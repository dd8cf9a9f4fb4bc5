"""The README.md written next to a shared primal checkpoint: what was converted, with what settings, how to load it.

Imports only the flat module `config`: copied next to shared checkpoints as remote code.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .architecture import primal_layers
from .config import PrimalAttentionConfig


def _card_auto_class(model: Any) -> str:
    """The Auto class that loads `model`'s own head, read from the auto_map (which lists every head)."""
    auto_map = getattr(model.config, "auto_map", None) or {}
    name = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    matches = [k for k, v in auto_map.items() if k != "AutoConfig" and str(v).rsplit(".", 1)[-1] == name]
    specific = [k for k in matches if k not in ("AutoModel", "AutoModelForPreTraining", "AutoModelForTextEncoding")]
    return (specific or matches or ["AutoModel"])[0]


def _hub_id(name: str) -> Optional[str]:
    """`name` if it reads as a Hub repository id and is not a local folder, else None (never show local paths)."""
    if not name or os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name):
        return None
    parts = name.split("/")
    return name if len(parts) <= 2 and all(part and part[0].isalnum() for part in parts) else None


def _front_matter(model: Any, base: Optional[str], tags: Optional[list[str]]) -> list[str]:
    """The YAML header: library, base model and tags (the two hf_primal tags first, no duplicates)."""
    lines = ["---", "library_name: transformers"]
    if base:
        lines.append(f"base_model: {base}")
    extra = [t for t in [*(getattr(model, "model_tags", None) or []), *(tags or [])]
             if t not in ("primal-attention", "hf_primal")]
    return lines + ["tags:", "- primal-attention", "- hf_primal", *[f"- {tag}" for tag in dict.fromkeys(extra)], "---"]


def _summary(model: Any, base: Optional[str], spec: PrimalAttentionConfig) -> list[str]:
    """Title, one-line description, base model, primal layers and their settings."""
    layers = primal_layers(model)
    return [
        "",
        f"# {type(model).__name__} (Primal-Attention)",
        "",
        "Self-attention in the layers below runs Primal-Attention (Chen et al., NeurIPS 2023: asymmetric kernel SVD in",
        "the primal), converted with hf_primal.",
        "",
        f"- base model: `{base}`" if base else "- base model: a local checkpoint",
        f"- primal layers ({len(layers)}): " + ", ".join(f"`{n}`" for n in layers),
        f"- low_rank s = {spec.low_rank}, rank_multi m = {spec.rank_multi}, eta = {spec.eta}, "
        f"KSVD reduction = {spec.ksvd_reduction}",
    ]


def _distillation_lines(distilled: dict[str, Any]) -> list[str]:
    """The conversion report's distillation figures: loss, cosine, kept step, neighbour overlap."""
    lines = [f"- held-out distillation loss: {distilled['loss_before']:.4f} -> {distilled['loss_after']:.4f}"]
    if distilled.get("cosine_after") is not None:
        lines.append("- held-out mean-pooled embedding cosine vs the original: "
                     f"{distilled['cosine_before']:.4f} -> {distilled['cosine_after']:.4f}")
    lines.append(f"- kept step {distilled['best_step']} of {distilled['steps']} ({distilled['seconds']:.0f} s)")
    overlap = distilled.get("neighbour_overlap")
    if overlap:
        lines.append(f"- held-out {overlap['k']}-nearest-neighbour overlap with the original's embeddings: "
                     f"{overlap['overlap']:.3f} ({overlap['queries']} queries, {overlap['index']} indexed)")
    return lines


def _layer_selection_lines(selection: dict[str, Any]) -> list[str]:
    """The "Layer selection" section: the measured ranking and each candidate layer's cost."""
    lines = ["", "### Layer selection", "",
             f"Layers ranked by measured conversion cost, cheapest first: {selection['ranking']} (each layer "
             f"alone made primal and distilled for {selection['steps']} steps; held-out distillation loss "
             f"below). Converted: {selection['chosen']}.", "",
             "| layer | held-out loss after the swap | after distillation |", "|---|---|---|"]
    return lines + [f"| `{c['layer']}` | {c['loss_before']:.4f} | {c['loss_after']:.4f} |" for c in selection["costs"]]


def _conversion_section(report: dict[str, Any]) -> list[str]:
    """The "Conversion" section written from a non-empty `primal_conversion_report`."""
    lines = ["", "## Conversion", "", f"- method: {report.get('method', 'none')}",
             f"- calibration data: {report.get('calibration', 'none')}"]
    distilled = report.get("distillation")
    if distilled:
        lines += _distillation_lines(distilled)
    per_layer = report.get("layers", [])
    if per_layer:
        lines += ["", "| layer | relative output error before | after |", "|---|---|---|"]
        lines += [f"| `{r['layer']}` | {r['error_before']:.4f} | {r['error_after']:.4f} |" for r in per_layer]
    selection = report.get("layer_selection")
    if selection:
        lines += _layer_selection_lines(selection)
    if len(report.get("progressive") or []) > 1:  # one stage is a plain conversion
        stages = " -> ".join(" ".join(map(str, stage)) for stage in report["progressive"])
        lines.append(f"- converted progressively, layers in this order, trained after each stage: {stages}")
    if report.get("verdict"):
        lines += ["", f"Verdict: {report['verdict']}."]
    training = report.get("training")
    if training:
        kept = (f"kept step {training['best_step']} of {training['steps_run']} (best eval {training['metric']}: "
                f"{training['best_value']:.4f})" if training.get("best_step") else
                f"{training['steps_run']} steps, the last one kept")
        lines.append(f"- training with PrimalTrainer and its teacher: {kept}")
    for key, value in report.get("metrics", {}).items():
        lines.append(f"- {key}: {value}")
    return lines


def _loading_section(auto: str) -> list[str]:
    """The "Loading" section: with remote code through `auto`, or with hf_primal installed."""
    return [
        "",
        "## Loading",
        "",
        "Without hf_primal (the modeling code ships in this repository):",
        "",
        "```python",
        "from transformers import " + auto,
        f"model = {auto}.from_pretrained(\"<this folder or repo id>\", trust_remote_code=True)",
        "```",
        "",
        "Every Auto class listed in the `auto_map` of config.json loads it the same way (a head the checkpoint does",
        "not have is initialised as usual), and so do pipelines: `pipeline(task, model=..., trust_remote_code=True)`.",
        "",
        "With hf_primal installed, `import hf_primal` first and `trust_remote_code` is not needed (also not for",
        "`AutoTokenizer`, which reads config.json and would otherwise ask whether to run the custom code).",
        "Loading through the Auto classes with neither fails on the unknown model type instead of silently",
        "building a stock model. Do not load it with a stock class such as `BertModel` directly: transformers",
        "would only warn about the model type and leave the primal layers without their weights.",
        "",
    ]


def model_card(model: Any, tags: Optional[list[str]] = None) -> str:
    """README.md for a shared primal checkpoint: what was converted, with what settings, and how to load it.

    `tags` (and the model's own ``model_tags``, as transformers' ``add_model_tags`` sets them) join the card's tags.
    """
    spec = PrimalAttentionConfig.coerce(model.config.primal_attention)
    report = getattr(model, "primal_conversion_report", None) or {}
    base = report.get("base_model") or _hub_id(getattr(model.config, "name_or_path", "") or "")
    lines = _front_matter(model, base, tags) + _summary(model, base, spec)
    if report:
        lines += _conversion_section(report)
    lines += _loading_section(_card_auto_class(model))
    return "\n".join(lines)
