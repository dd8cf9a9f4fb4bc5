"""hf_primal.modeling.primal against the loop-by-loop spec in tests/reference.py, and its hand-written backward."""

import copy

import pytest
import torch

from hf_primal.modeling.primal import PrimalCore, ksvd_objective
from hf_primal.modeling.sampling import SAMPLING_RULES, sample_token_indices
from tests.reference import reference_causal, reference_layer_J, reference_noncausal

H, D, S = 3, 4, 5


def _core(causal, samples, dtype=torch.float64):
    core = PrimalCore(H, D, S, samples, causal).to(dtype)
    with torch.no_grad():
        core.Lambda.normal_()  # signed, so that Lambda^2 (not Lambda) is what the terms must use
        core.head_map.bias.normal_()  # a visible bias: padded rows must still come out exactly zero
    return core


def _qk(batch, length, head_major=False, dtype=torch.float64):
    # Token-major (B, N, H, d) storage viewed as (B, H, N, d), as a split projection gives them.
    q = torch.randn(batch, length, H, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, length, H, D, dtype=dtype).transpose(1, 2)
    if head_major:
        q, k = q.contiguous(), k.contiguous()
    return q, k


def _mask(batch, length, kind):
    valid = torch.ones(batch, length, dtype=torch.bool)
    if kind == "right":
        valid[0, length - 3 :] = False
        valid[-1, 2:] = False  # 2 valid tokens, fewer than p: sampled indices repeat
    elif kind == "left":
        valid[0, :4] = False
    return valid


CASES = {  # name: (batch, length, p, mask, head_major)
    "no-mask-index-select": (2, 11, 6, None, False),
    "no-mask-p-equals-n": (2, 7, 7, None, False),
    "right-padding": (3, 9, 6, "right", False),
    "left-padding": (2, 9, 4, "left", False),
    "batch-over-loop-limit": (6, 8, 5, "right", False),
    "head-major-inputs": (2, 8, 5, "left", True),
    # N < p: W_{e|X} from the weight rows summed per token (index_add) instead of the p gathered rows
    "short-no-mask": (2, 5, 8, None, False),
    "short-right-padding": (3, 6, 9, "right", False),
    "short-left-padding-over-loop-limit": (6, 7, 11, "left", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_noncausal_matches_reference(case):
    batch, length, samples, mask, head_major = CASES[case]
    core = _core(False, samples)
    q, k = _qk(batch, length, head_major)
    x = torch.randn(batch, length, H * D, dtype=torch.float64)
    valid = None if mask is None else _mask(batch, length, mask)
    y, terms = core.noncausal(q, k, x, valid)
    full = torch.ones(batch, length, dtype=torch.bool) if valid is None else valid
    y_ref, e_ref, r_ref = reference_noncausal(x, q, k, full, core.We, core.Wr, core.head_map.weight, core.head_map.bias)
    assert y.shape == (batch, H, length, D)
    assert (y - y_ref).abs().max() < 1e-10
    assert torch.all(y.transpose(1, 2)[~full] == 0)  # exactly zero, not just small
    per_seq, whole = reference_layer_J(e_ref, r_ref, full, core.Lambda, core.We, core.Wr)
    expected = torch.tensor(per_seq, dtype=torch.float64)
    assert torch.allclose(ksvd_objective(terms, "sequence").double(), expected, atol=1e-5)
    assert ksvd_objective(terms, "batch").item() == pytest.approx(whole, abs=1e-5)
    assert torch.equal(terms.count, full.sum(1).float() * H)
    # merging heads is a free view of the result (token-major storage)
    assert y.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("mask", [None, "left"])
def test_causal_matches_reference_and_state_continues(mask):
    core = _core(True, 0)
    q, k = _qk(2, 9)
    valid = None if mask is None else _mask(2, 9, mask)
    full = torch.ones(2, 9, dtype=torch.bool) if valid is None else valid
    y, terms, state = core.causal_forward(q, k, valid)
    y_ref, e_ref, r_ref = reference_causal(q, k, full, core.We, core.Wr, core.head_map.weight, core.head_map.bias)
    assert (y - y_ref).abs().max() < 1e-10
    assert torch.all(y.transpose(1, 2)[~full] == 0)
    per_seq, _ = reference_layer_J(e_ref, r_ref, full, core.Lambda, core.We, core.Wr)
    assert torch.allclose(ksvd_objective(terms).double(), torch.tensor(per_seq, dtype=torch.float64), atol=1e-5)
    # The same sequence in two chunks, the second continuing from the first chunk's state.
    cut = 5
    first = None if valid is None else valid[:, :cut]
    second = None if valid is None else valid[:, cut:]
    _, _, mid = core.causal_forward(q[:, :, :cut], k[:, :, :cut], first)
    y2, _, end = core.causal_forward(q[:, :, cut:], k[:, :, cut:], second, mid)
    assert (y2 - y[:, :, cut:]).abs().max() < 1e-10
    for a, b in zip(end, state):
        assert torch.allclose(a, b)
    assert state.sum_q.shape == (2, H, D)
    assert state.sum_q.untyped_storage().nbytes() == state.sum_q.numel() * 8  # its own storage, not a view of the sums


def _gradcheck_inputs(causal, batch, head_major=False, samples=3):
    torch.manual_seed(1)
    length = 5
    core = _core(causal, 0 if causal else samples)
    q, k = _qk(batch, length, head_major)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, -2:] = False
    x = torch.randn(batch, length, H * D, dtype=torch.float64)
    names = [name for name, _ in core.named_parameters()]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, x, *core.parameters())]

    def fn(q, k, x, *params):
        weights = dict(zip(names, params))  # the module's parameters become gradcheck inputs
        if causal:
            y, terms, _ = torch.func.functional_call(core, weights, (q, k), {"valid": valid})
        else:
            y, terms, _ = torch.func.functional_call(core, weights, (q, k), {"x": x, "valid": valid})
        return y, terms.e_sum, terms.r_sum

    return fn, leaves


