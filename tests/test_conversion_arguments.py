"""ConversionArguments: convert()'s options as one validated object. An options object and the keyword form give the
same conversion, keywords apply on top of an object, bad values and unknown names are refused by name, and convert's
own signature stays short."""

import inspect
import math

import pytest
import torch
from transformers import BertForSequenceClassification

import hf_primal
from hf_primal import ConversionArguments, convert
from tests.conftest import bert_config


def _model():
    torch.manual_seed(0)
    return BertForSequenceClassification(bert_config(num_hidden_layers=2))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(5, 90, (4, 10), generator=g)} for _ in range(5)]


def _converted(*args, **keywords):
    torch.manual_seed(2)
    return convert(_model(), {"layers": [-1], "low_rank": 3}, _batches(), *args, progress=False, **keywords)


def test_an_options_object_and_keywords_give_the_same_conversion():
    options = dict(method="transfer", steps=5, learning_rate=1e-3, layers="last", num_primal_layers=1)
    by_keywords, by_object = _converted(**options), _converted(ConversionArguments(**options))
    for (name, a), (_, b) in zip(by_keywords.named_parameters(), by_object.named_parameters()):
        assert torch.equal(a, b), name
    report = by_object.primal_conversion_report
    assert by_keywords.primal_conversion_report == report
    assert "5 Adam steps per layer (lr 0.001)" in report["calibration"]
    [row] = report["layers"]  # the options took effect: the last layer only, and it was fitted
    assert row["layer"].endswith("layer.1.attention.self") and row["error_after"] < 0.8 * row["error_before"]
    # A keyword applies on top of an object (and the object itself is not changed).
    base = ConversionArguments(steps=2)
    on_top = _converted(base, steps=3)
    assert "3 AdamW steps" in on_top.primal_conversion_report["calibration"] and base.steps == 2


def test_the_learning_rate_defaults_follow_the_method():
    assert ConversionArguments().adapt_learning_rate == 5e-4
    assert ConversionArguments(method="transfer").adapt_learning_rate == 3e-3
    assert ConversionArguments(method="transfer", learning_rate=1e-2).adapt_learning_rate == 1e-2


@pytest.mark.parametrize("field, value", [
    ("method", "copy"), ("target", "all"), ("distill_target", "pooled"), ("steps", -1), ("steps", 1.5),
    ("steps", True), ("batch_size", 0), ("max_batches", 0), ("learning_rate", 0.0),
    ("learning_rate", math.nan), ("primal_learning_rate", math.inf), ("temperature", -1.0), ("pooled_weight", -0.5),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"convert: {field}={value!r}"):
        ConversionArguments(**{field: value})
    with pytest.raises(ValueError, match=rf"convert: {field}={value!r}"):
        convert(_model(), {"layers": [-1]}, progress=False, **{field: value})


def test_zero_is_a_valid_pooled_weight_and_step_count():
    assert ConversionArguments(pooled_weight=0.0, steps=0).steps == 0


def test_unknown_keywords_are_refused_naming_the_options():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['stepz'\].*'steps'"):
        convert(_model(), {"layers": [-1]}, stepz=3)


def test_convert_takes_few_parameters_besides_its_options():
    parameters = inspect.signature(hf_primal.convert).parameters
    assert len([p for p in parameters if p != "args"]) <= 6, list(parameters)
    assert parameters["args"].annotation in (ConversionArguments, "Optional[ConversionArguments]")
