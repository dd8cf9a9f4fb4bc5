"""scripts/benchmarks/long_documents.py: the article split, the byte encoding, padding, the report's arithmetic
against hand-computed answers, and a --quick run checked against an independent recomputation."""

import argparse
import csv
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

from scripts.benchmarks import (
    bbc_news,  # noqa: E402
    checkpoints,  # noqa: E402
    harness,  # noqa: E402
)
from scripts.benchmarks import long_documents as bench  # noqa: E402
from scripts.benchmarks import long_documents_model as network  # noqa: E402
from scripts.benchmarks import long_documents_task as task  # noqa: E402


def test_articles_split_by_article_and_never_share_documents():
    splits = bbc_news.load_articles(seed=0)
    texts = {name: [t for t, _ in rows] for name, rows in splits.items()}
    assert len(set(texts["train"]) & set(texts["validation"])) == 0
    assert len(set(texts["train"] + texts["validation"]) & set(texts["test"])) == 0
    for name, rows in splits.items():
        assert sorted({label for _, label in rows}) == list(range(5)), name
        assert len(set(texts[name])) == len(texts[name]), name
    total = sum(len(rows) for rows in splits.values())
    assert 2100 < total <= 2225  # the corpus' duplicates dropped, nothing else
    assert abs(len(texts["test"]) / total - 0.25) < 0.02 and abs(len(texts["validation"]) / total - 0.15) < 0.02
    # Whole articles: the headline line and the body, as the files hold them.
    root = bbc_news.corpus_dir()
    on_disk = {p.read_bytes() for p in root.glob("*/*.txt")}
    assert set(texts["test"]) <= on_disk
    assert statistics.median(len(t) for t in texts["train"]) > 1500


def test_encode_is_bytes_plus_one_truncated_and_padded():
    ids, mask, labels = task.encode([(b"AB\xff", 3), (b"abcdef", 1)], 4)
    assert ids.tolist() == [[66, 67, 256, 0], [98, 99, 100, 101]]
    assert mask.tolist() == [[True, True, True, False], [True] * 4]
    assert labels.tolist() == [3, 1]


def _args(**kw):
    args = bench.parse_args(["--quick"])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("variant", ["sdpa", "primal", "primal-last"])
def test_a_document_scores_the_same_whatever_its_padding(variant):
    # Padding is masked through the encoder and the pool: a short document's logits must not depend on how many
    # padding bytes follow it, nor on what it is batched with (eval mode, no dropout).
    args = _args()
    torch.manual_seed(0)
    model = network.DocumentClassifier(variant, 64, args).eval()
    short, long = (b"Short text, then padding.", 0), (bytes(range(40, 104)), 1)
    with torch.no_grad():
        logits = [model(*task.encode(docs, n)[:2])[:1] for docs, n in (([short], 64), ([short], 40),
                                                                         ([short, long], 64))]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[2], logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [network.NO_ATTENTION, "performer", "sdpa", "primal"])
def test_only_encoders_that_read_the_mask_build_one(variant, monkeypatch):
    # The floor and the peers ignore the encoder's attention mask; building one would charge them softmax's mask.
    from transformers import masking_utils

    args = _args()
    torch.manual_seed(0)
    model = network.DocumentClassifier(variant, 64, args).eval()
    ids, mask, _ = task.encode([(b"Short text, then padding.", 0), (bytes(range(40, 104)), 1)], 64)
    built = []

    def recording(function):
        def build(*a, **k):
            out = function(*a, **k)
            built.append(None if out is None else tuple(out.shape))
            return out
        return build

    for name in ("sdpa", "eager"):
        mapping = masking_utils.AttentionMaskInterface._global_mapping
        monkeypatch.setitem(mapping, name, recording(mapping[name]))
    with torch.no_grad():
        logits = model(ids, mask)
        hidden = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # the reference: with the mask
    expected = {"sdpa": (2, 1, 64, 64), "primal": (2, 64)}.get(variant)  # softmax's 4D mask; primal's padding mask
    assert built[0] == expected and built[1] is not None
    weights = mask.unsqueeze(-1).float()
    reference = model.head((hidden * weights).sum(1) / weights.sum(1))
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-6)


