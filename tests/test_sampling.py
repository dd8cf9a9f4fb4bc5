"""Sampling of the p tokens that build W_{e|X} (docs/method.md, "Sampling"): the "even" rule for short inputs, the
"legacy" rule of hf_primal 0.1, parity of both with tests/reference.py, and configs saved before the field existed."""

import json

import pytest
import torch
from transformers import AutoModel, BertModel

from hf_primal import PrimalAttentionConfig
from hf_primal.modeling.config import saved_config_dict
from hf_primal.modeling.primal import ksvd_objective
from hf_primal.modeling.sampling import sample_token_indices
from tests.conftest import bert_config
from tests.reference import (
    reference_layer_J,
    reference_noncausal,
    reference_sample_ranks,
    reference_slot_runs,
)
from tests.test_primal_math import D, H, _core, _qk


def _padded(lengths, total, side):
    valid = torch.zeros(len(lengths), total, dtype=torch.bool)
    for b, length in enumerate(lengths):
        if side == "right":
            valid[b, :length] = True
        else:
            valid[b, total - length:] = True
    return valid


@pytest.mark.parametrize("p", [1, 2, 7, 10, 30])
def test_even_rule_gives_every_valid_token_floor_or_ceil_slots(p):
    lengths = list(range(1, 34))
    total = 36
    right = sample_token_indices(_padded(lengths, total, "right"), p)
    left = sample_token_indices(_padded(lengths, total, "left"), p)
    legacy = sample_token_indices(_padded(lengths, total, "right"), p, "legacy")
    for b, length in enumerate(lengths):
        ranks = right[b].tolist()  # right padding: position == rank
        assert ranks == sorted(ranks) and all(0 <= r < length for r in ranks)
        # Left padding picks the same tokens: the same ranks, shifted by the padding.
        assert (left[b] - (total - length)).tolist() == ranks
        counts = torch.bincount(right[b], minlength=length)[:length]
        if length <= p:
            assert int(counts.min()) == p // length and int(counts.max()) == -(-p // length), (length, counts)
        else:  # L > p: unchanged, p distinct evenly spaced tokens from the first to the last
            assert torch.equal(right[b], legacy[b])
            assert len(set(ranks)) == p and (p == 1 or (ranks[0] == 0 and ranks[-1] == length - 1))
        assert int(counts.sum()) == p


def test_legacy_rule_is_the_old_one_and_differs_for_short_inputs():
    # p = 10 slots, L = 4 tokens: old rule floor(j * 3 / 9) gives the last token one slot, the others three.
    valid = _padded([4], 6, "right")
    assert sample_token_indices(valid, 10, "legacy").tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 3]]
    assert sample_token_indices(valid, 10, "even").tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 3, 3]]
    allowed = "\\['even', 'legacy', 'jitter'\\]"
    with pytest.raises(ValueError, match=f"sampling rule 'random' is not allowed: use one of {allowed}"):
        sample_token_indices(valid, 10, "random")


@pytest.mark.parametrize("rule", ["even", "legacy"])
@pytest.mark.parametrize("mask", [None, "right", "left"])
def test_primal_core_matches_the_reference_under_both_rules(rule, mask):
    batch, length, samples = 3, 5, 8  # every sequence shorter than p: the rules differ
    core = _core(False, samples)
    core.sampling = rule
    q, k = _qk(batch, length)
    x = torch.randn(batch, length, H * D, dtype=torch.float64)
    valid = None if mask is None else _padded([5, 3, 1], length, mask)
    y, terms = core.noncausal(q, k, x, valid)
    full = torch.ones(batch, length, dtype=torch.bool) if valid is None else valid
    y_ref, e_ref, r_ref = reference_noncausal(x, q, k, full, core.We, core.Wr, core.head_map.weight,
                                              core.head_map.bias, rule=rule)
    assert (y - y_ref).abs().max() < 1e-10
    other, _, _ = reference_noncausal(x, q, k, full, core.We, core.Wr, core.head_map.weight, core.head_map.bias,
                                      rule="legacy" if rule == "even" else "even")
    assert (y - other).abs().max() > 1e-3  # the rules are told apart by these inputs
    per_seq, _ = reference_layer_J(e_ref, r_ref, full, core.Lambda, core.We, core.Wr)
    expected_j = torch.tensor(per_seq, dtype=torch.float64)
    assert torch.allclose(ksvd_objective(terms, "sequence").double(), expected_j, atol=1e-6)


def test_reference_rule_counts():
    # The reference's own statement of the rule, checked by hand on one case: 7 slots over 3 tokens -> 3, 2, 2.
    assert reference_sample_ranks(3, 7, "even") == [0, 0, 0, 1, 1, 2, 2]
    assert reference_sample_ranks(3, 7, "legacy") == [0, 0, 0, 1, 1, 1, 2]


