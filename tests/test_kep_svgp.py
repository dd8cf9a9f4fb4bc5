"""KEP-SVGP attention (hf_primal/modeling/kep_svgp.py) against the token-by-token reference (tests/reference.py), the
closed-form Gaussian KL of torch.distributions, and its own posterior-mean path."""

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from hf_primal.modeling.kep_svgp import KEPSVGPCore
from hf_primal.modeling.primal import ksvd_objective
from tests.reference import reference_kep_kl, reference_kep_svgp, reference_layer_J
from tests.test_sampling import _padded

H, D, S, P = 2, 4, 3, 5


def _core(covariance, samples=P):
    torch.manual_seed(0)
    core = KEPSVGPCore(H, D, S, samples).double()
    core.covariance = covariance
    with torch.no_grad():
        core.theta.uniform_(-0.5, 0.5)
        core.head_map.bias.normal_()  # a visible bias: padded rows must still come out exactly zero
    return core


def _inputs(batch=3, length=8, mask="right"):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, H, length, D, generator=g, dtype=torch.float64)
    k = torch.randn(batch, H, length, D, generator=g, dtype=torch.float64)
    x = torch.randn(batch, length, H * D, generator=g, dtype=torch.float64)
    valid = _padded([8, 6, 3], length, mask) if mask else torch.ones(batch, length, dtype=torch.bool)
    return q, k, x, valid


def _params(core):
    return (core.We, core.Wr, core.theta, core.m_u, core.tril, core.log_diag, core.head_map.weight, core.head_map.bias)


@pytest.mark.parametrize("covariance", ["reference", "consistent"])
@pytest.mark.parametrize("mask", [None, "right", "left"])
def test_layer_matches_the_token_by_token_reference_on_a_fixed_draw(covariance, mask):
    core = _core(covariance).eval()
    q, k, x, valid = _inputs(mask=mask)
    shape = (3, H, 8, S) if covariance == "reference" else (3, H, 8, S, S)
    eps = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        y, terms = core.noncausal(q, k, x, None if mask is None else valid, eps=eps)
        mean, _ = core.noncausal(q, k, x, None if mask is None else valid)
    expected, e_ref, r_ref = reference_kep_svgp(x, q, k, valid, *_params(core), eps, covariance)
    expected_mean, _, _ = reference_kep_svgp(x, q, k, valid, *_params(core), None, covariance)
    assert (y - expected).abs().max() < 1e-10
    assert (mean - expected_mean).abs().max() < 1e-10
    assert (y - mean).abs().max() > 1e-3  # the draw shows
    # KSVD terms with lambda = exp(theta) (lambda^2 = exp(2 theta)), as a primal layer with Lambda = exp(theta).
    per_seq, _ = reference_layer_J(e_ref, r_ref, valid, core.theta.exp(), core.We, core.Wr)
    assert torch.allclose(ksvd_objective(terms, "sequence"), torch.tensor(per_seq, dtype=torch.float64), atol=1e-9)


def test_reference_kl_is_the_formula_of_the_authors_code():
    core = _core("reference")
    assert float(core.kl_divergence().detach()) == pytest.approx(
        reference_kep_kl(*(t.detach() for t in (core.theta, core.m_u, core.tril, core.log_diag))), rel=1e-12)


def test_consistent_kl_is_the_gaussian_kl_of_what_it_samples():
    core = _core("consistent")
    L = core.factors()  # [h, j, a, i]
    total = 0.0
    for h in range(H):
        prior = MultivariateNormal(torch.zeros(S, dtype=torch.float64),
                                   covariance_matrix=torch.diag((-4 * core.theta[h]).exp()).detach())
        for j in range(S):
            posterior = MultivariateNormal(core.m_u[h, :, j].detach(), scale_tril=L[h, j].detach())
            total += float(kl_divergence(posterior, prior))
    assert float(core.kl_divergence().detach()) == pytest.approx(total, rel=1e-10)
    # ... and its samples have that covariance: noise of v = unit vector a is row a of L_j times eps.
    v = torch.zeros(1, H, 1, S, dtype=torch.float64)
    v[..., 0] = 1.0
    draws = torch.stack([core.noise(v)[0, :, 0] for _ in range(4000)])  # (T, H, s)
    expected_var = L[:, :, 0, :].square().sum(-1)  # Var noise_j = ||L_j[0, :]||^2
    assert torch.allclose(draws.var(0), expected_var.detach(), rtol=0.1)