def test_primal_variants_carry_the_paper_settings():
    args = _args()
    cfg_all = network.DocumentClassifier("primal", 64, args).encoder.config.primal_attention
    cfg_last = network.DocumentClassifier("primal-last", 64, args).encoder.config.primal_attention
    assert (cfg_all["layers"], cfg_all["low_rank"], cfg_all["eta"]) == ("all", 20, 0.05)
    assert (cfg_last["layers"], cfg_last["low_rank"], cfg_last["eta"]) == ([-1], 30, 0.1)
    assert cfg_all["rank_multi"] == 1 and cfg_all["ksvd_reduction"] == "batch"  # m chosen by the study
    model = network.DocumentClassifier("primal", 64, args)
    assert {layer.attention.self.primal.sampling for layer in model.encoder.encoder.layer} == {"segment_mean"}
    text = network.settings_text("primal", args)
    assert "m=1" in text and "sampling=segment_mean" in text
    paper = network.DocumentClassifier("primal", 64, _args(rank_multi=10, sampling="even"))
    assert {layer.attention.self.primal.sampling for layer in paper.encoder.encoder.layer} == {"even"}
    assert paper.encoder.config.primal_attention["rank_multi"] == 10
    import hf_primal

    assert len(hf_primal.primal_layers(network.DocumentClassifier("primal", 64, args).encoder)) == 2
    assert len(hf_primal.primal_layers(network.DocumentClassifier("primal-last", 64, args).encoder)) == 1
    assert not hf_primal.primal_layers(network.DocumentClassifier("sdpa", 64, args).encoder)


def _run_row(variant, n, seed, acc, f1, seconds, step, peak):
    return {"variant": variant, "n": n, "seed": seed, "status": "ok", "accuracy": acc, "macro_f1": f1,
            "val_accuracy": acc, "train_seconds": seconds, "step_ms_median": step, "peak_mib": peak}


def test_summary_and_targets_equal_hand_computed_answers():
    rows = [
        _run_row("sdpa", 2048, 0, 0.70, 0.6, 100.0, 1000.0, 400.0),
        _run_row("sdpa", 2048, 1, 0.80, 0.7, 120.0, 1200.0, 400.0),
        _run_row("primal", 2048, 0, 0.72, 0.6, 25.0, 250.0, 80.0),
        _run_row("primal", 2048, 1, 0.74, 0.6, 30.0, 300.0, 120.0),
        _run_row("primal-last", 2048, 0, 0.76, 0.7, 60.0, 600.0, 200.0),
        _run_row("performer", 2048, 0, 0.50, 0.4, 55.0, 550.0, 100.0),
        {"variant": "eager", "n": 2048, "seed": 0, "status": "ok", "step_ms_median": 4000.0, "peak_mib": 2000.0},
        {"variant": "eager", "n": 4096, "seed": 0, "status": "skipped: needs ~16 GiB"},
    ]
    summary = bench.summarise(rows)
    by = {(s["n"], s["variant"]): s for s in summary}
    assert [s["variant"] for s in summary] == ["sdpa", "eager", "primal", "primal-last", "performer"]
    sdpa, primal = by[(2048, "sdpa")], by[(2048, "primal")]
    assert sdpa["accuracy_mean"] == pytest.approx(0.75) and sdpa["accuracy_std"] == pytest.approx(0.0707107, 1e-5)
    assert primal["train_speedup_vs_sdpa"] == pytest.approx(110 / 27.5)
    assert primal["step_speedup_vs_sdpa"] == pytest.approx(1100 / 275)
    assert primal["memory_ratio_vs_sdpa"] == pytest.approx(4.0)
    assert by[(2048, "eager")]["step_speedup_vs_sdpa"] == pytest.approx(1100 / 4000)
    checks = {c["name"].split(" (")[0]: c for c in bench.targets(summary)}
    assert checks["N=2048 primal-last - sdpa test accuracy"]["value"] == pytest.approx(1.0)
    assert checks["N=2048 primal-last - sdpa test accuracy"]["met"] is True
    assert checks["N=2048 primal - sdpa test accuracy"]["value"] == pytest.approx(-2.0)
    assert checks["N=2048 primal - sdpa test accuracy"]["met"] is True  # within 3 points
    assert checks["N=2048 primal - performer test accuracy"]["value"] == pytest.approx(23.0)
    assert f"N=2048 primal - {bench.NO_ATTENTION} test accuracy" not in checks  # the floor was not trained
    floor = [_run_row(bench.NO_ATTENTION, 2048, s, acc, 0.5, 10.0, 100.0, 50.0) for s, acc in ((0, 0.60), (1, 0.64))]
    checks = {c["name"].split(" (")[0]: c for c in bench.targets(bench.summarise(rows + floor))}
    above = checks[f"N=2048 primal - {bench.NO_ATTENTION} test accuracy"]
    assert above["value"] == pytest.approx(11.0) and above["met"] is True  # 73 - 62 points
    high = [_run_row(bench.NO_ATTENTION, 2048, 0, 0.80, 0.5, 10.0, 100.0, 50.0)]
    checks = {c["name"].split(" (")[0]: c for c in bench.targets(bench.summarise(rows + high))}
    below = checks[f"N=2048 primal - {bench.NO_ATTENTION} test accuracy"]
    assert below["value"] == pytest.approx(-7.0) and below["met"] is False