def test_new_configs_use_segment_means_and_old_saved_configs_keep_legacy():
    assert PrimalAttentionConfig().sampling == "segment_mean"
    assert PrimalAttentionConfig.coerce({"layers": "all"}).sampling == "segment_mean"  # a dict a user writes
    assert PrimalAttentionConfig().to_dict()["sampling"] == "segment_mean"  # always written
    old = {"model_type": "primal_bert", "primal_attention": {"layers": [-1], "low_rank": 4, "rank_multi": 10,
                                                             "eta": 0.1, "ksvd_reduction": "sequence"}}
    assert saved_config_dict(old)["primal_attention"]["sampling"] == "legacy"
    assert "sampling" not in old["primal_attention"]  # the caller's dict is left alone
    new = {"primal_attention": {"layers": [-1], "sampling": "segment_mean", "causal_mixing": "decay"}}
    assert saved_config_dict(new) == new
    with pytest.raises(ValueError, match="PrimalAttentionConfig.sampling='uniform' is not allowed: use one of"):
        PrimalAttentionConfig(sampling="uniform")


@pytest.mark.parametrize("rule", ["segment_mean", "jitter"])
def test_the_new_rules_equal_even_on_inputs_shorter_than_p(rule):
    # Why changing the default leaves short-input results (sentences, the conversion benchmark) unchanged: with
    # fewer valid tokens than slots every run holds one token, so each rule is the even rule, training or not.
    core = _core(False, 12)
    q, k = _qk(3, 11)
    x = torch.randn(3, 11, H * D, dtype=torch.float64)
    valid = _padded([11, 6, 1], 11, "left")
    core.sampling = "even"
    even, _ = core.noncausal(q, k, x, valid)
    core.sampling = rule
    for mode in (core.train, core.eval):
        mode()
        assert torch.equal(core.noncausal(q, k, x, valid)[0], even)


def test_checkpoint_saved_without_the_field_loads_with_the_legacy_rule(tmp_path):
    spec = {"layers": "all", "low_rank": 4, "rank_multi": 3}  # p = 12 > the 5 tokens below
    model = BertModel(bert_config(primal_attention={**spec, "sampling": "legacy"})).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["primal_attention"]["sampling"] == "legacy"
    del config["primal_attention"]["sampling"]  # as hf_primal 0.1 wrote it
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = torch.randint(1, 120, (2, 5))
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
    # Through the Auto classes (shareable config) and through the stock class (patched get_config_dict) alike.
    for loaded in (AutoModel.from_pretrained(tmp_path).eval(), BertModel.from_pretrained(tmp_path).eval()):
        assert loaded.config.primal_attention["sampling"] == "legacy"
        assert {layer.attention.self.primal.sampling for layer in loaded.encoder.layer} == {"legacy"}
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).last_hidden_state, expected)
    # The same weights under the new rule compute something else on these short inputs.
    even = AutoModel.from_pretrained(tmp_path, primal_attention={**spec, "sampling": "even"}).eval()
    with torch.no_grad():
        assert (even(input_ids=ids).last_hidden_state - expected).abs().max() > 1e-4


# ------------------------------------------------------------------ segment_mean and jitter
def test_segment_means_equal_hand_computed_means_under_either_padding():
    from hf_primal.modeling.sampling import segment_means

    x = torch.arange(7 * 2, dtype=torch.float64).reshape(1, 7, 2) ** 1.5  # 7 distinct tokens, 2 channels
    # p = 3 over L = 7: runs of ranks [0, 1], [2, 3], [4, 5, 6] (floor(7/3) = 2, floor(14/3) = 4).
    expected = torch.stack([x[0, 0:2].mean(0), x[0, 2:4].mean(0), x[0, 4:7].mean(0)])[None]
    assert torch.allclose(segment_means(x, None, 3), expected, atol=1e-12)
    for side in ("right", "left"):
        padded = torch.full((1, 10, 2), 1e6, dtype=torch.float64)  # padding that would show in any mean
        valid = _padded([7], 10, side)
        padded[valid] = x[0]
        assert torch.allclose(segment_means(padded, valid, 3), expected, atol=1e-9), side
    # Fewer tokens than slots: each slot holds the token the even rule gives it (L = 2, p = 3 -> ranks 0, 0, 1).
    assert torch.equal(segment_means(x[:, :2], None, 3), x[:, [0, 0, 1]])


