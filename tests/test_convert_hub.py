"""convert() with and without attention transfer, shareable folders, remote code, push_to_hub, CLI, demo."""

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import HfApi
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForSequenceClassification,
    BertModel,
    GPT2LMHeadModel,
    ViTForImageClassification,
)

import hf_primal
from hf_primal import convert, primal_layers
from hf_primal.integration.hub import REMOTE_CODE_FILES
from tests.conftest import bert_config, child_env, gpt2_config, vit_config

AUTO = {
    "bert": AutoModelForSequenceClassification, "vit": AutoModelForImageClassification, "gpt2": AutoModelForCausalLM
}


def _stock(arch):
    return {
        "bert": lambda: BertForSequenceClassification(bert_config(num_hidden_layers=3)),
        "vit": lambda: ViTForImageClassification(vit_config(num_hidden_layers=3)),
        "gpt2": lambda: GPT2LMHeadModel(gpt2_config(n_layer=3)),
    }[arch]()


def _batches(arch, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    if arch == "vit":
        return [{"pixel_values": torch.randn(4, 3, 16, 16, generator=g)} for _ in range(n)]
    out = []
    for _ in range(n):
        ids = torch.randint(1, 120, (4, 12), generator=g)
        mask = torch.ones(4, 12, dtype=torch.long)
        mask[1, 8:] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@pytest.mark.parametrize("arch", ["bert", "vit", "gpt2"])
def test_plain_conversion_reuses_weights(arch):
    torch.manual_seed(0)
    model = _stock(arch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    convert(model, {"layers": [0, -1], "low_rank": 4, "rank_multi": 2})
    assert len(primal_layers(model)) == 2 and model.config.model_type == f"primal_{arch}"
    after = dict(model.named_parameters())
    for name, value in before.items():
        if name in after:
            assert torch.equal(after[name], value), name
    dropped = [n for n in before if n not in after]
    We = [p for n, p in after.items() if n.endswith("primal.We")]
    assert len(We) == 2
    assert all(torch.allclose(w.flatten(1) @ w.flatten(1).T, torch.eye(w.shape[0]), atol=1e-5) for w in We)
    batch = _batches(arch, 1)[0]
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.isfinite(logits).all()
    if arch != "gpt2":  # separate value projections: dropped from the two converted layers (weight and bias)
        assert len(dropped) == 4 and all(("value" in n or "v_proj" in n) for n in dropped), dropped
        return
    # GPT-2's fused c_attn keeps its value third (so stock checkpoints and LoRA on c_attn load unchanged; its values
    # are checked equal above), but a primal layer must not use it: zeroing it leaves the outputs unchanged, while
    # zeroing the key third of the same layers, or the value third of the stock middle layer, changes them.
    assert dropped == []
    width = model.config.n_embd

    def logits_with_zeroed(blocks, third):
        trial = copy.deepcopy(model)
        with torch.no_grad():
            for i in blocks:
                c_attn = trial.transformer.h[i].attn.c_attn
                c_attn.weight[:, third * width:(third + 1) * width] = 0
                c_attn.bias[third * width:(third + 1) * width] = 0
            return trial(**batch).logits

    assert torch.allclose(logits_with_zeroed([0, 2], third=2), logits, rtol=0, atol=1e-6)
    assert not torch.allclose(logits_with_zeroed([0, 2], third=1), logits, atol=1e-4)
    assert not torch.allclose(logits_with_zeroed([1], third=2), logits, atol=1e-4)


_BLOCK_NAMES = {"bert": "bert.encoder.layer.{}", "vit": "vit.layers.{}", "gpt2": "transformer.h.{}"}
_ATTENTION_NAMES = {"bert": "bert.encoder.layer.{}.attention.self", "vit": "vit.layers.{}.attention",
                    "gpt2": "transformer.h.{}.attn"}


def _held_out_errors(stock, converted, names, batches, causal):
    """Relative error ||y - y_stock|| / ||y_stock|| over valid tokens of each named module of `converted`, called with
    exactly the inputs the same module of `stock` received on `batches` (as attention transfer fits it)."""
    calls = {name: [] for name in names}
    handles = [
        stock.get_submodule(name).register_forward_hook(
            lambda mod, args, kwargs, out, name=name: calls[name].append(
                (args, kwargs, out[0] if isinstance(out, tuple) else out)
            ),
            with_kwargs=True)
        for name in names
    ]
    with torch.no_grad():
        for batch in batches:
            stock(**batch, **({"use_cache": False} if causal else {}))
    for handle in handles:
        handle.remove()
    errors = {}
    for name in names:
        num = den = 0.0
        for batch, (args, kwargs, y_stock) in zip(batches, calls[name]):
            with torch.no_grad():
                y = converted.get_submodule(name)(*args, **kwargs)
            y = y[0] if isinstance(y, tuple) else y
            valid = batch.get("attention_mask", torch.ones(y.shape[:2], dtype=torch.long)).bool()
            num += float(((y - y_stock) ** 2).sum(-1)[valid].sum())
            den += float((y_stock ** 2).sum(-1)[valid].sum())
        errors[name] = (num / den) ** 0.5
    return errors


@pytest.mark.parametrize("target", ["layer", "attention"])
@pytest.mark.parametrize("arch", ["bert", "vit", "gpt2"])
def test_calibration_lowers_every_layer_error(arch, target):
    # Measured on batches that were neither trained on nor used to choose the kept step (a different seed from the
    # calibration batches), against the plain conversion with the same initialisation, with a stated margin.
    torch.manual_seed(0)
    stock = _stock(arch).eval()
    spec = {"layers": [1, 2], "low_rank": 4, "rank_multi": 2}
    torch.manual_seed(1)
    plain = convert(copy.deepcopy(stock), spec).eval()
    torch.manual_seed(1)
    model = convert(copy.deepcopy(stock), spec, calibration_data=_batches(arch, seed=0), method="transfer", steps=60,
                    learning_rate=1e-3, target=target, progress=False).eval()
    report = model.primal_conversion_report
    assert [r["layer"].split(".")[-3 if arch == "bert" else -2] for r in report["layers"]] == ["1", "2"]
    for row in report["layers"]:
        assert row["error_after"] < row["error_before"], row
    assert "target=" + target in report["calibration"]

    names = [(_BLOCK_NAMES if target == "layer" else _ATTENTION_NAMES)[arch].format(i) for i in (1, 2)]
    held_out = _batches(arch, n=4, seed=1)
    causal = arch == "gpt2"
    plain_errors = _held_out_errors(stock, plain, names, held_out, causal)
    fitted_errors = _held_out_errors(stock, model, names, held_out, causal)
    for name in names:
        assert fitted_errors[name] <= 0.9 * plain_errors[name], (name, plain_errors[name], fitted_errors[name])


def test_calibration_accepts_a_datasets_dataset():
    from datasets import Dataset

    torch.manual_seed(0)
    stock = _stock("bert")
    rows = [{"input_ids": list(range(1, 6 + i % 5))} for i in range(24)]

    def explicit(masked=True):
        # The same rows in batches of 4, padded and masked here by hand; given as a DataLoader so that the global RNG
        # is used as with a Dataset (a DataLoader's iterator draws a seed) and the new parameters start the same.
        batches = []
        for start in range(0, len(rows), 4):
            chunk = [r["input_ids"] for r in rows[start:start + 4]]
            ids = torch.zeros(4, max(map(len, chunk)), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, row in enumerate(chunk):
                ids[j, :len(row)], mask[j, :len(row)] = torch.tensor(row), 1
            batches.append({"input_ids": ids, "attention_mask": mask if masked else torch.ones_like(mask)})
        return torch.utils.data.DataLoader(batches, batch_size=None)

    models = {}
    for name, data in (("dataset", Dataset.from_list(rows)), ("explicit", explicit()), ("unmasked", explicit(False))):
        torch.manual_seed(1)
        models[name] = convert(copy.deepcopy(stock), {"layers": [-1], "low_rank": 4}, calibration_data=data, steps=30,
                               batch_size=4, learning_rate=1e-3, primal_learning_rate=1e-2, progress=False)
    report = models["dataset"].primal_conversion_report
    assert report["calibration"].startswith("6 batches (4 trained on")  # 24 rows / 4, every 5th held out
    assert report["distillation"]["curve"][-1]["step"] == 30
    assert 0 <= report["distillation"]["loss_after"] <= report["distillation"]["loss_before"] < 1e-2
    # Batching from a Dataset pads each batch and derives the attention mask from the row lengths: distillation then
    # runs exactly as on the hand-made batches (same held-out curve, same weights), and not as on the same batches
    # with the padding left unmasked (which shows the comparison sees the mask).
    expected = models["explicit"].primal_conversion_report["distillation"]
    curve = [(c["step"], c["heldout_loss"]) for c in report["distillation"]["curve"]]
    assert [c[0] for c in curve] == [c["step"] for c in expected["curve"]]
    assert [c[1] for c in curve] == pytest.approx([c["heldout_loss"] for c in expected["curve"]], rel=1e-5)
    assert report["distillation"]["loss_after"] == pytest.approx(expected["loss_after"], rel=1e-5)
    explicit_params = dict(models["explicit"].named_parameters())
    for name, param in models["dataset"].named_parameters():
        assert torch.allclose(param, explicit_params[name], atol=1e-6), name
    unmasked = models["unmasked"].primal_conversion_report["distillation"]
    assert unmasked["loss_before"] != pytest.approx(expected["loss_before"], rel=1e-3)


def test_convert_bad_input():
    with pytest.raises(ValueError, match="target='all' is not allowed"):
        convert(_stock("bert"), {"layers": [-1]}, target="all")
    model = convert(_stock("bert"), {"layers": [-1], "low_rank": 3})
    with pytest.raises(ValueError, match="already has primal_attention"):
        convert(model, {"layers": [0]})


def _fresh(code, cwd):
    env = child_env()
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


# Makes `import hf_primal` fail in the child, as on a machine where it is not installed.
_BLOCK = "import sys; sys.modules['hf_primal'] = None\n"


def test_without_plugin_or_trust_remote_code_loading_fails_loudly(tmp_path):
    model = convert(_stock("bert"), {"layers": [-1], "low_rank": 4})
    hf_primal.save_converted(model, tmp_path / "out")
    result = _fresh(f"""
        import transformers
        transformers.AutoModelForSequenceClassification.from_pretrained({str(tmp_path / 'out')!r})
        """, cwd=tmp_path)
    assert result.returncode != 0
    assert "trust_remote_code" in result.stderr


class _FakeHub:
    """Stands in for the Hub: records what would be committed."""

    def __init__(self, root):
        self.root = root
        self.commits = []

    def create_repo(self, repo_id, *args, **kwargs):
        from huggingface_hub import RepoUrl

        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, *args, **kwargs):
        folder = os.path.join(self.root, f"commit{len(self.commits)}")
        for op in operations:
            dest = os.path.join(folder, op.path_in_repo)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            source = op.path_or_fileobj
            if isinstance(source, (str, os.PathLike)):
                shutil.copy(source, dest)
            else:
                with open(dest, "wb") as handle:
                    handle.write(source if isinstance(source, bytes) else source.read())
        self.commits.append((repo_id, sorted(op.path_in_repo for op in operations), folder))
        return None


def _intercept(monkeypatch, tmp_path):
    fake = _FakeHub(str(tmp_path / "hub"))
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, *a, **k: fake.create_repo(repo_id))
    monkeypatch.setattr(
        HfApi, "create_commit", lambda self, repo_id, operations, *a, **k: fake.create_commit(repo_id, operations)
    )
    return fake


def _check_uploaded(folder, tmp_path, expect_tokenizer):
    files = set(os.listdir(folder))
    needed = {"config.json", "model.safetensors", "modeling_primal_bert.py", *REMOTE_CODE_FILES, "README.md"}
    if expect_tokenizer:
        needed |= {"tokenizer.json", "tokenizer_config.json"}
    assert needed <= files, needed - files
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert "primal_attention" in config and "auto_map" in config
    card = open(os.path.join(folder, "README.md")).read()
    assert "Primal-Attention" in card and "trust_remote_code=True" in card and "low_rank s = 4" in card
    result = _fresh(f"""
        import transformers
        m = transformers.AutoModelForSequenceClassification.from_pretrained({folder!r}, trust_remote_code=True)
        assert type(m).__name__ == "PrimalBertForSequenceClassification", type(m)
        """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_model_push_to_hub_uploads_the_shareable_folder(tmp_path, monkeypatch):
    fake = _intercept(monkeypatch, tmp_path)
    model = convert(_stock("bert"), {"layers": [-1], "low_rank": 4}, calibration_data=_batches("bert", 3), steps=5,
                    method="transfer", progress=False)
    model.push_to_hub("someone/primal-bert")
    assert len(fake.commits) == 1 and fake.commits[0][0] == "someone/primal-bert"
    _check_uploaded(fake.commits[0][2], tmp_path, expect_tokenizer=False)
    assert "relative output error" in open(os.path.join(fake.commits[0][2], "README.md")).read()
    # transformers' push_to_hub arguments are honoured: tags reach the card's metadata, next to the model's own.
    model.add_model_tags(["from-trainer"])
    model.push_to_hub("someone/primal-bert", tags=["my-tag"], commit_message="second")
    card = open(os.path.join(fake.commits[1][2], "README.md")).read()
    header = card.split("---")[1]
    assert "- my-tag" in header and "- from-trainer" in header and "- primal-attention" in header
    with pytest.raises(TypeError, match="not_an_argument"):
        model.push_to_hub("someone/primal-bert", not_an_argument=1)


def _minilm():
    from hf_primal.tools.data import minilm_path

    return minilm_path()


def test_cli_convert_with_calibration_and_push(tmp_path, monkeypatch):
    fake = _intercept(monkeypatch, tmp_path)
    src = tmp_path / "src"
    BertForSequenceClassification(bert_config(vocab_size=30522)).save_pretrained(src)
    AutoTokenizer.from_pretrained(_minilm()).save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"sentence number {i} talks about the weather and the city" for i in range(40)))
    from hf_primal.tools.cli import main

    assert main(["convert", str(src), str(tmp_path / "out"), "--layers", "-1", "--low-rank", "4",
                 "--calibration", str(text), "--method", "transfer", "--calibration-steps", "10",
                 "--push-to-hub", "me/converted"]) == 0
    report = json.loads((tmp_path / "out" / "primal_conversion.json").read_text())
    assert report["calibration"].startswith("calib.txt") and len(report["layers"]) == 1
    assert len(fake.commits) == 1
    _check_uploaded(fake.commits[0][2], tmp_path, expect_tokenizer=True)
    assert sorted(os.listdir(tmp_path / "out")) == fake.commits[0][1]


