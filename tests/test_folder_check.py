"""A primal folder whose config.json lost its primal_attention entry is refused, with the plugin and through remote
code alone, with an error naming the folder, the tensors found and the fix; stock folders and the documented fix
(primal_attention=... passed to from_pretrained) still load."""

import json

import pytest
import torch
from transformers import AutoModel, BertModel

import hf_primal
from hf_primal.modeling.folder_check import primal_tensor_names
from tests.conftest import bert_config
from tests.test_cli_and_sharing import run_child

SPEC = {"layers": [-1], "low_rank": 3}


def _saved(tmp_path, drop_entry=True, model_type=None, variant="primal"):
    spec = SPEC if variant == "primal" else {**SPEC, "variant": variant}
    model = BertModel(bert_config(primal_attention=spec)).eval()
    folder = tmp_path / "out"
    hf_primal.save_converted(model, folder)
    config = json.loads((folder / "config.json").read_text())
    if drop_entry:
        del config["primal_attention"]
    if model_type:
        config["model_type"] = model_type
        config.pop("auto_map", None)
    (folder / "config.json").write_text(json.dumps(config))
    return model, folder


@pytest.mark.parametrize("variant,count", [("primal", 5), ("kep_svgp", 8)])
def test_primal_tensor_names_lists_exactly_the_primal_core_tensors(tmp_path, variant, count):
    model, folder = _saved(tmp_path, drop_entry=False, variant=variant)
    expected = sorted(n for n, _ in model.named_parameters() if ".primal." in n)
    assert primal_tensor_names(str(folder)) == expected and len(expected) == count
    BertModel(bert_config()).save_pretrained(tmp_path / "stock")
    assert primal_tensor_names(str(tmp_path / "stock")) == []


@pytest.mark.parametrize("model_type", [None, "bert"])  # as saved (primal_bert) and hand-edited to the stock type
def test_a_folder_without_its_entry_is_refused_with_the_plugin(tmp_path, model_type):
    model, folder = _saved(tmp_path, model_type=model_type)
    for load in (BertModel.from_pretrained, AutoModel.from_pretrained):
        with pytest.raises(ValueError) as error:
            load(folder)
        message = str(error.value)
        assert str(folder) in message and "no 'primal_attention' entry" in message
        assert "encoder.layer.1.attention.self.primal.Lambda" in message and "5 primal-attention tensors" in message
        assert '"primal_attention": {"layers": [1], ...}' in message and "pass primal_attention=" in message
    # The documented fix loads the very model that was saved.
    restored = BertModel.from_pretrained(folder, primal_attention=SPEC).eval()
    ids = torch.randint(1, 120, (2, 7))
    with torch.no_grad():
        assert torch.equal(restored(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


def test_stock_folders_still_load(tmp_path):
    BertModel(bert_config()).save_pretrained(tmp_path / "stock")
    assert type(BertModel.from_pretrained(tmp_path / "stock")).__name__ == "BertModel"


def test_a_folder_without_its_entry_is_refused_by_the_remote_code_alone(tmp_path):
    _, folder = _saved(tmp_path)
    result = run_child(f"""
        import sys, transformers
        assert sys.modules["hf_primal"] is None
        try:
            transformers.AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        except ValueError as error:
            print("REFUSED", error)
        else:
            print("LOADED")
        """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout and str(folder) in result.stdout, result.stdout[-2000:]
    assert "5 primal-attention tensors" in result.stdout and "pass primal_attention=" in result.stdout


def test_a_save_that_fails_part_way_leaves_the_previous_folder_as_it_was(tmp_path, monkeypatch):
    from hf_primal.integration import hub

    first = BertModel(bert_config(primal_attention=SPEC)).eval()
    folder = tmp_path / "out"
    hf_primal.save_converted(first, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    second = BertModel(bert_config(primal_attention={"layers": [0, 1], "low_rank": 2})).eval()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hub, "write_remote_code", crash)  # after the weights, before the code, config and card
    with pytest.raises(OSError, match="disk full"):
        hf_primal.save_converted(second, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind
    loaded = AutoModel.from_pretrained(folder).eval()
    ids = torch.randint(1, 120, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, first(input_ids=ids).last_hidden_state)
    # A new folder whose save fails holds nothing that loads.
    with pytest.raises(OSError, match="disk full"):
        hf_primal.save_converted(second, tmp_path / "new")
    assert not (tmp_path / "new" / "config.json").exists()


def test_a_save_over_a_sharded_one_leaves_no_stale_shards(tmp_path):
    model = BertModel(bert_config(primal_attention=SPEC)).eval()
    folder = tmp_path / "out"
    hf_primal.save_converted(model, folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    hf_primal.save_converted(model, folder)
    assert sorted(p.name for p in folder.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    assert type(AutoModel.from_pretrained(folder)).__name__ == "PrimalBertModel"


@pytest.mark.parametrize("change", [{"window": 4}, {"sampling": "learned"}])
def test_a_folder_from_a_newer_hf_primal_that_this_one_cannot_read_is_refused_naming_both_versions(tmp_path, change):
    model, folder = _saved(tmp_path, drop_entry=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["hf_primal_version"] == hf_primal.__version__  # every save records its writer
    config["primal_attention"].update(change)
    config["hf_primal_version"] = "9.0.0"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        AutoModel.from_pretrained(folder)
    message = str(error.value)
    assert f"saved by hf_primal 9.0.0, newer than this hf_primal {hf_primal.__version__}" in message
    assert next(iter(change)) in message and "upgrade hf_primal" in message
    # Known fields from a newer writer load as usual.
    config["primal_attention"] = {**config["primal_attention"], **{k: v for k, v in SPEC.items()}}
    config["primal_attention"].pop("window", None)
    config["primal_attention"]["sampling"] = "even"
    (folder / "config.json").write_text(json.dumps(config))
    assert type(AutoModel.from_pretrained(folder)).__name__ == "PrimalBertModel"


def test_package_and_setup_versions_agree():
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert re.search(r'version="([^"]+)"', setup).group(1) == hf_primal.__version__