def test_zero_noise_is_the_posterior_mean_and_eval_is_deterministic_unless_asked():
    core = _core("consistent")
    q, k, x, valid = _inputs()
    with torch.no_grad():
        core.eval()
        mean, _ = core.noncausal(q, k, x, valid)
        zero, _ = core.noncausal(q, k, x, valid, eps=torch.zeros(3, H, 8, S, S, dtype=torch.float64))
        again, _ = core.noncausal(q, k, x, valid)
        core.sample_in_eval = True
        core.generator = torch.Generator().manual_seed(5)
        first, _ = core.noncausal(q, k, x, valid)
        core.generator = torch.Generator().manual_seed(5)
        second, _ = core.noncausal(q, k, x, valid)
        core.sample_in_eval = False
        core.train()
        trained_a, _ = core.noncausal(q, k, x, valid)
        trained_b, _ = core.noncausal(q, k, x, valid)
    assert torch.equal(mean, zero) and torch.equal(mean, again)
    assert torch.equal(first, second) and (first - mean).abs().max() > 1e-3  # seeded draws repeat
    assert (trained_a - trained_b).abs().max() > 1e-3  # training draws afresh
    pad = ~valid
    assert (first.transpose(1, 2)[pad] == 0).all() and (trained_a.transpose(1, 2)[pad] == 0).all()


def test_gp_math_runs_in_fp32_under_low_precision_inputs():
    core = _core("consistent").float()
    with torch.no_grad():
        core.theta.fill_(3.0)  # exp(4 theta) = 1.6e5 * ...: beyond fp16 (max 65504)
    q, k, x, valid = (t.half() if t.is_floating_point() else t for t in _inputs())
    kl = core.half().kl_divergence()
    assert kl.dtype == torch.float32 and torch.isfinite(kl)
    with torch.no_grad():
        y, terms = core.eval().noncausal(q, k, x, valid)
    assert y.dtype == torch.float16 and torch.isfinite(y).all() and torch.isfinite(terms.e_sum).all()


# ------------------------------------------------------------------ in models
KEP = {"layers": [-1], "low_rank": 3, "rank_multi": 2, "variant": "kep_svgp"}


@pytest.mark.parametrize("covariance", ["consistent", "reference"])
def test_bert_layer_is_padding_invariant_and_round_trips_with_and_without_the_plugin(tmp_path, covariance):
    import json

    from transformers import AutoModel, BertModel

    import hf_primal
    from tests.conftest import bert_config
    from tests.test_cli_and_sharing import run_child

    torch.manual_seed(0)
    model = BertModel(bert_config(primal_attention={**KEP, "covariance": covariance})).eval()
    core = model.encoder.layer[-1].attention.self.primal
    assert isinstance(core, KEPSVGPCore) and core.covariance == covariance
    ids = torch.randint(3, 120, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        alone = model(input_ids=ids[1:, :7]).last_hidden_state
    assert (alone[0] - expected[1, :7]).abs().max() < 1e-5  # posterior mean: padding does not leak in
    hf_primal.save_converted(model, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["primal_attention"]
    assert saved["variant"] == "kep_svgp" and saved["covariance"] == covariance
    loaded = AutoModel.from_pretrained(tmp_path / "out").eval()
    assert loaded.encoder.layer[-1].attention.self.primal.covariance == covariance
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).last_hidden_state, expected)
    torch.save({"ids": ids, "mask": mask, "expected": expected}, tmp_path / "batch.pt")
    result = run_child(f"""
        import sys, torch, transformers
        assert sys.modules["hf_primal"] is None
        batch = torch.load({str(tmp_path / 'batch.pt')!r})
        model = transformers.AutoModel.from_pretrained({str(tmp_path / 'out')!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            hidden = model(input_ids=batch["ids"], attention_mask=batch["mask"]).last_hidden_state
        assert torch.equal(hidden, batch["expected"]), (hidden - batch["expected"]).abs().max()
        print("OK")
    """, tmp_path, plugin=False)
    assert "OK" in result.stdout, result.stderr[-3000:]


def test_decoders_and_misplaced_settings_are_refused_by_name():
    from transformers import GPT2LMHeadModel

    from tests.conftest import bert_config, gpt2_config

    with pytest.raises(ValueError, match="variant='kep_svgp' is for encoders only"):
        GPT2LMHeadModel(gpt2_config(primal_attention={"variant": "kep_svgp"}))
    with pytest.raises(ValueError, match=r"\['covariance'\] apply to variant='kep_svgp' only"):
        bert_config(primal_attention={"covariance": "reference"})
    with pytest.raises(ValueError, match="covariance='full' is not allowed"):
        bert_config(primal_attention={"variant": "kep_svgp", "covariance": "full"})


