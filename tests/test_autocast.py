"""Primal layers under bf16 autocast (how mixed-precision training and inference run on GPUs) against fp32.

Nothing in hf_primal assumes a device or dtype: the same layers run under ``torch.autocast``. The tolerance is
anchored in the canonical model: on the same weights, a primal attention layer's bf16 error (relative to its own fp32
output) may be at most 3x the stock softmax layer's (bf16 keeps 8 bits of mantissa: eps = 2^-7 ~ 0.0078). Running
sums of the causal decoding state must stay fp32 however the projections are cast, or they drift as a sequence
grows.
"""

import copy

import pytest
import torch
from transformers import BertModel, GPT2LMHeadModel

from hf_primal import ksvd_loss
from tests.conftest import bert_config, cache_kw, capture_layer_io, gpt2_config, returned_cache

EPS = torch.finfo(torch.bfloat16).eps


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _bf16(fn):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn()


def _bert_pair():
    stock = BertModel(bert_config(hidden_size=64, intermediate_size=128, max_position_embeddings=128),
                      add_pooling_layer=False).eval()
    primal = BertModel(bert_config(hidden_size=64, intermediate_size=128, max_position_embeddings=128,
                                   primal_attention={"layers": "all", "low_rank": 8, "rank_multi": 4}),
                       add_pooling_layer=False).eval()
    missing = primal.load_state_dict(stock.state_dict(), strict=False).missing_keys
    assert missing and all("core" in k or "primal" in k or "head_map" in k for k in missing), missing
    return stock, primal


def _ids(batch=3, length=96, vocab=120):
    ids = torch.randint(1, vocab, (batch, length))
    mask = torch.ones_like(ids)
    mask[1, 60:] = 0  # padding: the masked paths run too
    return ids, mask


def _attention_errors(model, ids, mask) -> list[float]:
    """Per layer: relative error of the self-attention output under bf16 autocast against fp32."""
    errors = []
    for layer in model.encoder.layer:
        store, handle = capture_layer_io(layer.attention.self)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
            full = store["out"].clone()
            _bf16(lambda: model(input_ids=ids, attention_mask=mask))
            half = store["out"].clone()
        handle.remove()
        assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()  # autocast really ran in bf16
        errors.append(_rel(half, full))
    return errors


def test_encoder_attention_under_bf16_autocast_is_as_close_to_fp32_as_softmax():
    stock, primal = _bert_pair()
    ids, mask = _ids()
    stock_errors, primal_errors = _attention_errors(stock, ids, mask), _attention_errors(primal, ids, mask)
    assert all(0 < e < 4 * EPS for e in stock_errors), stock_errors
    for softmax, ours in zip(stock_errors, primal_errors):
        assert ours <= 3 * softmax, (primal_errors, stock_errors)


def test_backward_and_ksvd_term_under_bf16_autocast_match_fp32():
    _, primal = _bert_pair()
    primal.train()
    ids, mask = _ids()
    grads, losses = {}, {}
    for mode in ("fp32", "bf16"):
        model = copy.deepcopy(primal)

        def run(model=model):
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            return hidden.float().square().mean(), ksvd_loss(model)

        task, ksvd = _bf16(run) if mode == "bf16" else run()
        assert ksvd.dtype == torch.float32 and torch.isfinite(ksvd), mode
        (task + 0.5 * ksvd).backward()
        losses[mode] = (float(task.detach()), float(ksvd.detach()))
        grads[mode] = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                       if p.grad is not None and n.split(".")[-1] in ("We", "Wr", "Lambda")}
    assert len(grads["fp32"]) == 3 * 2  # We, Wr, Lambda of both layers got gradients
    assert losses["bf16"][1] == pytest.approx(losses["fp32"][1], rel=20 * EPS)
    for name, full in grads["fp32"].items():
        half = grads["bf16"][name]
        cosine = torch.nn.functional.cosine_similarity(half.flatten(), full.flatten(), dim=0)
        assert cosine > 0.99 and _rel(half, full) < 0.1, (name, float(cosine), _rel(half, full))


def _decoding_error(primal_attention):
    """Incremental decoding of 40 tokens under bf16 autocast against the fp32 forward of the whole sequence."""
    extra = {"primal_attention": primal_attention} if primal_attention else {}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(n_embd=64, n_positions=128, **extra)).eval()
    ids = torch.randint(1, 120, (2, 40))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        out = _bf16(lambda: model(input_ids=ids[:, :8], use_cache=True))
        cache, steps = returned_cache(out), [out.logits]
        for t in range(8, ids.shape[1]):
            out = _bf16(lambda t=t, c=cache: model(input_ids=ids[:, t:t + 1], use_cache=True, **cache_kw(c)))
            cache = returned_cache(out)
            steps.append(out.logits)
    decoded = torch.cat(steps, dim=1)
    assert torch.isfinite(decoded).all()
    return decoded, reference, cache


def test_decoding_under_bf16_autocast_keeps_fp32_state_and_tracks_the_full_forward():
    decoded, reference, cache = _decoding_error({"layers": "all", "low_rank": 8})
    stock, stock_reference, _ = _decoding_error(None)
    states = [layer.state for layer in cache.layers if getattr(layer, "state", None) is not None]
    assert len(states) == 2
    for state in states:
        assert all(t.dtype == torch.float32 for t in state), [t.dtype for t in state]
    assert 0 < _rel(decoded, reference) <= 3 * _rel(stock, stock_reference)
    # The last tokens are as close as the first: the running state does not drift along the sequence.
    assert _rel(decoded[:, -8:], reference[:, -8:]) < 2 * _rel(decoded[:, :8], reference[:, :8])
