"""Models whose every attention layer is primal get the 2D padding mask; every other model gets transformers' own.

The reference is the same model run with transformers' stock mask functions (the (batch, 1, queries, keys) masks
every primal layer read before): outputs and generated tokens must not move, only the mask's form.
"""

import pytest
import torch
from transformers import masking_utils

import hf_primal  # noqa: F401  (installs the hooks)
from hf_primal.modeling.architecture import primal_attention_modules
from tests.architectures import CASES, inputs

MAPPING = masking_utils.AttentionMaskInterface._global_mapping
TEXT = [name for name, case in CASES.items() if not case.image]


def record_masks(model) -> list:
    """The attention mask every primal layer receives, in call order (shape, or None)."""
    seen = []

    def hook(module, args, kwargs):
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[1] if len(args) > 1 else None)
        seen.append(None if mask is None else tuple(mask.shape))

    for _, module in primal_attention_modules(model):
        module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.fixture
def stock_masks(monkeypatch):
    """Call to run with transformers' own sdpa / eager mask functions (hf_primal's wrappers taken out)."""

    def use():
        for implementation in ("sdpa", "eager"):
            monkeypatch.setitem(MAPPING, implementation, MAPPING[implementation].__wrapped__)

    return use


def build(name, attn, **spec):
    case = CASES[name]
    config = case.config(primal_attention={"low_rank": 4, "rank_multi": 2, **spec})
    config._attn_implementation = attn
    return getattr(__import__("transformers"), case.head)(config).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", TEXT)
def test_all_primal_models_get_the_padding_mask_and_the_same_outputs(name, attn, stock_masks):
    model = build(name, attn, layers="all")
    side = "left" if name == "gpt2" else "right"
    batch = inputs(name, model.config, batch=3, length=11, lengths=[11, 7, 4], side=side)
    seen = record_masks(model)
    with torch.no_grad():
        fast = model(**batch).logits
    assert seen == [(3, 11)] * len(primal_attention_modules(model))  # (batch, keys), not (batch, 1, 11, 11)
    seen.clear()
    stock_masks()
    with torch.no_grad():
        reference = model(**batch).logits
    assert seen and all(shape == (3, 1, 11, 11) for shape in seen)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", TEXT)
def test_no_padding_gives_no_mask(name):
    model = build(name, "sdpa", layers="all")
    seen = record_masks(model)
    with torch.no_grad():
        model(**inputs(name, model.config, batch=2, length=8))
    assert seen == [None] * len(primal_attention_modules(model))


@pytest.mark.parametrize("name", TEXT)
def test_a_softmax_layer_left_keeps_transformers_mask(name, stock_masks):
    model = build(name, "sdpa", layers=[-1])  # Primal.+: the first layer stays softmax and needs the 4D mask
    batch = inputs(name, model.config, batch=3, length=10, lengths=[10, 6, 3], side="right")
    seen = record_masks(model)
    with torch.no_grad():
        fast = model(**batch).logits
    assert seen == [(3, 1, 10, 10)]
    stock_masks()
    with torch.no_grad():
        torch.testing.assert_close(fast, model(**batch).logits, rtol=0, atol=0)


def test_cross_attention_keeps_transformers_mask():
    from transformers import BertLMHeadModel

    from tests.conftest import bert_config

    config = bert_config(is_decoder=True, add_cross_attention=True,
                         primal_attention={"layers": "all", "low_rank": 4, "rank_multi": 2})
    model = BertLMHeadModel(config).eval()
    batch = inputs("bert", config, batch=2, length=6, lengths=[6, 4])
    encoder = torch.randn(2, 5, 32)
    encoder_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    seen = record_masks(model)
    with torch.no_grad():
        out = model(**batch, encoder_hidden_states=encoder, encoder_attention_mask=encoder_mask, use_cache=False)
    assert seen == [(2, 1, 6, 6)] * 2
    assert torch.isfinite(out.logits).all()


def test_packed_sequences_keep_transformers_mask(stock_masks):
    model = build("bert", "sdpa", layers="all")
    ids = torch.randint(3, 120, (1, 9))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])  # three sequences in one row
    seen = record_masks(model)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions).logits
    hooked = list(seen)
    seen.clear()
    stock_masks()
    with torch.no_grad():
        torch.testing.assert_close(out, model(input_ids=ids, position_ids=positions).logits, rtol=0, atol=0)
    # Whatever transformers builds for packed rows, which a padding mask cannot express: (1, 1, 9, 9) where it builds
    # packed masks for encoders (5.24 on), None before (the primal layers then split the rows by position_ids).
    assert hooked == seen and seen[0] in (None, (1, 1, 9, 9))


def test_generation_uses_the_padding_mask_for_the_prompt_only(stock_masks):
    model = build("gpt2", "sdpa", layers="all")
    batch = inputs("gpt2", model.config, batch=2, length=7, lengths=[7, 4], side="left")
    seen = record_masks(model)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        fast = model.generate(**batch, **options)
    layers = len(primal_attention_modules(model))
    assert seen[:layers] == [(2, 7)] * layers  # the prompt: no tokens cached yet
    assert seen[layers:] and all(shape is None or len(shape) == 4 for shape in seen[layers:])  # decoding steps
    stock_masks()
    with torch.no_grad():
        assert torch.equal(fast, model.generate(**batch, **options))


@pytest.mark.parametrize("change", [
    {"q_offset": 2}, {"q_offset": torch.tensor(0)}, {"kv_offset": 1}, {"local_size": 4},
    {"allow_is_bidirectional_skip": False}, {"mask_function": masking_utils.and_masks(
        masking_utils.bidirectional_mask_function, masking_utils.causal_mask_function)},
], ids=["cached tokens", "static cache", "kv offset", "sliding window", "materialise", "overlay"])
def test_other_requests_get_transformers_answer(change):
    from tests.conftest import bert_config

    config = bert_config(primal_attention={"layers": "all", "low_rank": 4})
    padding = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    request = dict(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0, attention_mask=padding,
                   mask_function=masking_utils.bidirectional_mask_function, allow_is_causal_skip=False,
                   allow_is_bidirectional_skip=True, dtype=torch.float32, config=config, device="cpu")
    assert torch.equal(MAPPING["sdpa"](**request), padding)  # the plain request: the padding mask itself
    request.update(change)
    expected = masking_utils.sdpa_mask(**request)
    got = MAPPING["sdpa"](**request)
    assert got is not None and got.dim() == 4 and torch.equal(got, expected)
