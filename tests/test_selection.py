"""layer_sensitivity and convert(layers="auto" / "last", num_primal_layers=K)."""

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

import hf_primal
from hf_primal import convert, layer_sensitivity, primal_layers
from tests.conftest import bert_config
from tests.test_convert_hub import _batches, _fresh

SPEC = {"low_rank": 4, "rank_multi": 2, "eta": 0.1}


def _model_with_a_critical_layer(critical: int, layers: int = 4) -> BertForSequenceClassification:
    """A tiny BERT whose attention in layer `critical` dominates the residual stream.

    Its value and attention-output weights are scaled up, so what the softmax attention of that layer computes
    (and a primal layer, which has no value projection, cannot) carries most of the hidden state: converting it is
    destructive, converting any other layer is not.
    """
    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config(num_hidden_layers=layers))
    block = model.bert.encoder.layer[critical]
    with torch.no_grad():
        block.attention.self.value.weight.mul_(6.0)
        block.attention.output.dense.weight.mul_(6.0)
    return model


@pytest.mark.parametrize("critical", [1, 2])
def test_sensitivity_ranks_the_destructive_layer_last_and_is_stable(critical):
    model = _model_with_a_critical_layer(critical)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    runs = [layer_sensitivity(model, _batches("bert", n=10), SPEC, steps=8, progress=False) for _ in range(2)]
    assert runs[0].ranking[-1] == critical
    assert runs[0].ranking == runs[1].ranking
    assert [c.loss_after for c in runs[0].costs] == pytest.approx([c.loss_after for c in runs[1].costs], rel=1e-6)
    costs = {c.index: c.loss_after for c in runs[0].costs}
    others = [costs[i] for i in costs if i != critical]
    assert costs[critical] > 2 * max(others)  # a clear margin, not a tie broken by index
    assert runs[0].costs[critical].layer == f"bert.encoder.layer.{critical}.attention.self"
    # The measured model is left untouched.
    assert model.config.primal_attention is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_auto_converts_exactly_the_cheapest_layers_and_they_save_and_reload(tmp_path):
    critical = 2
    sensitivity = layer_sensitivity(_model_with_a_critical_layer(critical), _batches("bert", n=10), SPEC, steps=8,
                                    progress=False)
    expected = sensitivity.cheapest(2)
    assert critical not in expected
    model = convert(_model_with_a_critical_layer(critical), SPEC, _batches("bert", n=10), layers="auto",
                    num_primal_layers=2, sensitivity_steps=8, steps=6, progress=False)
    assert primal_layers(model) == [f"bert.encoder.layer.{i}.attention.self" for i in expected]
    assert model.config.primal_attention["layers"] == expected
    selection = model.primal_conversion_report["layer_selection"]
    assert selection["chosen"] == expected and selection["ranking"] == sensitivity.ranking

    out = tmp_path / "auto"
    hf_primal.save_converted(model, out)
    card = (out / "README.md").read_text()
    assert "Layer selection" in card and str(sensitivity.ranking) in card
    model.eval()
    batch = _batches("bert", n=1, seed=7)[0]
    with torch.no_grad():
        want = model(**batch).logits
    reloaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert primal_layers(reloaded) == primal_layers(model)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, want, rtol=1e-5, atol=1e-6)
    torch.save({"batch": batch, "want": want}, tmp_path / "io.pt")
    # Without hf_primal: the folder's remote code builds the same primal layers.
    result = _fresh(f"""
        import torch, transformers
        model = transformers.AutoModelForSequenceClassification.from_pretrained({str(out)!r},
                                                                               trust_remote_code=True).eval()
        io = torch.load({str(tmp_path / 'io.pt')!r})
        names = [n for n, m in model.named_modules() if getattr(m, "_is_primal_attention", False)]
        with torch.no_grad():
            err = (model(**io["batch"]).logits - io["want"]).abs().max().item()
        print(repr(names), err)
        """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    names, err = result.stdout.strip().rsplit(" ", 1)
    assert eval(names) == primal_layers(model)
    assert float(err) < 1e-5
    assert json.loads((out / "config.json").read_text())["primal_attention"]["layers"] == expected


def test_last_converts_the_last_k_layers():
    model = convert(BertForSequenceClassification(bert_config(num_hidden_layers=4)), SPEC, layers="last",
                    num_primal_layers=3, progress=False)
    assert primal_layers(model) == [f"bert.encoder.layer.{i}.attention.self" for i in (1, 2, 3)]


@pytest.mark.parametrize("k", [0, 5, -1, 2.0, True])
def test_bad_number_of_layers_names_the_allowed_range(k):
    model = BertForSequenceClassification(bert_config(num_hidden_layers=4))
    with pytest.raises(ValueError, match=rf"num_primal_layers={k!r} is not allowed.*1 \.\. 4"):
        convert(model, SPEC, _batches("bert"), layers="auto", num_primal_layers=k, progress=False)
    assert model.config.primal_attention is None


def test_bad_layer_choices_are_refused():
    model = BertForSequenceClassification(bert_config(num_hidden_layers=4))
    with pytest.raises(ValueError, match="layers='best' is not allowed"):
        convert(model, SPEC, layers="best", progress=False)
    with pytest.raises(ValueError, match="needs layers='auto' or 'last'"):
        convert(model, SPEC, layers=[0], num_primal_layers=1, progress=False)
    with pytest.raises(ValueError, match="calibration_data"):
        convert(model, SPEC, layers="auto", num_primal_layers=1, progress=False)
    with pytest.raises(ValueError, match="steps=0"):
        layer_sensitivity(model, _batches("bert"), SPEC, steps=0)
    assert model.config.primal_attention is None


def test_cli_converts_the_measured_layers(tmp_path, capsys):
    from transformers import AutoTokenizer, BertModel

    from hf_primal.tools.cli import main
    from hf_primal.tools.data import minilm_path

    src = tmp_path / "src"
    torch.manual_seed(0)
    BertModel(bert_config(vocab_size=30522, num_hidden_layers=3, initializer_range=0.2)).save_pretrained(src)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(src)
    text = tmp_path / "calib.txt"
    words = "the city weather market river music school garden train letter bright quiet early".split()
    text.write_text("\n".join(" ".join(words[(i * 5 + j) % len(words)] for j in range(4 + i % 5)) for i in range(40)))
    assert main(["convert", str(src), str(tmp_path / "out"), "--low-rank", "4", "--calibration", str(text),
                 "--layers", "auto", "--num-primal-layers", "2", "--sensitivity-steps", "3", "--steps", "3",
                 "--batch-size", "8"]) == 0
    report = json.loads((tmp_path / "out" / "primal_conversion.json").read_text())
    chosen = report["layer_selection"]["chosen"]
    assert chosen == sorted(report["layer_selection"]["ranking"][:2])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["primal_attention"]["layers"] == chosen
    assert f"converted {chosen}" in capsys.readouterr().out
    for argv, message in ((["--layers", "auto"], "needs --num-primal-layers"),
                          (["--layers", "0", "--num-primal-layers", "1"], "needs --layers auto or last"),
                          (["--layers", "auto", "--num-primal-layers", "7"], r"num_primal_layers=7 is not allowed")):
        assert main(["convert", str(src), str(tmp_path / "bad"), "--calibration", str(text), *argv]) == 1
        assert message in capsys.readouterr().err
