"""scripts/benchmarks/causal_lm: its data pieces against hand-computed answers, its floor model, its summary
arithmetic, a --quick run end to end, and the README / docs figures against its results files."""

import csv
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from scripts.benchmarks.causal_lm import report
from scripts.benchmarks.causal_lm.corpus import bigram_perplexity, evaluation_windows, training_windows
from scripts.benchmarks.causal_lm.model import VARIANTS, Recipe, build

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "scripts" / "benchmarks" / "results"


def test_bigram_perplexity_is_the_add_one_counts():
    train = torch.tensor([0, 1, 0, 1, 2, 0, 1])
    held = torch.tensor([1, 2, 2, 0])
    pairs, firsts = Counter(zip(train[:-1].tolist(), train[1:].tolist())), Counter(train[:-1].tolist())
    logs = [math.log((pairs[(a, b)] + 1) / (firsts[a] + 3)) for a, b in zip(held[:-1].tolist(), held[1:].tolist())]
    assert bigram_perplexity(train, held, 3) == pytest.approx(math.exp(-sum(logs) / len(logs)))


def test_evaluation_windows_predict_each_token_once_and_training_windows_are_seeded():
    stream = torch.arange(103)
    windows = evaluation_windows(stream, 10, 100)
    assert windows.shape == (10, 11)
    assert torch.equal(windows[:, 1:].flatten(), stream[1:101])  # every target once, in order
    assert torch.equal(windows[:, :-1].flatten(), stream[:100])
    a, b = training_windows(stream, 10, 4, 3, 0), training_windows(stream, 10, 4, 3, 0)
    assert torch.equal(a, b) and a.shape == (3, 4, 11)
    assert torch.equal(a[..., 1:] - a[..., :-1], torch.ones(3, 4, 10, dtype=torch.long))  # consecutive tokens


def test_no_mixing_floor_sees_no_other_token_and_the_others_do():
    recipe = Recipe(n_layer=2, n_embd=32, n_head=2, n_positions=64, low_rank=4)
    ids = torch.randint(0, 50, (1, 12))
    changed = ids.clone()
    changed[0, 3] = (ids[0, 3] + 1) % 50
    for variant in ("no-mixing", "primal", "softmax"):
        model = build(variant, 51, recipe, 0).eval()
        with torch.no_grad():
            delta = (model(input_ids=ids).logits - model(input_ids=changed).logits).abs().amax(dim=-1)[0]
        assert float(delta[:3].max()) == 0.0  # causal: earlier positions never see token 3
        later = float(delta[4:].max())
        assert later == 0.0 if variant == "no-mixing" else later > 0.0, variant