def test_cli_convert_distills_and_the_card_records_it(tmp_path, capsys):
    src = tmp_path / "src"
    torch.manual_seed(0)
    # initializer_range 0.2: with the default 0.02 a tiny random BERT's attention barely changes its output, so
    # there would be nothing to distil.
    BertModel(bert_config(vocab_size=30522, initializer_range=0.2)).save_pretrained(src)
    AutoTokenizer.from_pretrained(_minilm()).save_pretrained(src)
    text = tmp_path / "calib.txt"
    words = "the city weather market river music school garden train letter bright quiet early".split()
    text.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 6)) for i in range(60)))
    from hf_primal.tools.cli import main

    assert main(["convert", str(src), str(tmp_path / "out"), "--low-rank", "4", "--calibration", str(text),
                 "--steps", "40", "--learning-rate", "1e-3", "--batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "primal_conversion.json").read_text())
    d = report["distillation"]
    assert report["method"] == "distill" and d["steps"] == 40 and d["loss_after"] < d["loss_before"]
    assert f"held-out loss {d['loss_before']:.4f} -> {d['loss_after']:.4f}" in printed
    card = (tmp_path / "out" / "README.md").read_text()
    assert "method: distill" in card and f"{d['cosine_after']:.4f}" in card


def test_cli_rejects_bad_layers(capsys):
    from hf_primal.tools.cli import main

    with pytest.raises(SystemExit):
        main(["convert", "a", "b", "--layers", "best"])
    assert "--layers 'best' is not allowed" in capsys.readouterr().err


def test_demo_reduced_mode(tmp_path, capsys):
    from hf_primal.tools.demo import EXAMPLES, run_demo

    results = run_demo(str(tmp_path / "demo"), quick=True)
    printed = capsys.readouterr().out
    steps = [line for line in printed.splitlines() if "/5]" in line]
    assert len(steps) == 5 and all(line.startswith("[smoke test, --quick] [") for line in steps)
    saved = json.loads((tmp_path / "demo" / "demo_results.json").read_text())
    assert saved["cosine_distilled"] == results["cosine_distilled"] and saved["quick"] is True
    assert f"mean cosine = {results['cosine_distilled']:.4f}" in printed
    assert results["primal_layers"] == ["bert.encoder.layer.5.attention.self"]
    # no empty trainer/
    assert not any(os.path.isdir(tmp_path / "demo" / name) for name in os.listdir(tmp_path / "demo"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "demo")
    ids = tokenizer("the weather is lovely today")["input_ids"]
    assert tokenizer.unk_token_id not in ids  # the pitfall: a tokenizer that maps every word to [UNK]
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "demo").eval()
    assert primal_layers(model) == ["bert.encoder.layer.5.attention.self"]
    with torch.no_grad():  # the predictions the demo printed are those of the model it saved
        logits = model(**tokenizer(list(EXAMPLES), padding=True, return_tensors="pt")).logits
    assert [model.config.id2label[int(i)] for i in logits.argmax(-1)] == [results["examples"][t] for t in EXAMPLES]
    card = (tmp_path / "demo" / "README.md").read_text()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in card and "site-packages" not in card


@pytest.mark.parametrize("arch", ["bert", "vit", "gpt2"])
def test_converted_model_returns_attentions_like_its_reloaded_copy(tmp_path, arch):
    # convert() swaps in the shareable Primal* class after construction; output_attentions must still reach every
    # primal layer. transformers registers the outputs a model can record per class when a model is constructed, so
    # a base model (no PreTrainedModel child to fall back on) of a class not built before returned no attentions.
    from transformers import AutoModel, GPT2Model, ViTModel
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    from hf_primal.models import BY_NAME

    torch.manual_seed(0)
    stock = {"bert": lambda: BertModel(bert_config(num_hidden_layers=3)),
             "vit": lambda: ViTModel(vit_config(num_hidden_layers=3)),
             "gpt2": lambda: GPT2Model(gpt2_config(n_layer=3))}[arch]()
    shareable = BY_NAME[arch].shareable_models[type(stock)]
    _CAN_RECORD_REGISTRY.pop(str(shareable), None)  # as in a fresh process
    model = convert(stock, {"layers": "all", "low_rank": 4, "rank_multi": 2}).eval()
    assert type(model) is shareable
    batch = _batches(arch, 1)[0]
    with torch.no_grad():
        attentions = model(**batch, output_attentions=True).attentions
    hf_primal.save_converted(model, tmp_path / "out")
    again = AutoModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        reloaded = again(**batch, output_attentions=True).attentions
    tokens = 17 if arch == "vit" else 12  # ViT: 16 patches + [CLS]
    assert len(attentions) == len(reloaded) == 3
    for mine, theirs in zip(attentions, reloaded):
        assert mine.shape == (4, 4, tokens, tokens) and mine.abs().sum() > 0
        assert torch.equal(mine, theirs)