@pytest.mark.parametrize("causal,batch,head_major,samples", [
    (False, 2, False, 3), (False, 5, False, 3), (False, 1, True, 3), (True, 2, False, 3),
    (False, 2, False, 7),  # N = 5 < p = 7, padded: the per-token summed weights (index_add) path
])
def test_hand_written_backward_matches_finite_differences(causal, batch, head_major, samples):
    fn, leaves = _gradcheck_inputs(causal, batch, head_major, samples)
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, fast_mode=True)


def test_causal_half_precision_long_prefix_stays_finite():
    # Raw prefix sums of 4096 tokens of this size exceed the fp16 range (65504); the fp16 path must use means.
    core = _core(True, 0, dtype=torch.float16)
    q = (30 + torch.randn(1, 4096, H, D)).half().transpose(1, 2)
    k = (30 + torch.randn(1, 4096, H, D)).half().transpose(1, 2)
    y, terms, _ = core.causal_forward(q, k, None)
    assert y.dtype == torch.float16
    assert torch.isfinite(y).all() and torch.isfinite(terms.e_sum).all()
    wide = copy.deepcopy(core).double()
    y64, _, _ = wide.causal_forward(q.double(), k.double(), None)
    assert (y.double() - y64).abs().max() < 2e-2


# ------------------------------------------------------------------ no-graph paths (inference, decoding)
@pytest.mark.parametrize("case", ["no-mask-index-select", "right-padding", "batch-over-loop-limit"])
def test_noncausal_without_autograd_matches_reference_and_graph_path(case):
    # Under no_grad the layer skips the autograd function (no liveness masks, nothing saved): same y and terms.
    batch, length, samples, mask, head_major = CASES[case]
    core = _core(False, samples)
    q, k = _qk(batch, length, head_major)
    x = torch.randn(batch, length, H * D, dtype=torch.float64)
    valid = None if mask is None else _mask(batch, length, mask)
    y_graph, terms_graph = core.noncausal(q, k, x, valid)
    assert y_graph.requires_grad
    with torch.no_grad():
        y, terms = core.noncausal(q, k, x, valid)
    full = torch.ones(batch, length, dtype=torch.bool) if valid is None else valid
    y_ref, _, _ = reference_noncausal(x, q, k, full, core.We, core.Wr, core.head_map.weight, core.head_map.bias)
    assert not y.requires_grad and y.transpose(1, 2).is_contiguous()
    assert (y - y_ref).abs().max() < 1e-10
    assert torch.all(y.transpose(1, 2)[~full] == 0)
    for a, b in zip(terms, terms_graph):
        assert torch.allclose(a, b.detach(), rtol=1e-12, atol=1e-12)


def _decode_inputs(mask, dtype=torch.float64):
    core = _core(True, 0, dtype)
    q, k = _qk(2, 8, dtype=dtype)
    valid = None if mask is None else _mask(2, 8, "left")
    return core, q, k, valid


