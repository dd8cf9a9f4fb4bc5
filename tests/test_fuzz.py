"""Property-based fuzzing (hypothesis) of what users hand to hf_primal.

* Random ``primal_attention`` dicts — valid and invalid types, ranges, layer lists, unknown keys — are either accepted
  exactly when the field rules written out below (from docs/user-guide.md, independently of the code) say they are
  valid, and then round-trip through ``config.json`` unchanged, or refused with a ValueError naming a bad field.
* Random batches for every registered architecture — sizes, lengths, left / right padding, all-padding rows,
  fp32 and bf16, every sampling rule, several layer selections — give finite outputs, and each real sequence's outputs
  equal those of the sequence run alone; causal layers decode with a cache exactly as without.

The normal test run uses the "ci" profile (few examples, derandomised, so it never flakes); the "long" profile
explores far more: ``python -m pytest tests/test_fuzz.py --hypothesis-profile=long`` (docs/user-guide.md,
"Reliability").
"""

import json
import math
import tempfile

import pytest
import torch
import transformers
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hf_primal import PrimalAttentionConfig
from hf_primal.models import ARCHITECTURES
from tests.architectures import CASES, inputs
from tests.conftest import cache_kw

# ------------------------------------------------------------------ the field rules, written from the docs
RULES = ("even", "legacy", "segment_mean", "jitter")
REDUCTIONS = ("sequence", "batch")
FIELDS = ("layers", "low_rank", "rank_multi", "eta", "ksvd_reduction", "crop_window", "sampling", "variant", "eta_kl",
          "covariance")
VARIANTS, COVARIANCES = ("primal", "kep_svgp"), ("consistent", "reference")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_fields(spec: dict) -> set:
    """The keys of `spec` that the documented rules refuse (unknown keys included)."""
    bad = {key for key in spec if key not in FIELDS}
    layers = spec.get("layers", [-1])
    if not (layers == "all" or (isinstance(layers, list) and layers and all(_is_int(i) for i in layers)
                                and len(set(layers)) == len(layers))):
        bad.add("layers")
    for key in ("low_rank", "rank_multi", "crop_window"):
        if key in spec and not (_is_int(spec[key]) and spec[key] >= 1):
            bad.add(key)
    eta = spec.get("eta", 0.1)
    if not (isinstance(eta, (int, float)) and not isinstance(eta, bool) and math.isfinite(eta) and eta >= 0):
        bad.add("eta")
    if spec.get("ksvd_reduction", "sequence") not in REDUCTIONS:
        bad.add("ksvd_reduction")
    if spec.get("sampling", "segment_mean") not in RULES:
        bad.add("sampling")
    if spec.get("variant", "primal") not in VARIANTS:
        bad.add("variant")
    if spec.get("covariance", "consistent") not in COVARIANCES:
        bad.add("covariance")
    eta_kl = spec.get("eta_kl", 1.0)
    if not (isinstance(eta_kl, (int, float)) and not isinstance(eta_kl, bool) and math.isfinite(eta_kl)
            and eta_kl >= 0):
        bad.add("eta_kl")
    if spec.get("variant") != "kep_svgp":  # the KEP-SVGP settings belong to that variant only
        bad |= {key for key in ("eta_kl", "covariance") if key in spec}
    return bad


# Anything JSON can hold, plus the edge values each rule is about.
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["all", "ALL", "", "-1", "even", "segment_mean", "batch", "sequence", "jitter", "mean"]),
)
_valid = {
    "layers": st.one_of(st.just("all"), st.lists(st.integers(-3, 2), min_size=1, max_size=3, unique=True)),
    "low_rank": st.integers(1, 12), "rank_multi": st.integers(1, 5), "crop_window": st.integers(1, 80),
    "eta": st.one_of(st.floats(0, 10), st.integers(0, 3)),
    "ksvd_reduction": st.sampled_from(REDUCTIONS), "sampling": st.sampled_from(RULES),
    "variant": st.sampled_from(VARIANTS), "eta_kl": st.one_of(st.floats(0, 10), st.integers(0, 3)),
    "covariance": st.sampled_from(COVARIANCES),
}
_edges = st.sampled_from([True, False, None, 0, -1, 1.0, 2.5, float("nan"), float("inf"), -0.0, "", "all", "4", [],
                          [0, 0], [-1, 1], [True], [0, "1"], [1.0], {"layers": [0]}])
_any = st.one_of(_edges, _scalars, st.lists(st.one_of(st.integers(-4, 4), st.booleans(), st.floats(-2, 2),
                                                      st.just("0")), max_size=4))


