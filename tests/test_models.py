"""BERT, ViT and GPT-2 with primal layers: gradients, spec parity, masks, causality, loading, saving.

Checks run for every registered architecture (parity, padding, load report, fresh-process and remote-code round
trips, generation) are in tests/test_architectures.py; these are the architecture-specific ones."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertForSequenceClassification,
    BertLMHeadModel,
    BertModel,
    GPT2LMHeadModel,
    GPT2Model,
    ViTForImageClassification,
)
from transformers.models.bert.modeling_bert import BertSelfAttention

from hf_primal import primal_layers
from tests.conftest import bert_config, capture_layer_io, gpt2_config, vit_config
from tests.reference import reference_causal, reference_gammas, reference_noncausal

ARCHS = {
    "bert": (lambda **kw: BertForSequenceClassification(bert_config(**kw)), "bert"),
    "vit": (lambda **kw: ViTForImageClassification(vit_config(**kw)), "vit"),
    "gpt2": (lambda **kw: GPT2LMHeadModel(gpt2_config(**kw)), "gpt2"),
}


def _inputs(arch, batch=3, length=9):
    if arch == "vit":
        return {"pixel_values": torch.randn(batch, 3, 16, 16), "labels": torch.tensor([0, 1, 2])[:batch]}
    ids = torch.randint(1, 120, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 6:] = 0
    if arch == "bert":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 0])[:batch]}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.parametrize("layers", ["all", [-1]])
@pytest.mark.parametrize("arch", ["bert", "vit", "gpt2"])
def test_forward_backward_every_primal_parameter_gets_gradient(arch, layers):
    model = ARCHS[arch][0](primal_attention={"layers": layers, "low_rank": 4, "rank_multi": 2})
    names = primal_layers(model)
    assert len(names) == (2 if layers == "all" else 1)
    out = model(**_inputs(arch))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    checked = 0
    for name, param in model.named_parameters():
        if ".primal." in name and not name.endswith("Lambda"):  # Lambda enters only the KSVD loss
            assert param.grad is not None, name
            assert torch.isfinite(param.grad).all(), name
            assert param.grad.abs().sum() > 0, name
            checked += 1
    assert checked == 4 * len(names)


# ------------------------------------------------------------------ parity with docs/method.md
def _merge(y):
    return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)


def _split(t, heads):
    B, N, C = t.shape
    return t.view(B, N, heads, C // heads).transpose(1, 2)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_bert_layer_matches_spec_section_2(padding_side):
    model = BertModel(bert_config(primal_attention={"layers": "all", "low_rank": 5, "rank_multi": 2})).eval()
    attn = model.encoder.layer[1].attention.self
    store, handle = capture_layer_io(attn)
    ids = torch.randint(1, 120, (3, 14))
    mask = torch.ones(3, 14, dtype=torch.long)
    if padding_side == "right":
        mask[1, 9:] = 0
        mask[2, 3:] = 0  # shorter than p = 10: indices repeat
    else:
        mask[1, :5] = 0
        mask[2, :11] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    x = store["x"]
    q, k = _split(attn.query(x), 4), _split(attn.key(x), 4)
    core = attn.primal
    y, _, _ = reference_noncausal(x, q, k, mask.bool(), core.We, core.Wr, core.head_map.weight, core.head_map.bias,
                              rule=core.sampling)
    assert (store["out"].double() - _merge(y)).abs().max() <= 1e-5


def test_gpt2_layer_matches_spec_section_3_with_left_padding():
    model = GPT2Model(gpt2_config(primal_attention={"layers": "all", "low_rank": 5})).eval()
    attn = model.h[1].attn
    store, handle = capture_layer_io(attn)
    ids = torch.randint(1, 120, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    x = store["x"]
    w, b = attn.c_attn.weight, attn.c_attn.bias
    qkv = x @ w + b
    q, k = _split(qkv[..., :32], 4), _split(qkv[..., 32:64], 4)
    core = attn.primal
    y, _, _ = reference_causal(q, k, mask.bool(), core.We, core.Wr, core.head_map.weight, core.head_map.bias,
                               gammas=reference_gammas(4))
    expected = attn.c_proj(_merge(y).float())
    real = mask.bool()
    assert (store["out"][real] - expected[real]).abs().max() <= 1e-5


def test_causal_bert_decoder_matches_spec_section_3():
    model = BertLMHeadModel(bert_config(is_decoder=True, primal_attention={"layers": [0], "low_rank": 3})).eval()
    attn = model.bert.encoder.layer[0].attention.self
    assert attn.primal.causal and attn.primal.We.shape == (4, 8, 3)
    store, handle = capture_layer_io(attn)
    ids = torch.randint(1, 120, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    handle.remove()
    x = store["x"]
    q, k = _split(attn.query(x), 4), _split(attn.key(x), 4)
    core = attn.primal
    y, _, _ = reference_causal(q, k, mask.bool(), core.We, core.Wr, core.head_map.weight, core.head_map.bias,
                               gammas=reference_gammas(4))
    assert (store["out"].double() - _merge(y)).abs().max() <= 1e-5


# ------------------------------------------------------------------ masks
def _single_vs_padded(model, ids, length, side, pos_for_left=False):
    """Outputs of one sequence alone vs the same sequence padded inside a batch."""
    total = ids.shape[1]
    pad = total - length
    mask = torch.zeros(2, total, dtype=torch.long)
    batch = torch.randint(1, 120, (2, total))
    if side == "right":
        batch[0, :length] = ids[0, :length]
        mask[0, :length] = 1
        real = slice(0, length)
    else:
        batch[0, pad:] = ids[0, :length]
        mask[0, pad:] = 1
        real = slice(pad, total)
    mask[1] = 1
    kwargs = {}
    if pos_for_left:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(input_ids=ids[:, :length]).last_hidden_state[0]
        padded = model(input_ids=batch, attention_mask=mask, **kwargs).last_hidden_state[0, real]
    return (alone - padded).abs().max()


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_gpt2_left_padding_invariance(attn_impl):
    config = gpt2_config(primal_attention={"layers": "all", "low_rank": 4})
    config._attn_implementation = attn_impl
    model = GPT2Model(config).eval()
    ids = torch.randint(1, 120, (1, 16))
    for length in (5, 12):
        assert _single_vs_padded(model, ids, length, "left", pos_for_left=True) <= 1e-5


def test_padding_outputs_are_zero_inside_the_primal_layer():
    model = BertModel(bert_config(primal_attention={"layers": [-1], "low_rank": 4})).eval()
    store, handle = capture_layer_io(model.encoder.layer[1].attention.self)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    with torch.no_grad():
        model(input_ids=torch.randint(1, 120, (2, 8)), attention_mask=mask)
    handle.remove()
    assert store["out"][0, 5:].abs().max() == 0
    assert store["out"][0, :5].abs().max() > 0


@pytest.mark.parametrize("layers", ["all", [-1]])
def test_gpt2_causality(layers):
    model = GPT2LMHeadModel(gpt2_config(primal_attention={"layers": layers, "low_rank": 4})).eval()
    ids = torch.randint(1, 120, (2, 12))
    changed = ids.clone()
    t = 6
    changed[:, t + 1:] = torch.randint(1, 120, (2, 12 - t - 1))
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(input_ids=changed).logits
    assert (a[:, : t + 1] - b[:, : t + 1]).abs().max() <= 1e-6
    assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 1e-3


# ------------------------------------------------------------------ output_attentions
def test_output_attentions_gives_the_primal_kernel_not_probabilities():
    # Values against an independent computation: tests/test_transformers_contract.py.
    config = bert_config(primal_attention={"layers": [-1], "low_rank": 4})
    config._attn_implementation = "eager"
    model = BertModel(config).eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(1, 120, (2, 6)), output_attentions=True)
    assert len(out.attentions) == 2
    assert out.attentions[0].shape == out.attentions[1].shape == (2, 4, 6, 6)
    assert torch.allclose(out.attentions[0].sum(-1), torch.ones(2, 4, 6))  # softmax layer
    assert not torch.allclose(out.attentions[1].sum(-1), torch.ones(2, 4, 6), atol=1e-2)  # primal kernel


# ------------------------------------------------------------------ loading and saving
def test_from_pretrained_reuses_qk_and_output_weights_bit_exactly(tmp_path):
    stock = BertModel(bert_config())
    stock.save_pretrained(tmp_path)
    model, info = AutoModelForSequenceClassification.from_pretrained(
        tmp_path, primal_attention={"layers": [-1], "low_rank": 4}, output_loading_info=True
    )
    old, new = stock.encoder.layer[1].attention, model.bert.encoder.layer[1].attention
    for a, b in [(old.self.query, new.self.query), (old.self.key, new.self.key), (old.output.dense, new.output.dense)]:
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not hasattr(new.self, "value")
    assert hasattr(model.bert.encoder.layer[0].attention.self, "value")
    primal = {
        f"bert.encoder.layer.1.attention.self.primal.{n}"
        for n in ("We", "Wr", "Lambda", "head_map.weight", "head_map.bias")
    }
    assert info["missing_keys"] == primal | {"classifier.weight", "classifier.bias"}
    assert info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert "primal.We" not in json.dumps(sorted(info["unexpected_keys"]))
    # New primal parameters are initialised per docs/method.md, not left as garbage.
    We = model.bert.encoder.layer[1].attention.self.primal.We
    assert torch.allclose(We.flatten(1) @ We.flatten(1).T, torch.eye(4), atol=1e-5)
    lam = model.bert.encoder.layer[1].attention.self.primal.Lambda
    assert ((lam >= 0) & (lam < 1)).all() and lam.std() > 0


def _run_fresh(code: str, cwd) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, cwd=cwd, timeout=300)


# ------------------------------------------------------------------ importing changes nothing else
def test_models_without_option_are_stock_bit_for_bit(tmp_path):
    BertForSequenceClassification(bert_config()).save_pretrained(tmp_path / "bert")
    GPT2LMHeadModel(gpt2_config()).save_pretrained(tmp_path / "gpt2")
    ids = torch.randint(1, 120, (2, 7))
    torch.save(ids, tmp_path / "ids.pt")
    _run_fresh(  # a process that never imports hf_primal
        f"""
        import sys, torch, transformers
        ids = torch.load({str(tmp_path / 'ids.pt')!r})
        b = transformers.AutoModelForSequenceClassification.from_pretrained({str(tmp_path / 'bert')!r}).eval()
        g = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'gpt2')!r}).eval()
        with torch.no_grad():
            torch.save((b(input_ids=ids).logits, g(input_ids=ids).logits), {str(tmp_path / 'stock.pt')!r})
        assert "hf_primal" not in sys.modules
        """,
        cwd=tmp_path,
    )
    b = AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert").eval()
    g = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    assert primal_layers(b) == [] and primal_layers(g) == []
    assert all(type(layer.attention.self) is BertSelfAttention for layer in b.bert.encoder.layer)
    with torch.no_grad():
        ours = (b(input_ids=ids).logits, g(input_ids=ids).logits)
    stock = torch.load(tmp_path / "stock.pt")
    assert torch.equal(ours[0], stock[0]) and torch.equal(ours[1], stock[1])


def test_unselected_layers_run_stock_code(tmp_path):
    BertModel(bert_config(num_hidden_layers=3)).save_pretrained(tmp_path)
    stock = BertModel.from_pretrained(tmp_path).eval()
    hybrid = BertModel.from_pretrained(tmp_path, primal_attention={"layers": [-1], "low_rank": 4}).eval()
    assert [type(layer.attention.self) is BertSelfAttention for layer in hybrid.encoder.layer] == [True, True, False]
    ids = torch.randint(1, 120, (2, 9))
    with torch.no_grad():
        a = stock(input_ids=ids, output_hidden_states=True).hidden_states
        b = hybrid(input_ids=ids, output_hidden_states=True).hidden_states
    for i in range(3):  # embeddings and the two canonical layers
        assert torch.equal(a[i], b[i])
    assert not torch.allclose(a[3], b[3])