@pytest.mark.parametrize("mask", [None, "left"])
def test_decode_step_matches_full_forward_and_skips_terms(mask):
    # Token by token from a cached state under no_grad (the decode fast path: no KSVD terms) equals the full
    # forward over the whole sequence and the reference, including a padded (dropped) token fed as a decode step.
    core, q, k, valid = _decode_inputs(mask)
    full = torch.ones(2, 8, dtype=torch.bool) if valid is None else valid
    y_full, _, state_full = core.causal_forward(q, k, valid)
    y_ref, _, _ = reference_causal(q, k, full, core.We, core.Wr, core.head_map.weight, core.head_map.bias)
    with torch.no_grad():
        _, terms, state = core.causal_forward(q[:, :, :1], k[:, :, :1], None if valid is None else valid[:, :1])
        assert terms is not None  # a fresh sequence (no state yet) keeps its terms, e.g. eval with a cache
        steps = []
        for i in range(1, 8):
            y, terms, state = core.causal_forward(
                q[:, :, i : i + 1], k[:, :, i : i + 1], None if valid is None else valid[:, i : i + 1], state
            )
            assert terms is None and y.shape == (2, H, 1, D)
            steps.append(y)
    y_steps = torch.cat(steps, dim=2)
    assert (y_steps - y_full[:, :, 1:]).abs().max() < 1e-10
    assert (y_steps - y_ref[:, :, 1:]).abs().max() < 1e-10
    assert torch.all(y_steps.transpose(1, 2)[~full[:, 1:]] == 0)
    for a, b in zip(state, state_full):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_continuing_a_state_with_autograd_keeps_terms_and_gradients():
    # With grad on, continuing a state is not decoding: the general path runs, with terms and a backward.
    core, q, k, valid = _decode_inputs("left")
    _, _, mid = core.causal_forward(q[:, :, :5], k[:, :, :5], valid[:, :5])
    q2, k2 = q[:, :, 5:6].clone().requires_grad_(), k[:, :, 5:6].clone().requires_grad_()
    y, terms, _ = core.causal_forward(q2, k2, valid[:, 5:6], mid)
    assert terms is not None
    (y.square().sum() + ksvd_objective(terms).sum()).backward()
    assert q2.grad.abs().sum() > 0 and core.Lambda.grad.abs().sum() > 0
    with torch.no_grad():
        y_fast, _, _ = core.causal_forward(q[:, :, 5:6], k[:, :, 5:6], valid[:, 5:6], mid)
    assert (y_fast - y.detach()).abs().max() < 1e-12


def test_decode_step_half_precision_matches_float64():
    core, q, k, _ = _decode_inputs(None, torch.float16)
    with torch.no_grad():
        _, _, state = core.causal_forward(q[:, :, :7], k[:, :, :7], None)
        y, terms, _ = core.causal_forward(q[:, :, 7:], k[:, :, 7:], None, state)
        y64, _, _ = copy.deepcopy(core).double().causal_forward(q.double(), k.double(), None)
    assert terms is None and y.dtype == torch.float16
    assert (y.double() - y64[:, :, 7:]).abs().max() < 1e-2


def test_lambda_reaches_the_output_through_a_zero_tie():
    # DDP with find_unused_parameters needs Lambda on the output's graph; the tie must add exactly zero.
    core = _core(False, 4)
    q, k = _qk(2, 6)
    x = torch.randn(2, 6, H * D, dtype=torch.float64)
    y, _ = core.noncausal(q, k, x, None)
    y.sum().backward()
    assert core.Lambda.grad is not None and torch.all(core.Lambda.grad == 0)
    with torch.no_grad():
        y_plain, _ = core.noncausal(q, k, x, None)
    assert torch.equal(y.detach(), y_plain)


@pytest.mark.parametrize("rule", SAMPLING_RULES)
@pytest.mark.parametrize("mask", [None, "right"])
def test_short_sequences_sum_weights_per_token_like_the_gathered_rows(rule, mask):
    # N < p: the layer sums W_e / W_r rows per token instead of gathering p rows. Same y, terms and gradients as
    # the direct formula X_s^T W_e on the gathered rows (built here with plain autograd ops), for both rules.
    from hf_primal.modeling.sampling import _sample_tokens, sampled_weights, single_token_rule

    batch, length, samples = 3, 6, 10
    core = _core(False, samples)
    core.sampling = rule
    q, k = _qk(batch, length)
    x = torch.randn(batch, length, H * D, dtype=torch.float64, requires_grad=True)
    valid = None if mask is None else _mask(batch, length, mask)
    we_x, wr_x = sampled_weights(x, valid, core.We, core.Wr, rule, torch.float64)
    # The per-token sums rely on every rule giving slots in token order.
    full_valid = torch.ones(batch, length, dtype=torch.bool) if valid is None else valid
    assert torch.all(sample_token_indices(full_valid, samples, single_token_rule(rule, False)).diff(dim=1) >= 0)
    sampled = _sample_tokens(x, valid, samples, rule).reshape(batch, samples, H, D)
    we_ref = torch.einsum("bphd,hps->bhds", sampled, core.We)
    wr_ref = torch.einsum("bphd,hps->bhds", sampled, core.Wr)
    assert (we_x - we_ref).abs().max() < 1e-12 and (wr_x - wr_ref).abs().max() < 1e-12
    g_e, g_r = torch.randn_like(we_ref), torch.randn_like(wr_ref)
    got = torch.autograd.grad((we_x * g_e).sum() + (wr_x * g_r).sum(), (x, core.We, core.Wr))
    want = torch.autograd.grad((we_ref * g_e).sum() + (wr_ref * g_r).sum(), (x, core.We, core.Wr))
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-12
    y, _ = core.noncausal(q, k, x, valid)
    full = torch.ones(batch, length, dtype=torch.bool) if valid is None else valid
    y_ref, _, _ = reference_noncausal(x.detach(), q, k, full, core.We, core.Wr, core.head_map.weight,
                                      core.head_map.bias, rule=rule)
    assert (y - y_ref).abs().max() < 1e-10