# Each field's own boundary: the values its rule is about (and near misses of its type).
_INT_EDGES = [0, -1, 1, True, 1.0, "3", None]
_STR_EDGES = ["", "Even", "SEQUENCE", "mean", None, 0, True]
_field_edges = {
    "layers": st.sampled_from(["all", "All", [], [0, 0], [-1, 1], [2, -1], [True], [0.0], "0", 0, None]),
    "low_rank": st.sampled_from(_INT_EDGES), "rank_multi": st.sampled_from(_INT_EDGES),
    "crop_window": st.sampled_from(_INT_EDGES),
    "eta": st.sampled_from([0, 0.0, -0.0, -1e-9, float("nan"), float("inf"), True, "0.1", None]),
    "ksvd_reduction": st.sampled_from(_STR_EDGES), "sampling": st.sampled_from(_STR_EDGES),
    "variant": st.sampled_from(_STR_EDGES + ["kep-svgp", "KEP_SVGP"]), "covariance": st.sampled_from(_STR_EDGES),
    "eta_kl": st.sampled_from([0, -1e-9, float("nan"), float("inf"), True, "1", None]),
}


@st.composite
def specs(draw):
    """A valid spec, then up to two entries (fields or near misses of their names) set to a boundary value of that
    field or to anything."""
    spec = draw(st.fixed_dictionaries({}, optional=_valid))
    for key in draw(st.lists(st.sampled_from([*FIELDS, "rank", "Layers", "low-rank"]), unique=True, max_size=2)):
        spec[key] = draw(st.one_of(_field_edges[key], _any) if key in _field_edges else _any)
    return spec


# Config checks cost a millisecond: twenty times the profile's examples.
@settings(max_examples=20 * settings.default.max_examples)
@given(spec=specs())
def test_random_primal_attention_dicts_round_trip_or_are_refused_naming_the_field(spec):
    bad = _bad_fields(spec)
    if bad:
        with pytest.raises(ValueError) as raised:
            PrimalAttentionConfig.from_dict(spec)
        assert any(name in str(raised.value) for name in bad), (spec, bad, str(raised.value))
        with pytest.raises(ValueError):  # the same refusal where users meet it: the model's config
            transformers.BertConfig(primal_attention=spec)
        return
    config = PrimalAttentionConfig.from_dict(spec)
    for key, value in spec.items():  # accepted values are kept as given (eta as a float)
        got = getattr(config, key)
        assert got == value and type(got) is (float if key in ("eta", "eta_kl") else type(value)), (key, value, got)
    assert PrimalAttentionConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with tempfile.TemporaryDirectory() as folder:
        transformers.BertConfig(primal_attention=spec).save_pretrained(folder)
        reloaded = transformers.AutoConfig.from_pretrained(folder)
    assert PrimalAttentionConfig.from_dict(reloaded.primal_attention) == config


# ------------------------------------------------------------------ random inputs, every architecture
NAMES = [a.name for a in ARCHITECTURES]
TEXT = [n for n in NAMES if not CASES[n].image]
DECODERS = [n for n in NAMES if CASES[n].decoder]
_models: dict = {}


def _model(name, layers, low_rank, rank_multi, sampling, dtype):
    # Built once per setting: hypothesis draws the settings from a small set, the inputs from a large one.
    key = (name, str(layers), low_rank, rank_multi, sampling, dtype)
    if key not in _models:
        torch.manual_seed(0)
        spec = {"layers": layers, "low_rank": low_rank, "rank_multi": rank_multi, "sampling": sampling}
        _models[key] = CASES[name].model("base", primal_attention=spec).to(dtype).eval()
    return _models[key]


settings_strategy = st.tuples(st.sampled_from(["all", [-1], [0]]), st.sampled_from([2, 4]), st.sampled_from([1, 3]),
                              st.sampled_from(RULES), st.sampled_from([torch.float32, torch.bfloat16]))


@pytest.mark.parametrize("name", TEXT)
@given(setting=settings_strategy, lengths=st.lists(st.integers(0, 14), min_size=1, max_size=3),
       side=st.sampled_from(["left", "right"]), extra=st.integers(0, 4))
