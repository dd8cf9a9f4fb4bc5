"""progressive_conversion: stages in the given order, trained weights carried over, the stock model untouched."""

import pytest
import torch
from transformers import BertForSequenceClassification

import hf_primal
from hf_primal import PrimalAttentionConfig
from hf_primal.modeling.model_card import _conversion_section
from tests.conftest import bert_config


def _teacher(layers=4):
    torch.manual_seed(0)
    return BertForSequenceClassification(bert_config(num_hidden_layers=layers, num_labels=3)).eval()


def _primal_params(model, layer):
    return [p for name, p in model.named_parameters() if f"layer.{layer}." in name and ".primal." in name]


def test_stages_follow_the_order_and_carry_what_the_caller_trained():
    teacher = _teacher()
    stock_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    spec = {"low_rank": 2, "rank_multi": 1}
    seen = []
    for stage, student in enumerate(hf_primal.progressive_conversion(teacher, spec, order=[2, 0, -1], progress=False)):
        layers = PrimalAttentionConfig.coerce(student.config.primal_attention).layers
        if seen:  # the layers of the stage before carry what was trained on them; the new one starts fresh
            assert all(bool((p == stage).all()) for layer in seen[-1] for p in _primal_params(student, layer))
            new = set(layers) - set(seen[-1])
            assert all(not bool((p == stage).all()) for layer in new for p in _primal_params(student, layer))
            assert torch.allclose(student.classifier.weight, teacher.classifier.weight + stage)  # the rest too
        seen.append(list(layers))
        with torch.no_grad():  # what a training run would change: every primal weight, and the head
            for layer in layers:
                for p in _primal_params(student, layer):
                    p.fill_(stage + 1)
            student.classifier.weight.add_(1.0)
    assert seen == [[2], [0, 2], [0, 2, 3]]  # in the order given (not sorted); -1 is the top layer
    assert student.primal_conversion_report["progressive"] == [[2], [0], [3]]
    assert "layers in this order, trained after each stage: 2 -> 0 -> 3" in "\n".join(
        _conversion_section(student.primal_conversion_report))
    assert hf_primal.primal_layers(student) == [f"bert.encoder.layer.{i}.attention.self" for i in (0, 2, 3)]
    assert getattr(teacher.config, "primal_attention", None) is None  # the stock model stays stock
    assert not hf_primal.primal_layers(teacher)
    assert all(torch.equal(v, stock_state[k]) for k, v in teacher.state_dict().items())


def test_one_stage_of_several_layers_is_a_plain_conversion():
    teacher = _teacher()
    spec = {"low_rank": 2, "rank_multi": 1}
    (student,) = list(hf_primal.progressive_conversion(teacher, spec, order=[[2, 0, 3]], progress=False))
    student_state = student.state_dict()
    direct = hf_primal.convert(_teacher(), {**spec, "layers": [0, 2, 3]}, progress=False)
    # Same layers, and everything but the freshly initialised primal weights equals a direct conversion.
    assert student.config.primal_attention["layers"] == direct.config.primal_attention["layers"] == [0, 2, 3]
    shared = [k for k in direct.state_dict() if ".primal." not in k]
    assert shared and all(torch.equal(student_state[k], direct.state_dict()[k]) for k in shared)
    assert "progressively" not in "\n".join(_conversion_section(student.primal_conversion_report))


@pytest.mark.parametrize("order, message", [
    ([], "order=[] is not allowed"),
    ([4], "layer 4 in order=[4] is not allowed: the model has 4 layers"),
    ([0, -4], "layer -4 appears twice"),
    ([[1], []], "has an empty stage"),
    (["1"], "'1' in order=['1'] is not allowed: a stage is a layer index"),
    (3, "order=3 is not allowed"),
])
def test_a_bad_order_is_refused_at_the_call_naming_it(order, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hf_primal.progressive_conversion(_teacher(), {"low_rank": 2}, order=order)


def test_layers_given_elsewhere_or_an_already_primal_model_are_refused():
    teacher = _teacher()
    with pytest.raises(ValueError, match="config layers='all' is not allowed"):
        hf_primal.progressive_conversion(teacher, {"layers": "all"}, order=[0])
    with pytest.raises(ValueError, match="num_primal_layers=2 is not allowed here"):
        hf_primal.progressive_conversion(teacher, None, order=[0], num_primal_layers=2)
    with pytest.raises(ValueError, match="layers='last' is not allowed here"):
        hf_primal.progressive_conversion(teacher, None, order=[0], args=hf_primal.ConversionArguments(layers="last"))
    converted = hf_primal.convert(_teacher(), {"layers": [0], "low_rank": 2}, progress=False)
    with pytest.raises(ValueError, match="already has primal_attention"):
        hf_primal.progressive_conversion(converted, None, order=[1])


def test_each_stage_gets_the_conversion_options_and_the_report_keeps_only_what_describes_it():
    import numpy as np

    teacher = _teacher()
    batches = [{"input_ids": torch.randint(1, 99, (4, 8))} for _ in range(5)]
    methods = []
    for student in hf_primal.progressive_conversion(teacher, {"low_rank": 2, "rank_multi": 1}, order=[np.int64(3), 1],
                                                    calibration_data=batches, method="transfer", steps=1,
                                                    progress=False):
        report = student.primal_conversion_report
        methods.append(report["method"])
        # The figures of the adapted copy (per-layer errors, verdict) are gone: its weights were replaced.
        assert set(report) == {"method", "calibration", "progressive"}
    assert methods == ["transfer", "transfer"] and report["progressive"] == [[3], [1]]


def test_docstring_example_runs():
    import doctest

    from hf_primal.tools import progressive

    result = doctest.testmod(progressive, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_the_last_stage_saves_and_reloads_with_its_stages_on_the_card(tmp_path):
    from transformers import AutoModelForSequenceClassification

    teacher = _teacher(layers=3)
    for student in hf_primal.progressive_conversion(teacher, {"low_rank": 2, "rank_multi": 1}, order=[2, [1, 0]],
                                                    progress=False):
        with torch.no_grad():
            student.classifier.bias.add_(0.5)  # stands in for training: the saved folder must carry it
    hf_primal.save_converted(student, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "trained after each stage: 2 -> 1 0" in card
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(1, 99, (2, 12))
    assert torch.allclose(reloaded(input_ids=ids).logits, student.eval()(input_ids=ids).logits, atol=1e-6)
    assert hf_primal.primal_layers(reloaded) == hf_primal.primal_layers(student)
