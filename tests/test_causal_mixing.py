"""causal_mixing="decay" (docs/method.md, "Causal layer"): per-head decayed sums of q and k, against the loop-by-loop
reference in tests/reference.py, a plain recurrence, and the decoding, packing and config contracts."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_primal  # noqa: F401  (GPT2Config takes primal_attention)
from hf_primal.modeling.cache import cache_kwarg
from hf_primal.modeling.config import PrimalAttentionConfig, saved_config_dict
from hf_primal.modeling.kernel import decayed_cumsum, segment_starts
from hf_primal.modeling.primal import PrimalCore, ksvd_objective
from tests.reference import reference_causal, reference_gammas, reference_layer_J

H, D, S = 4, 5, 3


def _core(mixing="decay"):
    core = PrimalCore(H, D, S, 0, True).double()
    core.causal_mixing = mixing
    with torch.no_grad():
        core.Lambda.normal_()
        core.head_map.bias.normal_()
    return core


def _inputs(batch=3, length=10, mask="left"):
    q = torch.randn(batch, length, H, D, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(batch, length, H, D, dtype=torch.float64).transpose(1, 2)
    valid = torch.ones(batch, length, dtype=torch.bool)
    if mask == "left":
        valid[0, :3] = False
    elif mask == "inside":  # padding between valid tokens must neither add to the sums nor age them
        valid[1, 2:5] = False
        valid[2, -2:] = False
    return q, k, valid


@pytest.mark.parametrize("heads", [1, 2, 12])
def test_schedule_is_the_documented_one(heads):
    core = PrimalCore(heads, D, S, 0, True)
    core.causal_mixing = "decay"
    expected = torch.tensor(reference_gammas(heads), dtype=torch.float64)
    assert torch.allclose(core.log_decay(torch.device("cpu")).exp(), expected, rtol=1e-12)
    core.causal_mixing = "prefix_mean"
    assert core.log_decay(torch.device("cpu")) is None


@pytest.mark.parametrize("mask", ["none", "left", "inside"])
def test_decayed_layer_matches_reference_and_continues_its_state(mask):
    core = _core()
    q, k, valid = _inputs(mask=mask)
    y, terms, state = core.causal_forward(q, k, valid)
    y_ref, e_ref, r_ref = reference_causal(q, k, valid, core.We, core.Wr, core.head_map.weight, core.head_map.bias,
                                           gammas=reference_gammas(H))
    assert (y - y_ref).abs().max() < 1e-10
    assert torch.all(y.transpose(1, 2)[~valid] == 0)
    per_seq, _ = reference_layer_J(e_ref, r_ref, valid, core.Lambda, core.We, core.Wr)
    assert torch.allclose(ksvd_objective(terms).double(), torch.tensor(per_seq, dtype=torch.float64), atol=1e-8)
    # It is not the prefix mean: the reference without decay differs.
    y_mean, _, _ = reference_causal(q, k, valid, core.We, core.Wr, core.head_map.weight, core.head_map.bias)
    assert (y - y_mean).abs().max() > 1e-2
    # In two chunks, the second continuing the first one's state (with autograd: the general path).
    _, _, mid = core.causal_forward(q[:, :, :6], k[:, :, :6], valid[:, :6])
    y2, _, end = core.causal_forward(q[:, :, 6:], k[:, :, 6:], valid[:, 6:], mid)
    assert (y2 - y[:, :, 6:]).abs().max() < 1e-10
    for a, b in zip(end, state):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", ["none", "inside"])
def test_decode_steps_equal_the_full_forward(mask):
    core = _core()
    q, k, valid = _inputs(mask=mask)
    y_full, _, state_full = core.causal_forward(q, k, valid)
    with torch.no_grad():
        _, _, state = core.causal_forward(q[:, :, :1], k[:, :, :1], valid[:, :1])
        steps = []
        for i in range(1, q.shape[2]):
            y, terms, state = core.causal_forward(q[:, :, i:i + 1], k[:, :, i:i + 1], valid[:, i:i + 1], state)
            assert terms is None  # the decode fast path
            steps.append(y)
    assert (torch.cat(steps, dim=2) - y_full[:, :, 1:]).abs().max() < 1e-10
    for a, b in zip(state, state_full):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def _recurrence(v, keep, gammas, starts=None):
    """S_i = gamma^keep_i * S_{i-1} + v_i, restarting at segment starts: the plain loop."""
    out = torch.zeros_like(v, dtype=torch.float64)
    for b in range(v.shape[0]):
        for h in range(v.shape[1]):
            total = torch.zeros(v.shape[-1], dtype=torch.float64)
            for i in range(v.shape[2]):
                if starts is not None and int(starts[b, i]) == i:
                    total = torch.zeros_like(total)
                total = gammas[h] ** float(keep[b, i]) * total + v[b, h, i].double()
                out[b, h, i] = total
    return out


def test_long_sums_cross_chunks_without_overflow_and_restart_at_packed_segments():
    # 700 tokens at gamma = 0.5 do not fit one chunk of gamma^-t in float64: several chunks, each continuing the last.
    torch.manual_seed(0)
    gammas = [0.5, 0.9, 0.999]
    log_decay = torch.log(torch.tensor(gammas, dtype=torch.float64))
    v = torch.randn(2, 3, 700, 2, dtype=torch.float64)
    keep = torch.ones(2, 700, dtype=torch.float64)
    keep[1, 100:180] = 0
    v = v * keep[:, None, :, None]
    sums = decayed_cumsum(v, keep, log_decay)
    assert torch.isfinite(sums).all()
    assert torch.allclose(sums, _recurrence(v, keep, gammas), rtol=1e-9, atol=1e-9)
    segments = torch.zeros(2, 700, dtype=torch.long)
    segments[:, 250:] = 1
    segments[0, 600:] = 2
    starts = segment_starts(segments)
    packed = decayed_cumsum(v, keep, log_decay, starts)
    assert torch.allclose(packed, _recurrence(v, keep, gammas, starts), rtol=1e-9, atol=1e-9)


def test_packed_rows_equal_their_sequences_run_alone():
    core = _core()
    q, k, _ = _inputs(batch=1, length=12, mask="none")
    segments = torch.tensor([[0] * 5 + [1] * 7])
    y, _, _ = core.causal_forward(q, k, None, segments=segments)
    first, _, _ = core.causal_forward(q[:, :, :5], k[:, :, :5], None)
    second, _, _ = core.causal_forward(q[:, :, 5:], k[:, :, 5:], None)
    assert (y - torch.cat([first, second], dim=2)).abs().max() < 1e-10


def test_config_default_validation_and_saved_folders():
    assert PrimalAttentionConfig().causal_mixing == "decay"
    assert PrimalAttentionConfig().to_dict()["causal_mixing"] == "decay"
    with pytest.raises(ValueError, match=r"causal_mixing='ema'.*\['decay', 'prefix_mean'\]"):
        PrimalAttentionConfig(causal_mixing="ema")
    # Saved before the field existed: the prefix mean it was trained with; saved with it: what it says.
    old = saved_config_dict({"primal_attention": {"layers": "all", "sampling": "even"}})
    assert old["primal_attention"]["causal_mixing"] == "prefix_mean"
    new = saved_config_dict({"primal_attention": {"layers": "all", "sampling": "even", "causal_mixing": "decay"}})
    assert new["primal_attention"]["causal_mixing"] == "decay"


def _gpt2(**primal):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=64, bos_token_id=49,
                        eos_token_id=49, primal_attention={"layers": "all", "low_rank": 4, **primal})
    return GPT2LMHeadModel(config).eval()


def test_gpt2_default_decays_and_round_trips_its_rule(tmp_path):
    model = _gpt2()
    cores = [block.attn.primal for block in model.transformer.h]
    assert [core.causal_mixing for core in cores] == ["decay", "decay"]
    ids = torch.randint(0, 49, (2, 12))
    logits = model(ids).logits
    mean_model = _gpt2(causal_mixing="prefix_mean")
    assert (mean_model(ids).logits - logits).abs().max() > 1e-4  # same weights, other rule: other outputs
    model.save_pretrained(tmp_path / "decay")
    mean_model.save_pretrained(tmp_path / "mean")
    for name, expected in (("decay", logits), ("mean", mean_model(ids).logits)):
        loaded = GPT2LMHeadModel.from_pretrained(tmp_path / name).eval()
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-6)
    # Incremental decoding with the cache equals recomputation.
    out = model(ids[:, :7], use_cache=True)
    rest = model(ids[:, 7:], **{cache_kwarg(): out.past_key_values}).logits
    assert torch.allclose(rest, logits[:, 7:], atol=1e-5)

