"""hf_primal.predict_with_uncertainty: the summaries recomputed by hand from the T passes (run here one by one with
the documented draw order), reproducibility from the seed, MC dropout on a stock model, and refusals."""

import doctest

import pytest
import torch
from transformers import BertForSequenceClassification

import hf_primal
from hf_primal.modeling.kep_svgp import KEPSVGPCore
from hf_primal.tools import uncertainty, uncertainty_metrics
from tests.conftest import bert_config

KEP = {"layers": [-1], "low_rank": 3, "rank_multi": 2, "variant": "kep_svgp"}


def _model(**kw):
    torch.manual_seed(0)
    # A wide initialisation, so that the untrained head's logits (and the passes' disagreement) are not tiny.
    return BertForSequenceClassification(bert_config(num_labels=3, initializer_range=0.5, **kw)).eval()


def _batch(n=5):
    ids = torch.randint(3, 120, (n, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(n, dtype=torch.long)}


def test_summaries_equal_the_hand_computed_ones_over_the_same_draws():
    model = _model(primal_attention=KEP)
    batch = _batch()
    out = hf_primal.predict_with_uncertainty(model, batch, samples=4, seed=7, batch_size=3)
    # The model is left as it was: eval mode, deterministic posterior mean.
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        a, b = (model(**inputs).logits for _ in range(2))
    assert not model.training and torch.equal(a, b)
    # By hand: batches of 3 then 2 rows, 4 passes each, KEP noise from one generator seeded 7, in that order.
    core = next(m for m in model.modules() if isinstance(m, KEPSVGPCore))
    core.sample_in_eval, core.generator = True, torch.Generator().manual_seed(7)
    runs = []
    with torch.no_grad():
        for rows in (slice(0, 3), slice(3, 5)):
            part = {k: batch[k][rows] for k in ("input_ids", "attention_mask")}
            runs.append(torch.stack([model(**part).logits for _ in range(4)], dim=1))
    core.sample_in_eval, core.generator = False, None
    runs = torch.cat(runs).double()  # (N, T, K)
    probs_t = runs.softmax(-1)
    mean_probs = probs_t.mean(1)

    def entropy(p):
        return -(p * p.log()).sum(-1)

    assert torch.allclose(out.logits.double(), runs.mean(1), atol=1e-6)
    assert torch.allclose(out.probs.double(), runs.mean(1).softmax(-1), atol=1e-6)
    assert torch.allclose(out.mean_probs.double(), mean_probs, atol=1e-6)
    assert torch.allclose(out.predictive_entropy.double(), entropy(mean_probs), atol=1e-5)
    assert torch.allclose(out.expected_entropy.double(), entropy(probs_t).mean(1), atol=1e-5)
    information = (entropy(mean_probs) - entropy(probs_t).mean(1)).clamp(min=0)
    assert torch.allclose(out.mutual_information.double(), information, atol=1e-5)
    assert (out.mutual_information > 1e-6).all()  # the posterior draws disagree
    assert torch.allclose(out.variance.double(), probs_t.var(1, unbiased=False), atol=1e-6)


def test_same_seed_same_result_other_seed_other_draws_one_pass_no_mutual_information():
    model = _model(primal_attention=KEP)
    first = hf_primal.predict_with_uncertainty(model, _batch(), samples=3, seed=1)
    again = hf_primal.predict_with_uncertainty(model, _batch(), samples=3, seed=1)
    other = hf_primal.predict_with_uncertainty(model, _batch(), samples=3, seed=2)
    single = hf_primal.predict_with_uncertainty(model, _batch(), samples=1, seed=1)
    assert torch.equal(first.probs, again.probs) and not torch.equal(first.probs, other.probs)
    assert torch.equal(single.mutual_information, torch.zeros(5)) and torch.equal(single.variance, torch.zeros(5, 3))


def test_mc_dropout_on_a_stock_model_and_refusals():
    stock = _model(hidden_dropout_prob=0.3)
    with pytest.raises(ValueError, match="has no KEP-SVGP layer"):
        hf_primal.predict_with_uncertainty(stock, _batch())
    with pytest.raises(ValueError, match="samples=0 is not allowed"):
        hf_primal.predict_with_uncertainty(stock, _batch(), samples=0, mc_dropout=True)
    out = hf_primal.predict_with_uncertainty(stock, _batch(), samples=6, seed=0, mc_dropout=True)
    assert (out.mutual_information > 0).all() and not stock.training
    # Metrics take the result directly.
    labels = torch.tensor([0, 1, 2, 0, 1])
    report = uncertainty_metrics.uncertainty_report(out.probs, labels)
    assert 0 <= report["ece"] <= 1 and report["accuracy"] == uncertainty_metrics.accuracy(out.probs, labels)


def test_docstring_examples_run():
    for module in (uncertainty, uncertainty_metrics):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_the_user_guide_example_runs(capsys):
    import re
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "user-guide.md").read_text()
    section = guide.split("## Uncertainty (KEP-SVGP)", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "user-guide.md", "exec"), scope)
    out = scope["out"]
    assert out.probs.shape == (4, 3) and torch.allclose(out.probs.sum(-1), torch.ones(4, dtype=out.probs.dtype))
    assert (out.mutual_information >= 0).all() and "tensor" in capsys.readouterr().out