@pytest.mark.parametrize("mask", [None, "right", "left"])
def test_segment_mean_core_matches_the_reference(mask):
    batch, length, samples = 3, 17, 5  # lengths 17, 9 >= p and 3 < p
    core = _core(False, samples)
    core.sampling = "segment_mean"
    q, k = _qk(batch, length)
    x = torch.randn(batch, length, H * D, dtype=torch.float64)
    valid = None if mask is None else _padded([17, 9, 3], length, mask)
    y, terms = core.noncausal(q, k, x, valid)
    full = torch.ones(batch, length, dtype=torch.bool) if valid is None else valid
    args = (x, q, k, full, core.We, core.Wr, core.head_map.weight, core.head_map.bias)
    y_ref, e_ref, r_ref = reference_noncausal(*args, rule="segment_mean")
    assert (y - y_ref).abs().max() < 1e-10
    assert (y - reference_noncausal(*args, rule="even")[0]).abs().max() > 1e-3  # told apart from single tokens
    per_seq, _ = reference_layer_J(e_ref, r_ref, full, core.Lambda, core.We, core.Wr)
    assert torch.allclose(ksvd_objective(terms, "sequence").double(), torch.tensor(per_seq, dtype=torch.float64),
                          atol=1e-6)


@pytest.mark.parametrize("side", ["right", "left"])
def test_segment_mean_gradient_spreads_each_slot_over_its_run_in_a_mixed_batch(side):
    # A batch mixing sequences longer and shorter than p: the gradient at the token of rank r is the sum over the slots
    # whose run holds r of (slot's upstream gradient) / (run length), and zero at padding, never NaN.
    from hf_primal.modeling.sampling import segment_means

    lengths, total, p, width = [11, 4, 6], 12, 6, 3
    valid = _padded(lengths, total, side)
    x = torch.randn(len(lengths), total, width, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(len(lengths), p, width, dtype=torch.float64)
    (segment_means(x, valid, p) * upstream).sum().backward()
    expected = torch.zeros_like(x)
    for b, L in enumerate(lengths):
        positions = valid[b].nonzero().flatten().tolist()
        for j, run in enumerate(reference_slot_runs(L, p)):
            for rank in run:
                expected[b, positions[rank]] += upstream[b, j] / len(run)
    assert torch.allclose(x.grad, expected, atol=1e-12)


def test_jitter_draws_a_token_of_each_interval_while_training_and_samples_evenly_at_inference():
    lengths, total, p = [40, 23, 6], 44, 8  # 6 < p: every interval holds one token
    valid = _padded(lengths, total, "left")
    draws = [sample_token_indices(valid, p, "jitter") for _ in range(30)]
    for b, length in enumerate(lengths):
        offset = total - length
        seen = set()
        for idx in draws:
            ranks = (idx[b] - offset).tolist()
            for j, rank in enumerate(ranks):
                run = reference_slot_runs(length, p)[j]
                assert rank in run, (b, j, rank, run)
            seen.add(tuple(ranks))
        assert (len(seen) > 1) == (length > p), (b, len(seen))
    # The layer: training forwards differ from each other; eval forwards equal the "even" rule.
    core = _core(False, p)
    core.sampling = "jitter"
    q, k = _qk(3, total)
    x = torch.randn(3, total, H * D, dtype=torch.float64)
    first, _ = core.train().noncausal(q, k, x, valid)
    second, _ = core.noncausal(q, k, x, valid)
    assert (first - second).abs().max() > 1e-3
    at_inference, _ = core.eval().noncausal(q, k, x, valid)
    core.sampling = "even"
    even, _ = core.noncausal(q, k, x, valid)
    assert torch.equal(at_inference, even)


@pytest.mark.parametrize("rule", ["segment_mean", "jitter"])
def test_new_rules_round_trip_through_config_json_and_load_without_the_plugin(tmp_path, rule):
    import hf_primal
    from tests.test_cli_and_sharing import run_child

    spec = {"layers": "all", "low_rank": 3, "rank_multi": 2}  # p = 6 < the 11 tokens below: the rules matter
    model = BertModel(bert_config(primal_attention={**spec, "sampling": rule})).eval()
    ids = torch.randint(1, 120, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
    hf_primal.save_converted(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["primal_attention"]["sampling"] == rule
    loaded = AutoModel.from_pretrained(tmp_path / "out").eval()
    assert {layer.attention.self.primal.sampling for layer in loaded.encoder.layer} == {rule}
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).last_hidden_state, expected)
    even = AutoModel.from_pretrained(tmp_path / "out", primal_attention={**spec, "sampling": "legacy"}).eval()
    with torch.no_grad():
        differs = (even(input_ids=ids, attention_mask=mask).last_hidden_state - expected).abs().max()
    assert (differs > 1e-4) == (rule == "segment_mean")  # jitter samples as "even" at inference; legacy == even here
    torch.save({"ids": ids, "mask": mask, "expected": expected}, tmp_path / "batch.pt")
    result = run_child(f"""
        import sys, torch, transformers
        assert sys.modules["hf_primal"] is None
        batch = torch.load({str(tmp_path / 'batch.pt')!r})
        model = transformers.AutoModel.from_pretrained({str(tmp_path / 'out')!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            hidden = model(input_ids=batch["ids"], attention_mask=batch["mask"]).last_hidden_state
        assert torch.equal(hidden, batch["expected"]), (hidden - batch["expected"]).abs().max()
        """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