def _timed(n, variant, step_ms, peak_mib):
    return {"n": n, "variant": variant, "status": "ok", "step_ms": step_ms, "peak_mib": peak_mib}


def test_timing_ratios_and_attention_own_memory_from_known_figures():
    timed = [_timed(2048, "sdpa", 4000.0, 1700.0), _timed(2048, "eager", 12000.0, 4500.0),
             _timed(2048, "primal", 1000.0, 700.0), _timed(2048, bench.NO_ATTENTION, 500.0, 450.0),
             {"n": 2048, "variant": "sdpa-dropout", "status": "skipped: needs ~9 GiB"}]
    bench.add_ratios(timed)
    by = {r["variant"]: r for r in timed}
    assert by["primal"]["speedup_vs_sdpa"] == 4.0 and by["eager"]["speedup_vs_sdpa"] == pytest.approx(1 / 3, 1e-3)
    assert by["primal"]["memory_ratio_vs_sdpa"] == pytest.approx(1700 / 700, 1e-3)
    # Own peaks above the 450 MiB floor: sdpa 1250, eager 4050, primal 250.
    assert (by["sdpa"]["attention_peak_mib"], by["eager"]["attention_peak_mib"],
            by["primal"]["attention_peak_mib"]) == (1250.0, 4050.0, 250.0)
    assert by["primal"]["attention_memory_ratio_vs_sdpa"] == 5.0
    assert by["primal"]["attention_memory_ratio_vs_eager"] == pytest.approx(16.2)
    assert "attention_peak_mib" not in by[bench.NO_ATTENTION] and "speedup_vs_sdpa" not in by["sdpa-dropout"]
    later = [_timed(4096, "sdpa", 16000.0, 5600.0), _timed(4096, "primal", 3500.0, 1600.0),
             _timed(4096, bench.NO_ATTENTION, 1500.0, 1100.0)]
    bench.add_ratios(later)
    checks = {c["name"]: c for c in bench.targets([], [{k: str(v) for k, v in r.items()} for r in timed + later])}
    verdicts = {name.split(" timing")[0]: (c["value"], c["target"], c["met"]) for name, c in checks.items()}
    assert verdicts == {
        "N=2048 primal training-step speedup vs sdpa,": (4.0, ">= 2.5", True),
        "N=2048 attention's own peak memory (above no-attention) sdpa / primal,": (5.0, ">= 4", True),
        "N=2048 attention's own peak memory (above no-attention) eager / primal,": (16.2, ">= 6", True),
        "N=4096 primal training-step speedup vs sdpa,": (pytest.approx(16000 / 3500, 1e-3), ">= 5", False),
    }


