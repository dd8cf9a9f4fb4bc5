"""The causal-LM benchmark's summary table and plot, from its CSV files."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from .. import harness

SUMMARY, PLOT = "causal_lm_summary.csv", "causal_lm.png"


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[dict]) -> list[dict]:
    """Mean and std over seeds per (tokenization, variant); ratios to softmax and the share of the no-mixing ->
    softmax gap closed, both on validation perplexity, over the same seeds where both rows have them."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for row in runs:
        groups.setdefault((row["tokenization"], row["variant"]), []).append(row)
    for (tokenization, variant), rows in groups.items():
        seeds = sorted(str(r["seed"]) for r in rows)
        summary = {"tokenization": tokenization, "variant": variant, "seeds": " ".join(seeds)}
        for split in ("valid", "test"):
            mean, std = _mean_std([float(r[f"{split}_ppl"]) for r in rows])
            summary[f"{split}_ppl"], summary[f"{split}_ppl_std"] = mean, std
        if all(r.get("train_minutes") not in (None, "") for r in rows):
            summary["train_minutes"] = statistics.fmean(float(r["train_minutes"]) for r in rows)
        out.append(summary)
    for summary in out:
        peers = {v: [r for r in runs if r["tokenization"] == summary["tokenization"] and r["variant"] == v]
                 for v in ("softmax", "no-mixing")}
        mine = {str(r["seed"]): float(r["valid_ppl"]) for r in runs
                if r["tokenization"] == summary["tokenization"] and r["variant"] == summary["variant"]}
        soft = {str(r["seed"]): float(r["valid_ppl"]) for r in peers["softmax"]}
        floor = {str(r["seed"]): float(r["valid_ppl"]) for r in peers["no-mixing"]}
        shared = sorted(set(mine) & set(soft))
        if shared:
            summary["valid_vs_softmax"] = statistics.fmean(mine[s] / soft[s] for s in shared)
        closed = sorted(set(mine) & set(soft) & set(floor))
        if closed and all(floor[s] != soft[s] for s in closed):
            summary["gap_closed"] = statistics.fmean((floor[s] - mine[s]) / (floor[s] - soft[s]) for s in closed)
    return out


def plot(curves: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokenizations = sorted({c["tokenization"] for c in curves})
    if not tokenizations:
        return
    fig, axes = plt.subplots(1, len(tokenizations), figsize=(6 * len(tokenizations), 4), squeeze=False)
    for ax, tokenization in zip(axes[0], tokenizations):
        mine = [c for c in curves if c["tokenization"] == tokenization and str(c["seed"]) == "0"]
        for variant in dict.fromkeys(c["variant"] for c in mine):
            points = [c for c in mine if c["variant"] == variant]
            ax.plot([int(p["step"]) for p in points], [float(p["valid_ppl"]) for p in points], marker="o",
                    label=variant)
        ax.set_xlabel("training step")
        ax.set_ylabel("validation perplexity per token")
        ax.set_title(f"BBC News, {tokenization}, seed 0")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace) -> None:
    out = Path(args.out_dir)
    runs = harness.read_rows(out / "causal_lm.csv")
    summary = summarize(runs)
    harness.write_rows(out / SUMMARY, summary)
    plot(harness.read_rows(out / "causal_lm_curves.csv"), out / PLOT)
    for row in summary:
        print(f"{row['tokenization']:9s} {row['variant']:20s} seeds {row['seeds']:6s} validation "
              f"{row['valid_ppl']:.3f} ± {row['valid_ppl_std']:.3f}  test {row['test_ppl']:.3f}  "
              f"x softmax {harness.fmt(row.get('valid_vs_softmax'), 3)}  gap closed "
              f"{harness.fmt(row.get('gap_closed'), 2)}")