def test_random_padded_batches_give_finite_outputs_equal_to_each_sequence_alone(name, setting, lengths, side, extra):
    layers, low_rank, rank_multi, sampling, dtype = setting
    model = _model(name, layers, low_rank, rank_multi, sampling, dtype)
    total = max(max(lengths), 1) + extra
    batch = inputs(name, model.config, batch=len(lengths), length=total, lengths=lengths, side=side, seed=len(lengths))
    if side == "left" and name != "roberta":  # RoBERTa numbers positions itself, skipping its pad id
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(**batch).last_hidden_state
    assert torch.isfinite(out.float()).all(), (lengths, side)  # all-padding rows (length 0) included
    # bf16: a row's sums run in another order inside a batch than alone; allow a few bf16 steps of the output scale.
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(torch.bfloat16).eps
    for row, n in enumerate(lengths):
        if n == 0:
            continue
        real = batch["attention_mask"][row].bool()
        with torch.no_grad():
            alone = model(input_ids=batch["input_ids"][row:row + 1, real]).last_hidden_state[0]
        scale = max(1.0, float(alone.float().abs().max()))
        assert float((alone.float() - out[row, real].float()).abs().max()) <= tol * scale, (row, n, side, dtype)


@pytest.mark.parametrize("name", DECODERS)
@given(layers=st.sampled_from(["all", [-1]]), prompt=st.integers(1, 6), steps=st.integers(1, 6),
       batch=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_random_cached_decoding_equals_recomputing_every_step(name, layers, prompt, steps, batch, seed):
    case = CASES[name]
    key = ("decoder", name, str(layers))
    if key not in _models:
        torch.manual_seed(0)
        config = case.config(initializer_range=0.3, primal_attention={"layers": layers, "low_rank": 4},
                             **dict(case.decoder_flags))
        _models[key] = getattr(transformers, case.decoder)(config).eval()
    model = _models[key]
    ids = torch.randint(3, 120, (batch, prompt + steps), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = transformers.DynamicCache(config=model.config)
        parts = [model(ids[:, :prompt], **cache_kw(cache), use_cache=True).logits]
        for t in range(prompt, prompt + steps):
            parts.append(model(ids[:, t:t + 1], **cache_kw(cache), use_cache=True).logits)
    cached = torch.cat(parts, dim=1)
    assert torch.isfinite(cached).all()
    # fp32 rounding grows with the logits (found by the long profile: 1.0e-5 on logits up to 6.3; the stock BERT
    # decoder shows 6.7e-6 on logits up to 4.4): a relative bound. A wrong cache state is off by 1e-1 and more.
    assert float((cached - full).abs().max()) <= 5e-6 * max(1.0, float(full.abs().max()))


IMAGES = [n for n in NAMES if CASES[n].image]


@pytest.mark.parametrize("name", IMAGES)
@given(setting=settings_strategy, batch=st.integers(1, 3), seed=st.integers(0, 2 ** 16),
       scale=st.sampled_from([1e-3, 1, 30]))
def test_random_image_batches_give_finite_outputs_equal_to_each_image_alone(name, setting, batch, seed, scale):
    layers, low_rank, rank_multi, sampling, dtype = setting
    model = _model(name, layers, low_rank, rank_multi, sampling, dtype)
    pixels = scale * torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(pixel_values=pixels.to(dtype)).last_hidden_state
        first = model(pixel_values=pixels[:1].to(dtype)).last_hidden_state[0]
    assert torch.isfinite(out.float()).all()
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(torch.bfloat16).eps
    assert float((first.float() - out[0].float()).abs().max()) <= tol * max(1.0, float(first.float().abs().max()))


@pytest.mark.parametrize("name", [n for n in TEXT if CASES[n].packing])
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), layers=st.sampled_from(["all", [-1]]),
       sampling=st.sampled_from(RULES), seed=st.integers(0, 2 ** 16))
def test_random_packed_rows_equal_the_same_sequences_padded(name, lengths, layers, sampling, seed):
    # Packed (padding-free) rows: the sequences back to back in one row, positions restarting at each.
    model = _model(name, layers, 4, 2, sampling, torch.float32)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 120, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)], mask[row, :len(seq)] = seq, 1
    packed_ids = torch.cat(seqs)[None]
    positions = torch.cat([CASES[name].first_position + torch.arange(n) for n in lengths])[None]
    # Decoders: transformers reads packing from the positions only without a cache (softmax attention alike).
    extra = {"use_cache": False} if name == "gpt2" else {}

    def gap(net):
        with torch.no_grad():
            padded = net(input_ids=ids, attention_mask=mask, **extra).last_hidden_state[mask.bool()]
            packed = net(input_ids=packed_ids, position_ids=positions, **extra).last_hidden_state[0]
        assert torch.isfinite(packed).all()
        return float((packed - padded).abs().max())

    # Only rows that transformers' own masks keep apart: transformers 5.23 reads a row of length-1 sequences
    # (positions 0, 0, ...) as one sequence, the stock model included; later releases split it.
    stock = _models.setdefault(("stock", name), CASES[name].model("base").eval())
    assume(gap(stock) <= 1e-5)
    assert gap(model) <= 1e-5