def test_probability_memory_estimate_matches_the_measured_peaks_and_skips_per_variant():
    # The measured reference: attention's own peak of eager and sdpa-dropout at N = 2048 in the committed timing run.
    with open(ROOT / "scripts/benchmarks/results" / bench.TIMING_CSV, newline="") as handle:
        rows = list(csv.DictReader(handle))
    own = {r["variant"]: float(r["attention_peak_mib"]) for r in rows if r["n"] == "2048" and r["attention_peak_mib"]}
    args = argparse.Namespace(batch_size=32, eager_limit_gib=20.0)
    for variant in ("eager", "sdpa-dropout"):
        assert task.eager_estimate_gib(2048, args, variant) * 1024 == pytest.approx(own[variant], rel=0.05)
    # Quadratic in N: at 4096 eager fits a 20 GiB limit and sdpa-dropout does not.
    assert [task.eager_estimate_gib(4096, args, v) for v in ("eager", "sdpa-dropout")] == [16, 28]
    assert task.eager_job(argparse.Namespace(**vars(args), device="cpu", dtype="fp32", threads=1), "sdpa-dropout",
                          4096, 0)["status"] == "skipped: needs ~28 GiB > --eager-limit-gib 20"


def test_jobs_cover_every_variant_seed_and_length_once():
    args = argparse.Namespace(lengths=[2048, 4096], seeds=[0, 1, 2], long_seeds=[0])
    jobs = bench.jobs(args)
    assert len(jobs) == len(set(jobs))
    assert {(v, s) for v, n, s in jobs if n == 2048 and v in bench.TRAINED} == {
        (v, s) for v in bench.TRAINED for s in (0, 1, 2)}
    assert {v for v, n, s in jobs if n == 4096} == set(bench.TRAINED) | {"eager"}
    assert ("sdpa-dropout", 2048, 0) in jobs and ("eager", 2048, 0) in jobs
    assert jobs[: len(bench.TRAINED)] == [(v, 2048, 0) for v in bench.TRAINED]  # the main table's first seed first


def test_runs_of_two_budgets_are_kept_apart():
    # The 8- and 16-epoch tables live in one file: a rerun at 16 epochs must not take the 8-epoch runs for done, the
    # summary must not average them together, and each budget is read against its own softmax.
    def at(epochs, variant, acc, step):
        return {**_run_row(variant, 2048, 0, acc, 0.5, step / 10, step, 100.0), "epochs": str(epochs)}

    rows = [at(8.0, "sdpa", 0.60, 1000.0), at(8.0, "primal", 0.50, 250.0), at(16.0, "sdpa", 0.70, 1000.0),
            at(16.0, "primal", 0.68, 200.0),
            {"variant": "eager", "n": 2048, "seed": 0, "status": "ok", "step_ms_median": 4000.0, "peak_mib": 2000.0}]
    args = argparse.Namespace(lengths=[2048], seeds=[0], long_seeds=[0], variants=["sdpa", "primal", "eager"],
                              epochs=16.0)
    assert bench.pending(args, rows) == []
    assert bench.pending(argparse.Namespace(**{**vars(args), "epochs": 32.0}), rows) == [
        ("sdpa", 2048, 0), ("primal", 2048, 0)]  # eager is timed once, whatever the budget
    summary = bench.summarise(rows)
    assert [(s["epochs"], s["variant"]) for s in summary] == [
        (16.0, "sdpa"), (16.0, "eager"), (16.0, "primal"), (8.0, "sdpa"), (8.0, "eager"), (8.0, "primal")]
    by = {(s["epochs"], s["variant"]): s for s in summary}
    assert by[(16.0, "primal")]["accuracy_mean"] == pytest.approx(0.68)
    assert by[(16.0, "primal")]["step_speedup_vs_sdpa"] == pytest.approx(5.0)
    assert by[(8.0, "primal")]["step_speedup_vs_sdpa"] == pytest.approx(4.0)
    checks = {c["name"].split(" (")[0]: c for c in bench.targets(summary)}
    assert checks["N=2048, 16 epochs primal - sdpa test accuracy"]["value"] == pytest.approx(-2.0)
    assert checks["N=2048, 16 epochs primal - sdpa test accuracy"]["met"] is True
    assert checks["N=2048, 8 epochs primal - sdpa test accuracy"]["value"] == pytest.approx(-10.0)
    assert checks["N=2048, 8 epochs primal - sdpa test accuracy"]["met"] is False


