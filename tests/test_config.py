"""PrimalAttentionConfig: defaults, serialisation, and one clear error per bad input."""

import json
import re

import pytest
import torch
from transformers import AlbertConfig, AlbertModel, AutoModel, BertConfig, BertModel

from hf_primal import PrimalAttentionConfig, primal_layers
from hf_primal.models import ARCHITECTURES
from tests.conftest import bert_config, gpt2_config, vit_config


def test_defaults_are_primal_plus():
    cfg = PrimalAttentionConfig()
    assert cfg.layers == [-1] and cfg.low_rank == 30 and cfg.rank_multi == 10 and cfg.eta == 0.1
    assert cfg.ksvd_reduction == "sequence"


def test_dict_round_trip_and_json():
    cfg = PrimalAttentionConfig(layers=[0, -1], low_rank=7, rank_multi=3, eta=0.5)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert PrimalAttentionConfig.from_dict(data) == cfg


def test_stored_as_plain_dict_in_config_json(tmp_path):
    config = bert_config(primal_attention=PrimalAttentionConfig(layers="all", low_rank=4))
    assert config.primal_attention == PrimalAttentionConfig(layers="all", low_rank=4).to_dict()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["primal_attention"]["layers"] == "all" and saved["primal_attention"]["low_rank"] == 4


def test_config_assignment_after_creation_is_serialised_as_dict():
    config = bert_config()
    config.primal_attention = PrimalAttentionConfig(low_rank=3)
    assert config.to_dict()["primal_attention"]["low_rank"] == 3


def test_no_option_means_no_attribute_in_config_json(tmp_path):
    bert_config().save_pretrained(tmp_path)
    assert "primal_attention" not in json.loads((tmp_path / "config.json").read_text())


def test_resolve_layers_negative_and_all():
    assert PrimalAttentionConfig(layers=[-1, 0]).resolve_layers(4) == [0, 3]
    assert PrimalAttentionConfig(layers="all").resolve_layers(3) == [0, 1, 2]


# ---------------------------------------------------------------- one test per bad input
def _raises(match, fn):
    with pytest.raises(ValueError, match=match):
        fn()


def test_low_rank_below_one():
    _raises(r"low_rank=0 .*integer >= 1", lambda: PrimalAttentionConfig(low_rank=0))


def test_rank_multi_below_one():
    _raises(r"rank_multi=-2 .*integer >= 1", lambda: PrimalAttentionConfig(rank_multi=-2))


def test_eta_negative():
    _raises(r"eta=-0.1 .*>= 0", lambda: PrimalAttentionConfig(eta=-0.1))


def test_eta_nan():
    _raises(r"eta=nan", lambda: PrimalAttentionConfig(eta=float("nan")))


def test_layers_wrong_type():
    _raises(r"layers=3 \(type int\)", lambda: PrimalAttentionConfig(layers=3))
    _raises(r"layers='last'", lambda: PrimalAttentionConfig(layers="last"))
    _raises(r"layers=\[0.5\]", lambda: PrimalAttentionConfig(layers=[0.5]))


def test_layers_duplicated():
    _raises(r"duplicated", lambda: PrimalAttentionConfig(layers=[1, 1]))


def test_layers_duplicated_after_resolution():
    _raises(r"names the same layer twice", lambda: BertModel(bert_config(primal_attention={"layers": [1, -1]})))


def test_layers_out_of_range():
    _raises(
        r"index 5 is out of range .* 2 attention layers",
        lambda: BertModel(bert_config(primal_attention={"layers": [5]})),
    )


def test_unknown_field():
    _raises(r"unknown field\(s\) \['rank'\]", lambda: bert_config(primal_attention={"rank": 3}))


def test_bad_value_at_config_creation_names_field():
    _raises(r"low_rank=0", lambda: bert_config(primal_attention={"low_rank": 0}))


def test_hidden_size_not_heads_times_head_dim():
    # ViT allows an explicit head_dim; 4 heads x 6 != 32.
    config = vit_config(primal_attention={"layers": [-1]})
    config.head_dim = 6
    from transformers import ViTModel

    _raises(r"hidden_size == num_heads \* head_dim.*hidden_size=32, num_heads=4, head_dim=6", lambda: ViTModel(config))


def _albert_config(**kw):  # ALBERT: an architecture hf_primal does not support
    return AlbertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                        embedding_size=16, vocab_size=50, **kw)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError) as err:
        AlbertModel(_albert_config(primal_attention={"layers": [-1]}))
    message = str(err.value)
    assert "AlbertModel" in message and "'albert'" in message
    for supported in ARCHITECTURES:
        assert supported.name in message


def test_unsupported_architecture_via_from_pretrained(tmp_path):
    AlbertModel(_albert_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not support AlbertModel"):
        AutoModel.from_pretrained(tmp_path, primal_attention={"layers": [-1]})


def test_checkpoint_primal_shapes_disagree(tmp_path):
    # transformers' own loader refuses mismatched shapes (its load report names each primal tensor); hf_primal
    # needs no private hook for it. With ignore_mismatched_sizes=True the requested shapes are re-initialised.
    BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 4})).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        BertModel.from_pretrained(tmp_path, primal_attention={"layers": [-1], "low_rank": 5})
    model = BertModel.from_pretrained(tmp_path, primal_attention={"layers": [-1], "low_rank": 5},
                                      ignore_mismatched_sizes=True)
    core = model.encoder.layer[1].attention.self.primal
    assert tuple(core.We.shape) == (4, 50, 5) and torch.isfinite(core.We).all()


def test_all_entry_points_accept_dict_and_dataclass(tmp_path):
    from transformers import AutoModelForSequenceClassification

    BertModel(bert_config()).save_pretrained(tmp_path)
    for option in ({"layers": [-1], "low_rank": 4}, PrimalAttentionConfig(layers=[-1], low_rank=4)):
        m1 = AutoModelForSequenceClassification.from_pretrained(tmp_path, primal_attention=option)
        m2 = AutoModel.from_config(bert_config(primal_attention=option))
        m3 = BertModel(bert_config(primal_attention=option))
        for model in (m1, m2, m3):
            names = primal_layers(model)
            assert len(names) == 1 and re.search(r"encoder\.layer\.1\.attention\.self$", names[0])
            assert model.config.primal_attention["low_rank"] == 4


@pytest.mark.parametrize("make", [gpt2_config, vit_config])
def test_from_config_other_architectures(make):
    model = AutoModel.from_config(make(primal_attention={"layers": "all", "low_rank": 3}))
    assert len(primal_layers(model)) == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_class_level_default_spec_is_saved_and_reloaded(tmp_path, monkeypatch):
    # transformers' own model tests (run with hf_primal on) set the spec as a BertConfig class default; saving must
    # write it, although the shareable config class the folder is written with defaults it to None.
    monkeypatch.setattr(BertConfig, "primal_attention", {"layers": "all", "low_rank": 4, "rank_multi": 2})
    model = BertModel(bert_config()).eval()
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(BertConfig, "primal_attention", None)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["primal_attention"]["low_rank"] == 4 and saved["model_type"] == "primal_bert"
    again = AutoModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 120, (2, 9))
    assert len(primal_layers(again)) == 2
    assert torch.equal(model(ids).last_hidden_state, again(ids).last_hidden_state)