# ------------------------------------------------------------------ training
def _kep_bert(eta_kl, covariance="consistent"):
    from transformers import BertForSequenceClassification

    from tests.conftest import bert_config

    spec = {**KEP, "eta": 0.5, "eta_kl": eta_kl, "covariance": covariance}
    return lambda: BertForSequenceClassification(bert_config(primal_attention=spec))


def _closed_form_kl(model):
    # Sum over KEP layers of sum_{h, j} KL(N(m_u[h, :, j], L_j L_j^T) || N(0, diag(exp(-4 theta_h)))), by autograd.
    total = 0.0
    for module in model.modules():
        if isinstance(module, KEPSVGPCore):
            L = module.factors()
            for h in range(module.num_heads):
                prior = MultivariateNormal(torch.zeros(module.low_rank),
                                           covariance_matrix=torch.diag((-4 * module.theta[h]).exp()))
                for j in range(module.low_rank):
                    total = total + kl_divergence(MultivariateNormal(module.m_u[h, :, j], scale_tril=L[h, j]), prior)
    return total


@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_adds_eta_kl_times_the_kl_once_per_optimizer_step(tmp_path, ga):
    from tests.test_loss_trainer import _cls_dataset, _first_step_grads

    with_kl = _first_step_grads(tmp_path / "a", _kep_bert(0.25), _cls_dataset(), bs=8 // ga, ga=ga)
    without = _first_step_grads(tmp_path / "b", _kep_bert(0.0), _cls_dataset(), bs=8 // ga, ga=ga)
    torch.manual_seed(0)
    model = _kep_bert(0.25)()  # the same initial parameters
    _closed_form_kl(model).backward()
    kl_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert {n.rsplit(".", 1)[-1] for n in kl_grads} == {"theta", "m_u", "tril", "log_diag"}
    for name, grad in with_kl.items():
        if name.startswith("__"):
            continue
        expected = without[name] + 0.25 * kl_grads.get(name, torch.zeros_like(grad))
        assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-6), (name, (grad - expected).abs().max())


def test_trainer_logs_the_kl_and_the_loss_is_the_sum_of_its_terms(tmp_path):
    from hf_primal import PrimalTrainer
    from tests.test_loss_trainer import _args, _cls_dataset

    torch.manual_seed(0)
    model = _kep_bert(0.25)()
    expected_kl = float(_closed_form_kl(model).detach())
    trainer = PrimalTrainer(model=model, args=_args(tmp_path, per_device_train_batch_size=4, max_steps=3,
                                                    logging_steps=1, learning_rate=1e-3),
                            train_dataset=_cls_dataset(n=12))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and logs[0]["kl_loss"] == pytest.approx(expected_kl, rel=1e-5)
    for h in logs:
        assert h["loss"] == pytest.approx(h["task_loss"] + 0.5 * h["ksvd_loss"] + 0.25 * h["kl_loss"], rel=1e-4)


def test_convert_makes_the_last_layer_kep_svgp_and_fitting_lowers_its_held_out_error(tmp_path):
    import copy

    from transformers import AutoModelForSequenceClassification

    import hf_primal
    from tests.test_convert_hub import _batches, _held_out_errors, _stock

    torch.manual_seed(0)
    stock = _stock("bert").eval()
    spec = {"layers": [-1], "low_rank": 4, "rank_multi": 2, "variant": "kep_svgp"}
    torch.manual_seed(1)
    plain = hf_primal.convert(copy.deepcopy(stock), spec).eval()
    torch.manual_seed(1)
    fitted = hf_primal.convert(copy.deepcopy(stock), spec, calibration_data=_batches("bert", seed=0), method="transfer",
                               steps=60, learning_rate=1e-3, target="layer", progress=False).eval()
    assert isinstance(fitted.bert.encoder.layer[-1].attention.self.primal, KEPSVGPCore)
    name = "bert.encoder.layer.2"
    held_out = _batches("bert", n=4, seed=1)
    before = _held_out_errors(stock, plain, [name], held_out, False)[name]
    after = _held_out_errors(stock, fitted, [name], held_out, False)[name]
    assert after <= 0.9 * before, (before, after)
    fitted.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    batch = held_out[0]
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, fitted(**batch).logits)
