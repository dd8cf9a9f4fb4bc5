"""scripts/benchmarks/uncertainty.py: the quick run writes a row per method whose metrics are those of the metrics
module on hand-made predictions, a summary equal to the hand-computed means, and the temperature fit."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
from scripts.benchmarks import uncertainty as bench  # noqa: E402


def test_temperature_fit_recovers_the_temperature_that_made_the_labels():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4000, 4, generator=g, dtype=torch.float64)
    labels = torch.multinomial((logits / 2.5).softmax(-1), 1, generator=g).squeeze(1)  # labels drawn at T = 2.5
    assert bench.fit_temperature(logits, labels) == pytest.approx(2.5, rel=0.08)


def test_summary_is_the_mean_and_std_over_seeds_in_method_order():
    rows = [{"task": t, "seed": s, "method": m, **{k: v + s + 10 * (t == "b") for k, v in zip(bench.METRICS, range(8))}}
            for t in ("a", "b") for s in (0, 2) for m in ("kep_svgp", "msp")]
    summary = bench.summarise(rows)
    assert [(s["task"], s["method"]) for s in summary] == [("a", "msp"), ("a", "kep_svgp"), ("b", "msp"),
                                                             ("b", "kep_svgp")]
    assert summary[0]["ece_mean"] == pytest.approx(2.0) and summary[0]["ece_std"] == pytest.approx(2 ** 0.5)
    assert summary[2]["ece_mean"] == pytest.approx(12.0)


def test_quick_run_has_every_method_and_sane_metrics(tmp_path):
    result = subprocess.run([sys.executable, "-m", "scripts.benchmarks.uncertainty", "--quick",
                             "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / bench.CSV, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["task"], r["method"]) for r in rows] == [(t, m) for t in bench.TASKS_ORDER for m in bench.METHODS]
    for r in rows:
        assert 0 <= float(r["ece"]) <= 1 and 0 <= float(r["ood_auroc"]) <= 1 and float(r["nll"]) > 0, r
    by = {r["method"]: r for r in rows if r["task"] == "bbc_sentences"}
    assert float(by["msp"]["accuracy"]) == float(by["temperature"]["accuracy"])  # a temperature keeps the argmax
    assert float(by["temperature"]["temperature"]) > 0 and float(by["msp"]["relative_time"]) == 1.0
    for task in bench.TASKS_ORDER:
        assert (tmp_path / bench.PNG.format(task=task)).stat().st_size > 10_000
    with open(tmp_path / bench.SELECTION_CSV, newline="") as handle:
        selection = list(csv.DictReader(handle))
    assert [float(r["eta_kl"]) for r in selection] == [0.0, 1e-3] * 2  # the quick run's candidates, per task
    best = min(selection[:2], key=lambda r: float(r["validation_nll"]))
    assert float(by["kep_svgp"]["eta_kl"]) == float(best["eta_kl"])  # chosen by validation NLL


def test_the_kep_layers_own_learning_rate_reaches_the_optimizer(tmp_path):
    # Converting MiniLM, the new layer's parameters train at --kep-primal-learning-rate and the rest at the task's
    # rate: with AdamW every parameter moves by about its group's rate per step, so their largest steps differ by
    # about the ratio of the two rates.
    from datasets import Dataset
    from transformers import BertForSequenceClassification, default_data_collator

    from scripts.benchmarks.uncertainty_tasks import train
    from tests.conftest import bert_config, largest_steps

    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config(num_labels=3, primal_attention={
        "layers": [-1], "low_rank": 4, "rank_multi": 2, "variant": "kep_svgp", "eta_kl": 1e-3}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    data = Dataset.from_dict({"input_ids": torch.randint(5, 90, (32, 10), generator=g).tolist(),
                              "attention_mask": [[1] * 10] * 32, "labels": [i % 3 for i in range(32)]})
    args = bench.parse_args(["--batch-size", "8"])
    train(model, data, default_data_collator, args, seed=0, epochs=1, learning_rate=1e-5, primal_learning_rate=1e-2)
    primal, other = largest_steps(model, before)
    assert primal > 100 * other > 0