def test_device_options_refuse_what_this_machine_cannot_run():
    parser = argparse.ArgumentParser()
    harness.add_device_arguments(parser)
    assert harness.resolve_device(parser.parse_args([])) == ("cpu", "fp32")
    assert harness.resolve_device(parser.parse_args(["--dtype", "bf16"])) == ("cpu", "bf16")
    with pytest.raises(SystemExit, match="fp16 is for CUDA"):
        harness.resolve_device(parser.parse_args(["--dtype", "fp16"]))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: CUDA is not available"):
            harness.resolve_device(parser.parse_args(["--device", "cuda"]))
    with pytest.raises(SystemExit, match="--device mps"):
        harness.resolve_device(parser.parse_args(["--device", "mps"]))


def test_a_run_killed_between_epochs_resumes_to_the_row_it_would_have_written(tmp_path, monkeypatch):
    # Three epochs with dropout (the global RNG), a data order of its own and half the training articles, so that
    # an epoch (3 steps of the whole set) ends inside a pass over the half (2 steps); killed after the first epoch's
    # checkpoint, then started again with the same settings. The uninterrupted run is the reference.
    args = _args(epochs=3.0, train_fraction=0.5, out_dir=str(tmp_path))
    weights = []  # the weights each evaluation sees: the last ones are the trained model's, to the bit
    real_evaluate = task.evaluate

    def recording(model, *a, **k):
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        return real_evaluate(model, *a, **k)

    monkeypatch.setattr(task, "evaluate", recording)
    whole = task.train_job(args, "primal", 96, 1)
    trained = weights[-1]
    assert not (tmp_path / checkpoints.DIRECTORY).exists()  # a finished run leaves no checkpoint

    steps, calls = -(-24 // 8), []
    real_step = task.train_step

    def dies_after_one_epoch(*a, **k):
        if len(calls) == steps:
            raise KeyboardInterrupt
        calls.append(1)
        return real_step(*a, **k)

    monkeypatch.setattr(task, "train_step", dies_after_one_epoch)
    with pytest.raises(KeyboardInterrupt):
        task.train_job(args, "primal", 96, 1)
    monkeypatch.setattr(task, "train_step", real_step)
    assert len(list((tmp_path / checkpoints.DIRECTORY).glob("*.pt"))) == 1
    # Other settings never resume it: a different learning rate trains from the start.
    other = task.train_job(_args(epochs=3.0, train_fraction=0.5, out_dir=str(tmp_path), learning_rate=3e-3),
                           "primal", 96, 1)
    assert len(other["val_curve"].split()) == 3
    resumed = task.train_job(args, "primal", 96, 1)
    assert torch.equal(weights[-1], trained)
    for key in ("accuracy", "val_accuracy", "train_accuracy", "val_curve", "steps"):
        assert resumed[key] == whole[key], key
    assert not (tmp_path / checkpoints.DIRECTORY).exists()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    result = subprocess.run([sys.executable, "-m", "scripts.benchmarks.long_documents", "--quick",
                             "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def read(name):
        with open(out / name, newline="") as handle:
            return list(csv.DictReader(handle))

    return out, read


def test_quick_run_has_every_job_and_a_reproducible_row(quick_run):
    out, read = quick_run
    rows = read(bench.RUNS_CSV)
    args = bench.parse_args(["--quick"])
    assert sorted((r["variant"], int(r["n"]), int(r["seed"])) for r in rows) == sorted(bench.jobs(args))
    for row in rows:
        assert row["status"] == "ok", row
        if row["variant"] != "eager":
            assert 0 <= float(row["accuracy"]) <= 1 and float(row["train_seconds"]) > 0
            assert int(row["steps"]) == -(-24 // 8)  # 24 training documents, batch 8, one epoch
    # Seeded from end to end: training one row again in this process gives the same test accuracy.
    again = bench.train_job(args, "primal", 96, 0)
    first = next(r for r in rows if (r["variant"], r["n"], r["seed"]) == ("primal", "96", "0"))
    assert again["accuracy"] == pytest.approx(float(first["accuracy"]))
    assert again["val_accuracy"] == pytest.approx(float(first["val_accuracy"]))


def test_quick_run_summary_and_timing_ratios_from_the_raw_rows(quick_run):
    out, read = quick_run
    rows, summary = read(bench.RUNS_CSV), read(bench.SUMMARY_CSV)
    for item in summary:
        runs = [r for r in rows if r["variant"] == item["variant"] and r["n"] == item["n"]]
        assert int(item["seeds"]) == len(runs)
        if item["variant"] != "eager":
            assert float(item["accuracy_mean"]) == pytest.approx(sum(float(r["accuracy"]) for r in runs) / len(runs))
    timing = read(bench.TIMING_CSV)
    assert {r["variant"] for r in timing} == set(task.TIMED)
    for row in (r for r in timing if r["status"] == "ok"):
        sdpa = next(r for r in timing if r["n"] == row["n"] and r["variant"] == "sdpa")
        assert float(row["speedup_vs_sdpa"]) == pytest.approx(float(sdpa["step_ms"]) / float(row["step_ms"]), 1e-2)
        assert float(row["step_ms_min"]) <= float(row["step_ms"]) and int(row["reps"]) == 3
        assert float(row["peak_mib"]) > 0
        assert row["cpu"] == _cpu_model()  # the speed ratios between kernels depend on the CPU
    assert (out / bench.PNG).stat().st_size > 10_000
    assert read(bench.TARGETS_CSV)


def _cpu_model():
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def test_without_attention_no_byte_sees_another():
    # The timing phase's reference network: a position's final hidden state depends on its own byte alone, and the
    # encoder holds no attention parameters (so its memory is that of everything but attention).
    torch.manual_seed(0)
    model = network.DocumentClassifier(bench.NO_ATTENTION, 32, _args()).eval()
    assert not any(".attention." in name for name, _ in model.named_parameters())
    ids, mask, _ = task.encode([(bytes(range(65, 97)), 0), (b"A" + bytes(range(200, 231)), 0)], 32)
    with torch.no_grad():
        hidden = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(hidden[0, 0], hidden[1, 0])  # the same first byte, every other byte different
    assert not torch.allclose(hidden[0, 1], hidden[1, 1])
    sdpa = network.DocumentClassifier("sdpa", 32, _args()).eval()
    with torch.no_grad():
        mixed = sdpa.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(mixed[0, 0], mixed[1, 0], atol=1e-4)  # with attention, the first byte sees the rest


def test_variants_choose_a_part_of_the_table_and_unknown_ones_are_named():
    args = bench.parse_args(["--variants", "primal,sdpa", "--lengths", "2048,4096"])
    assert bench.jobs(args) == [("sdpa", 2048, 0), ("primal", 2048, 0), ("sdpa", 2048, 1), ("primal", 2048, 1),
                                ("sdpa", 2048, 2), ("primal", 2048, 2), ("sdpa", 4096, 0), ("primal", 4096, 0)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "primal,flash"])