def test_summary_ratios_and_gap_closed_by_seed():
    runs = [{"tokenization": "bytes", "variant": v, "seed": s, "valid_ppl": p, "test_ppl": p + 0.1,
             "train_minutes": 1.0} for v, s, p in [("softmax", 0, 8.0), ("softmax", 1, 10.0), ("no-mixing", 0, 12.0),
                                                   ("no-mixing", 1, 14.0), ("primal", 0, 9.0), ("primal", 1, 13.0)]]
    summary = {r["variant"]: r for r in report.summarize(runs)}
    assert summary["primal"]["valid_ppl"] == pytest.approx(11.0)
    assert summary["primal"]["valid_ppl_std"] == pytest.approx(math.sqrt(8.0))
    assert summary["primal"]["valid_vs_softmax"] == pytest.approx((9 / 8 + 13 / 10) / 2)
    assert summary["primal"]["gap_closed"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert summary["no-mixing"]["gap_closed"] == pytest.approx(0.0)


def test_quick_run_has_every_row_a_constant_primal_state_and_does_not_rerun(tmp_path):
    command = [sys.executable, "-m", "scripts.benchmarks.causal_lm", "--quick", "--workers", "1",
               "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = _rows(tmp_path / "causal_lm.csv")
    assert sorted(r["variant"] for r in runs) == sorted([*VARIANTS, "bigram"])
    assert all(1.0 < float(r["valid_ppl"]) < 1e4 and math.isfinite(float(r["test_ppl"])) for r in runs)
    decode = _rows(tmp_path / "causal_lm_decode.csv")
    sizes = {v: {int(r["state_bytes"]) for r in decode if r["variant"] == v} for v in ("primal", "softmax")}
    assert len(sizes["primal"]) == 1 and len(sizes["softmax"]) == 2  # constant vs growing with the context
    before = (tmp_path / "causal_lm.csv").read_bytes()
    again = subprocess.run(command[:-2] + ["--only", "train", "--out-dir", str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and (tmp_path / "causal_lm.csv").read_bytes() == before


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def headline_row(summary) -> str:
    """The README's causal-LM row, from causal_lm_summary.csv."""
    rows = {r["variant"]: r for r in summary if r["tokenization"] == "bytes"}

    def ppl(variant):
        return f"{float(rows[variant]['valid_ppl']):.2f}"

    seeds = len(rows["primal"]["seeds"].split())
    return (f"| next byte of BBC News articles, GPT-2 with 4 layers of width 128 trained from scratch "
            f"(1,200 steps; {seeds} seeds) | validation perplexity per byte: softmax {ppl('softmax')}, last layer "
            f"primal {ppl('primal-last')}, every layer primal {ppl('primal')} (with the paper's prefix mean "
            f"{ppl('primal-prefix_mean')}), no attention {ppl('no-mixing')}, bigram counts {ppl('bigram')} "
            f"| `causal_lm_summary.csv` |")


def state_sentence(decode) -> str:
    """The README's state sizes, from causal_lm_decode.csv: the primal state (the same at every context) and
    softmax's KV cache at the longest context."""
    primal = {int(r["state_bytes"]) for r in decode if r["variant"] == "primal"}
    longest = max(int(r["context"]) for r in decode)
    kv = next(int(r["state_bytes"]) for r in decode if r["variant"] == "softmax" and int(r["context"]) == longest)
    assert len(primal) == 1
    return (f"({primal.pop() / 1024:.0f} KiB for the 4-layer byte model\nat any context, against {kv / 2**20:.0f} MiB "
            f"of KV cache at {longest:,} tokens)")


def test_readme_causal_lm_row_is_that_of_the_results_file():
    summary = _rows(RESULTS / "causal_lm_summary.csv")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert headline_row(summary) in readme
    assert state_sentence(_rows(RESULTS / "causal_lm_decode.csv")) in readme


ORDER = ("softmax", "primal-last", "primal", "primal-prefix_mean", "no-mixing", "bigram")


def summary_table_rows(summary) -> list[str]:
    """docs/benchmarks.md's causal-LM table, from causal_lm_summary.csv (bytes)."""
    out = []
    rows = {r["variant"]: r for r in summary if r["tokenization"] == "bytes"}
    for variant in ORDER:
        r = rows[variant]
        ratio = f"{float(r['valid_vs_softmax']):.3f}" if r.get("valid_vs_softmax") and variant != "bigram" else "-"
        closed = f"{float(r['gap_closed']):.2f}" if r.get("gap_closed") and variant != "bigram" else "-"
        minutes = f"{float(r['train_minutes']):.1f}" if r.get("train_minutes") else "-"
        out.append(f"| {variant} | {r['seeds']} | {float(r['valid_ppl']):.3f} ± {float(r['valid_ppl_std']):.3f} | "
                   f"{float(r['test_ppl']):.3f} ± {float(r['test_ppl_std']):.3f} | {ratio} | {closed} | {minutes} |")
    return out


def decode_table_rows(decode) -> list[str]:
    """docs/benchmarks.md's decode table of the causal-LM rows, from causal_lm_decode.csv."""
    out = []
    for r in decode:
        out.append(f"| {r['variant']} | {r['context']} | {int(r['state_bytes']) / 1024:.1f} | "
                   f"{float(r['ms_per_token']):.2f} | {float(r['speedup_vs_softmax']):.2f}x |")
    return out


def test_docs_causal_lm_tables_are_those_of_the_results_files():
    docs = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for line in summary_table_rows(_rows(RESULTS / "causal_lm_summary.csv")):
        assert line in docs, line
    for line in decode_table_rows(_rows(RESULTS / "causal_lm_decode.csv")):
        assert line in docs, line
