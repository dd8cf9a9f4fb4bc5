"""scripts/benchmarks/long_documents_study.py: run names say what a run changes (so grids share runs), the grids'
plan, the summary against hand-computed answers, and a --quick run whose rows feed that summary."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from scripts.benchmarks import long_documents_study as study  # noqa: E402


def test_setting_names_list_what_changes_in_a_fixed_order():
    assert study.setting_name("primal", {}) == "baseline"
    assert study.setting_name("primal", {"sampling": "even", "learning_rate": 1e-3}) == "baseline"
    assert study.setting_name("primal", {"sampling": "jitter", "learning_rate": 3e-4}) == \
        "learning_rate=0.0003,sampling=jitter"
    # Sampling and m do not exist for the softmax and no-attention networks: the same run whatever they say.
    assert study.setting_name("sdpa", {"sampling": "jitter", "rank_multi": 3}) == "baseline"
    assert study.setting_name("no-attention", {**study.PAPER, "sampling": "segment_mean"}) == \
        "learning_rate=0.0001,adam_eps=1e-06,warmup=0.4"


def test_plan_runs_each_setting_once_and_the_lr_grid_holds_the_benchmark_recipe():
    args = study.parse_args(["--grid", "options,lr,data", "--seeds", "0,1", "--sampling", "jitter"])
    plan = study.planned(args)
    keys = [(v, study.setting_name(v, o), s) for v, o, s in plan]
    assert len(keys) == len(set(keys))
    assert [s for _, _, s in plan] == sorted(s for _, _, s in plan)  # first seed first
    # lr = 1e-3 of the lr grid and data = 1.0 of the data grid are the same runs for sdpa.
    assert ("sdpa", "baseline", 0) in keys and sum(1 for k in keys if k[0] == "sdpa" and k[2] == 0) == 6
    assert ("primal", "sampling=jitter", 0) in keys  # lr 1e-3 with the chosen rule: shared with the options grid
    args = study.parse_args(["--grid", "options", "--seeds", "1", "--match", "^primal sampling"])
    assert [study.setting_name(v, o) for v, o, _ in study.planned(args)] == [
        "sampling=jitter", "sampling=segment_mean", "sampling=segment_mean,rank_multi=1",
        "sampling=segment_mean,rank_multi=3", "sampling=jitter,rank_multi=1"]


def _row(setting, variant, seed, train, val, test, curve):
    return {"setting": setting, "variant": variant, "n": "512", "seed": str(seed), "train_accuracy": str(train),
            "val_accuracy": str(val), "accuracy": str(test), "val_curve": curve}


def test_summary_equals_hand_computed_means_and_the_best_epoch_of_the_mean_curve():
    rows = [_row("sampling=jitter", "primal", 0, 0.6, 0.40, 0.41, "41:0.30 82:0.40 123:0.38"),
            _row("sampling=jitter", "primal", 1, 0.7, 0.50, 0.45, "41:0.36 82:0.30 123:0.50"),
            _row("baseline", "sdpa", 0, 0.8, 0.55, 0.56, "41:0.50 82:0.55 123:0.55")]
    args = study.parse_args(["--grid", "options"])
    by = {(s["setting"], s["variant"]): s for s in study.summarise(rows, args)}
    jitter = by[("sampling=jitter", "primal")]
    assert jitter["seeds"] == 2 and jitter["val_accuracy_mean"] == pytest.approx(0.45)
    assert jitter["val_accuracy_std"] == pytest.approx(0.0707107, 1e-5)
    assert jitter["train_accuracy_mean"] == pytest.approx(0.65) and jitter["accuracy_mean"] == pytest.approx(0.43)
    assert jitter["val_curve_mean"] == "0.3300 0.3500 0.4400" and jitter["best_epoch"] == 3
    assert by[("baseline", "sdpa")]["best_epoch"] == 2 and by[("baseline", "sdpa")]["val_accuracy_std"] == 0.0
    assert ("baseline", "primal") not in by  # not run


def test_a_report_of_one_grid_keeps_the_other_grids_of_the_summary_file():
    previous = [{"grid": "options", "setting": "baseline", "variant": "sdpa", "n": "512"},
                {"grid": "lr", "setting": "learning_rate=0.0001", "variant": "sdpa", "n": "512"},
                {"grid": "lr", "setting": "learning_rate=0.0001", "variant": "sdpa", "n": "2048"}]
    new = [{"grid": "lr", "setting": "learning_rate=0.0003", "variant": "sdpa", "n": "512"}]
    assert study.merged(previous, new, ["lr"], 512) == [previous[0], previous[2], new[0]]  # the same grid at 2048 stays


def test_quick_run_rows_feed_the_summary(tmp_path):
    command = [sys.executable, "-m", "scripts.benchmarks.long_documents_study", "--quick", "--length", "96",
               "--grid", "options", "--match", "^(primal sampling=jitter|sdpa baseline)$", "--seeds", "0",
               "--workers", "1", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / study.STUDY_CSV, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((r["variant"], r["setting"]) for r in rows) == [("primal", "sampling=jitter"), ("sdpa", "baseline")]
    assert all(r["settings"].endswith("sampling=jitter") for r in rows if r["variant"] == "primal")
    with open(tmp_path / study.STUDY_SUMMARY_CSV, newline="") as handle:
        summary = list(csv.DictReader(handle))
    for item in summary:
        run = next(r for r in rows if (r["variant"], r["setting"]) == (item["variant"], item["setting"]))
        assert float(item["val_accuracy_mean"]) == pytest.approx(float(run["val_accuracy"]))
        assert float(item["train_accuracy_mean"]) == pytest.approx(float(run["train_accuracy"]))
    assert (tmp_path / study.STUDY_PNG).stat().st_size > 10_000


def test_the_capacity_grid_reads_the_table_run_with_the_same_arguments_and_no_other(tmp_path):
    table = {"n": "2048", "seed": "0", "status": "ok", "epochs": "8.0", "train_accuracy": "0.5", "val_accuracy": "0.6",
             "accuracy": "0.55", "val_curve": ""}
    fields = ["n", "variant", "seed", "status", "epochs", "train_accuracy", "val_accuracy", "accuracy", "val_curve"]
    # The table's primal run at another budget, and one that records none: neither is the study's 8-epoch run.
    rows = [{**table, "variant": "primal", "epochs": "16.0", "val_accuracy": "0.7"},
            {**table, "variant": "primal", "epochs": "", "val_accuracy": "0.8"},
            {**table, "variant": "primal"}, {**table, "variant": "primal-last", "status": "failed"}]
    with open(tmp_path / "long_documents.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    args = study.parse_args(["--grid", "capacity", "--length", "2048", "--seeds", "0", "--out-dir", str(tmp_path)])
    plan = study.planned(args)
    assert [(v, o["rank_multi"]) for v, o, _ in plan] == [(v, m) for v in ("primal", "primal-last") for m in (1, 2, 4)]
    reused = {(v, o["rank_multi"]): study.from_table(args, v, o, s) for v, o, s in plan}
    # The table's primal run is m = 1 with segment means at the benchmark's recipe: the same run.
    assert reused[("primal", 1)]["setting"] == "sampling=segment_mean,rank_multi=1"
    assert reused[("primal", 1)]["val_accuracy"] == "0.6"
    assert reused[("primal", 2)] is None and reused[("primal", 4)] is None  # other slots: not the table's run
    assert reused[("primal-last", 1)] is None  # a failed run is not reused
    other_lr = study.parse_args(["--grid", "capacity", "--length", "2048", "--seeds", "0", "--out-dir",
                                 str(tmp_path), "--learning-rate", "3e-4"])
    assert study.from_table(other_lr, "primal", {"sampling": "segment_mean", "rank_multi": 1, "learning_rate": 3e-4},
                            0) is None
    # A run whose rows are all in the table trains nothing and writes them into the study's file.
    only_table = study.parse_args(["--grid", "capacity", "--length", "2048", "--seeds", "0", "--out-dir",
                                   str(tmp_path), "--match", "^primal sampling=segment_mean,rank_multi=1$"])
    study.run(only_table)
    with open(tmp_path / study.STUDY_CSV, newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [(r["setting"], r["variant"], r["val_accuracy"]) for r in written] == [
        ("sampling=segment_mean,rank_multi=1", "primal", "0.6")]
    # Another length: the table's run at 2048 is not the run at 1024.
    at_1024 = study.parse_args(["--grid", "capacity", "--length", "1024", "--seeds", "0", "--out-dir", str(tmp_path)])
    assert study.from_table(at_1024, "primal", {"sampling": "segment_mean", "rank_multi": 1}, 0) is None


def test_the_budget_grid_shares_the_eight_epoch_runs_and_a_smoke_run_keeps_its_budget():
    args = study.parse_args(["--grid", "budget,lr", "--seeds", "0", "--sampling", "segment_mean", "--rank-multi", "1"])
    keys = [(v, study.setting_name(v, o)) for v, o, _ in study.planned(args)]
    assert len(keys) == len(set(keys))
    # 8 epochs is the study's recipe: the same run as the lr grid's lr = 1e-3 one, named without epochs.
    assert ("primal", "sampling=segment_mean,rank_multi=1") in keys and ("sdpa", "baseline") in keys
    assert ("primal", "sampling=segment_mean,rank_multi=1,epochs=32") in keys and ("no-attention", "epochs=16") in keys
    assert study._bench_args(args, {"epochs": 16.0}).epochs == 16.0
    quick = study.parse_args(["--grid", "budget", "--quick", "--length", "96"])
    assert study._bench_args(quick, {}).epochs == 1.0 and study._bench_args(quick, {"epochs": 2.0}).epochs == 2.0
