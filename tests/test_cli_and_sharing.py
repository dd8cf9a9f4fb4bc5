"""Shared folders load with every Auto head and without hf_primal; saved primal models never load as softmax models;
tokenizers load without a prompt; the CLI's errors are one line and its --help imports neither torch nor transformers.

Fresh-process checks run `python -c` with `import hf_primal` made to fail, as on a machine without the plugin, and
with stdin closed, so that a "run custom code? [y/N]" prompt shows up as text instead of a hang.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    BertForSequenceClassification,
    BertModel,
    GPT2Model,
    ViTImageProcessor,
    ViTModel,
)

import hf_primal
from hf_primal import PrimalAttentionConfig
from hf_primal.integration.hub import REMOTE_CODE_FILES
from hf_primal.tools.cli import CLIError, build_parser, check_source, main
from tests.conftest import bert_config, child_env, gpt2_config, vit_config

BLOCK_PLUGIN = "import sys; sys.modules['hf_primal'] = None  # `import hf_primal` fails here\n"
PROMPT_MARKERS = ("[y/N]", "custom code", "model of type")


def run_child(code: str, cwd, plugin: bool = False, args=("-c",)) -> subprocess.CompletedProcess:
    env = child_env()
    source = textwrap.dedent(code) if plugin else BLOCK_PLUGIN + textwrap.dedent(code)
    return subprocess.run([sys.executable, *args, source], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)


def _minilm_tokenizer():
    from hf_primal.tools.data import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())


def _text_batch(vocab=120):
    ids = torch.randint(1, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------------------------------------- every Auto head
EXPECTED_AUTO_MAP = {
    "bert": {"AutoConfig", "AutoModel", "AutoModelForPreTraining", "AutoModelForMaskedLM", "AutoModelForCausalLM",
             "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering",
             "AutoModelForMultipleChoice", "AutoModelForNextSentencePrediction", "AutoModelForTextEncoding"},
    "vit": {"AutoConfig", "AutoModel", "AutoModelForImageClassification", "AutoModelForMaskedImageModeling"},
    "gpt2": {"AutoConfig", "AutoModel", "AutoModelForPreTraining", "AutoModelForCausalLM",
             "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"},
}
HEADS = {
    "bert": ["AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModelForMaskedLM"],
    "vit": ["AutoModelForImageClassification"],
    "gpt2": ["AutoModelForSequenceClassification"],
}


def _base_model(arch):
    return {
        "bert": lambda: BertModel(bert_config(num_hidden_layers=3, vocab_size=30522)),
        "vit": lambda: ViTModel(vit_config(num_hidden_layers=3)),
        "gpt2": lambda: GPT2Model(gpt2_config(n_layer=3)),
    }[arch]()


@pytest.mark.parametrize("arch", ["bert", "vit", "gpt2"])
def test_base_conversion_loads_with_every_head_without_plugin(tmp_path, arch):
    model = hf_primal.convert(_base_model(arch), {"layers": [0, -1], "low_rank": 4, "rank_multi": 2}).eval()
    batch = {"pixel_values": torch.randn(2, 3, 16, 16)} if arch == "vit" else _text_batch()
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    hf_primal.save_converted(model, tmp_path / "out", processor=_minilm_tokenizer() if arch == "bert" else None)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert set(config["auto_map"]) == EXPECTED_AUTO_MAP[arch]
    assert all(v.startswith(f"modeling_primal_{arch}.Primal") for v in config["auto_map"].values())
    torch.save(batch, tmp_path / "batch.pt")

    result = run_child(f"""
        import sys, torch, transformers
        assert sys.modules["hf_primal"] is None
        batch = torch.load({str(tmp_path / 'batch.pt')!r})
        found = {{}}
        for head in {HEADS[arch]!r}:
            model = getattr(transformers, head).from_pretrained(
                {str(tmp_path / 'out')!r}, trust_remote_code=True
            ).eval()
            layers = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Primal")
                      and type(m).__name__.endswith("Attention")]
            with torch.no_grad():
                hidden = model.base_model(**batch).last_hidden_state
            found[head] = (type(model).__name__, type(model).__module__, layers, hidden)
        torch.save(found, {str(tmp_path / 'found.pt')!r})
        if {arch == 'bert'}:
            classify = transformers.pipeline(
                "text-classification", model={str(tmp_path / 'out')!r}, trust_remote_code=True
            )
            print("PIPELINE", type(classify.model).__name__, classify("the weather is lovely today")[0]["label"])
        """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    found = torch.load(tmp_path / "found.pt")
    stock_attention = {
        "bert": "PrimalBertSelfAttention", "vit": "PrimalViTAttention", "gpt2": "PrimalGPT2Attention"
    }[arch]
    for head in HEADS[arch]:
        name, module, layers, remote_hidden = found[head]
        assert name.startswith("Primal") and module.startswith("transformers_modules"), (head, name, module)
        assert layers == [stock_attention] * 2, (head, layers)
        assert torch.equal(remote_hidden, hidden), head
    if arch == "bert":
        assert "PIPELINE PrimalBertForSequenceClassification LABEL_" in result.stdout, result.stdout
    # With the plugin the same heads resolve to hf_primal's classes, no remote code.
    if arch == "bert":
        local = AutoModelForTokenClassification.from_pretrained(tmp_path / "out").eval()
        assert type(local).__module__ == "hf_primal.models.bert" and len(hf_primal.primal_layers(local)) == 2
        with torch.no_grad():
            assert torch.equal(local.base_model(**batch).last_hidden_state, hidden)


# ---------------------------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def shared_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    text = hf_primal.convert(BertModel(bert_config(vocab_size=30522)), {"layers": [-1], "low_rank": 4})
    hf_primal.save_converted(text, root / "bert", processor=_minilm_tokenizer())
    image = hf_primal.convert(ViTModel(vit_config()), {"layers": [-1], "low_rank": 4})
    hf_primal.save_converted(image, root / "vit", processor=ViTImageProcessor(size={"height": 16, "width": 16}))
    return root


def _no_prompt(result):
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert not [marker for marker in PROMPT_MARKERS if marker in output], output[-3000:]


def test_processors_load_without_prompt(shared_folders):
    # Without hf_primal: the image processor with plain AutoImageProcessor (preprocessor_config.json names its
    # class), the tokenizer with trust_remote_code=True (AutoTokenizer reads config.json first, see below).
    result = run_child(f"""
        from transformers import AutoImageProcessor, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(shared_folders / 'bert')!r}, trust_remote_code=True)
        assert type(tokenizer).__name__.startswith("BertTokenizer"), type(tokenizer)
        assert tokenizer.unk_token_id not in tokenizer("the weather is lovely")["input_ids"]
        processor = AutoImageProcessor.from_pretrained({str(shared_folders / 'vit')!r})
        assert type(processor).__name__.startswith("ViTImageProcessor"), type(processor)
        """, cwd=shared_folders)
    _no_prompt(result)
    # With hf_primal imported: plain AutoTokenizer.
    result = run_child(f"""
        import hf_primal
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(shared_folders / 'bert')!r})
        assert type(tokenizer).__name__.startswith("BertTokenizer"), type(tokenizer)
        """, cwd=shared_folders, plugin=True)
    _no_prompt(result)


def test_auto_tokenizer_with_trust_remote_code_false_loads_the_stock_tokenizer_without_plugin(shared_folders):
    # What the docs advise for a shared folder's tokenizer where hf_primal is absent: no prompt and no remote code
    # (stdin is closed, so a prompt would fail the child). transformers still warns once about the model type it
    # read from config.json; that warning is the only message.
    result = run_child(f"""
        import sys
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(shared_folders / 'bert')!r}, trust_remote_code=False)
        assert type(tokenizer).__name__.startswith("BertTokenizer"), type(tokenizer)
        assert not [m for m in sys.modules if m.startswith("transformers_modules")], "remote code was imported"
        print(tokenizer("hello world")["input_ids"])
        """, cwd=shared_folders)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "[y/N]" not in output and "custom code" not in output, output[-3000:]
    assert result.stdout.strip() == str(_minilm_tokenizer()("hello world")["input_ids"])


# ---------------------------------------------------------------------------------------------- saved primal models
class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_plain_save_pretrained_writes_the_shareable_form(tmp_path):
    BertForSequenceClassification(bert_config()).save_pretrained(tmp_path / "stock")
    model = BertForSequenceClassification.from_pretrained(
        tmp_path / "stock", primal_attention={"layers": [-1], "low_rank": 4}
    ).eval()
    batch = _text_batch()
    with torch.no_grad():
        logits = model(**batch).logits
    model.save_pretrained(tmp_path / "primal")
    # Saving changes nothing about the model itself (a Trainer checkpoint mid-run must not).
    assert type(model) is BertForSequenceClassification and type(model.config).__name__ == "BertConfig"
    assert model.config.model_type == "bert" and "auto_map" not in model.config.__dict__
    saved = json.loads((tmp_path / "primal" / "config.json").read_text())
    assert saved["model_type"] == "primal_bert" and saved["architectures"] == ["PrimalBertForSequenceClassification"]
    assert set(saved["auto_map"]) == EXPECTED_AUTO_MAP["bert"]
    assert {"modeling_primal_bert.py", *REMOTE_CODE_FILES, "README.md"} <= set(os.listdir(tmp_path / "primal"))
    assert "AutoModelForSequenceClassification.from_pretrained" in (tmp_path / "primal" / "README.md").read_text()

    # With hf_primal: bit-identical through the stock class and the Auto class, and no model-type warning.
    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        for load in (BertForSequenceClassification, AutoModelForSequenceClassification):
            again = load.from_pretrained(tmp_path / "primal").eval()
            with torch.no_grad():
                assert torch.equal(again(**batch).logits, logits), load
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not [m for m in records.messages if "model of type" in m], records.messages

    # Without hf_primal and without trust_remote_code: an error that says what to do, never a softmax model.
    torch.save(batch, tmp_path / "batch.pt")
    result = run_child(f"""
        import torch, transformers
        folder = {str(tmp_path / 'primal')!r}
        for load in (lambda: transformers.AutoModelForSequenceClassification.from_pretrained(folder),
                     lambda: transformers.AutoModel.from_pretrained(folder),
                     lambda: transformers.pipeline("text-classification", model=folder)):
            try:
                model = load()
            except ValueError as error:
                assert "trust_remote_code=True" in str(error), error
                print("REFUSED")
            else:
                raise SystemExit(f"loaded {{type(model).__name__}} without the primal code")
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.save(model(**torch.load({str(tmp_path / 'batch.pt')!r})).logits, {str(tmp_path / 'remote.pt')!r})
        """, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("REFUSED") == 3
    assert torch.equal(torch.load(tmp_path / "remote.pt"), logits)


def test_push_to_hub_of_a_stock_class_primal_model_uploads_the_shareable_folder(tmp_path, monkeypatch):
    from tests.test_convert_hub import _intercept

    fake = _intercept(monkeypatch, tmp_path)
    model = BertForSequenceClassification(bert_config(primal_attention={"layers": [-1], "low_rank": 4}))
    model.push_to_hub("me/primal")
    [(repo_id, files, folder)] = fake.commits
    assert repo_id == "me/primal"
    assert {"config.json", "model.safetensors", "modeling_primal_bert.py", "README.md"} <= set(files)
    assert json.loads(open(os.path.join(folder, "config.json")).read())["model_type"] == "primal_bert"
    # hf_primal's card, not a generic one
    assert "trust_remote_code=True" in open(os.path.join(folder, "README.md")).read()


def test_stock_models_still_save_stock(tmp_path):
    BertModel(bert_config()).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "bert" and "auto_map" not in saved
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".py")]


# ---------------------------------------------------------------------------------------------- CLI
def _cli(args, cwd):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "hf_primal.tools.cli", *args], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["--help"], ["convert", "--help"], ["layers", "--help"], ["demo", "--help"]])
def test_help_answers(tmp_path, args):
    result = _cli(args, tmp_path)
    assert result.returncode == 0 and "usage: hf-primal" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("argv", [["hf-primal", "--help"], ["-m"], ["script.py"]])
def test_import_installs_the_hooks_whatever_argv_holds(tmp_path, argv):
    # `import hf_primal` is the same in every process (the CLI's included): a config built right after it takes
    # `primal_attention` (normalised: the defaults filled in) and the whole API is bound.
    code = (f"import sys; sys.argv = {argv!r}; sys.orig_argv = [sys.executable, '-m', 'hf_primal.tools.cli']\n"
            "import hf_primal\n"
            "from transformers import BertConfig\n"
            "config = BertConfig(primal_attention={'layers': [-1]})\n"
            "print(config.primal_attention.get('low_rank'), sorted(set(hf_primal.__all__) - set(vars(hf_primal))))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(PrimalAttentionConfig().low_rank), "[]"]


def test_every_flag_has_help():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    for name, sub in [("hf-primal", parser), *subparsers.items()]:
        for action in sub._actions:
            if action.option_strings or action.dest not in ("command",):
                assert action.help, f"{name}: {action.option_strings or action.dest} has no help text"


def _one_error_line(result, expected: str):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("hf-primal ") and expected in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args", [
    ["convert", "./no-such-model", "out"],
    ["convert", "~/no-such-model-hf-primal/x", "out"],
    ["convert", os.path.join("no", "such", "model"), "out"],
    ["layers", "./no-such-model"],
])
def test_missing_local_path_is_reported_without_the_hub(tmp_path, args):
    result = _cli(args, tmp_path)
    # A path-like SRC is checked before anything is loaded: the answer names the folder, not a Hub repository.
    _one_error_line(result, f"{args[1]}: no such folder")


def test_folder_without_config_and_file_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    _one_error_line(_cli(["convert", "empty", "out"], tmp_path), "empty: not a model folder (it has no config.json)")
    _one_error_line(_cli(["layers", "file.txt"], tmp_path), "file.txt: is a file")


def test_hub_ids_are_not_mistaken_for_paths(tmp_path, monkeypatch):
    # Relative paths resolve inside an empty folder, so none of them exists whatever the machine has around.
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for hub_id in ("bert-base-uncased", "google/vit-base-patch16-224", "sentence-transformers/all-MiniLM-L6-v2"):
        check_source(hub_id)  # left to transformers (local cache, or the Hub where the network allows)
    for path in ("./x", "../x", "~/x", "/no/such/dir", "a/b/c", "x/"):
        with pytest.raises(CLIError, match="no such folder"):
            check_source(path)


def test_layers_without_primal_layers_fails(tmp_path, capsys):
    BertModel(bert_config()).save_pretrained(tmp_path / "stock")
    capsys.readouterr()  # the save's progress bar
    assert main(["layers", str(tmp_path / "stock")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        f"hf-primal layers: error: no primal layers in {tmp_path / 'stock'} (its config.json has no primal_attention)"
    ]
    BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 4})).save_pretrained(tmp_path / "primal")
    capsys.readouterr()
    assert main(["layers", str(tmp_path / "primal")]) == 0
    assert capsys.readouterr().out.split() == ["encoder.layer.1.attention.self"]


def test_unexpected_error_is_one_line_and_debug_shows_traceback(tmp_path, capsys):
    # ALBERT: an architecture hf_primal does not support
    AlbertModel(AlbertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                             embedding_size=16, vocab_size=50)).save_pretrained(tmp_path / "roberta")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "roberta"), str(tmp_path / "out"), "--low-rank", "4"]) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert line.startswith("hf-primal convert: error: ValueError: Primal-Attention does not support")
    assert line.endswith("(--debug shows the traceback)")
    assert main(["convert", str(tmp_path / "roberta"), str(tmp_path / "out"), "--low-rank", "4", "--debug"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err
