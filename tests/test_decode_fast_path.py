"""The decoding fast path (hf_primal/modeling/primal.py `PrimalCore._decode_step`): a causal primal layer continuing a
cached state with autograd off skips the KSVD terms and the general path's per-step buffers. Checked against the full
forward of the same model, and that everything that needs the terms (training, evaluation under no_grad with the
cache transformers creates, PrimalTrainer's eval) still gets them."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import DynamicCache, GPT2LMHeadModel, TrainingArguments

from hf_primal import PrimalTrainer, ksvd_loss
from tests.conftest import cache_kw, gpt2_config


def _gpt2(layers="all"):
    config = gpt2_config(initializer_range=0.3, primal_attention={"layers": layers, "low_rank": 4})
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config).eval()


def _primal_modules(model):
    return [m for m in model.modules() if getattr(m, "_is_primal_attention", False)]


@pytest.mark.parametrize("layers", ["all", [-1]])
def test_cached_decode_equals_full_forward_and_skips_terms(layers):
    model = _gpt2(layers)
    ids = torch.randint(1, 120, (2, 12))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        logits = [model(ids[:, :5], **cache_kw(cache), use_cache=True).logits]
        assert all(m.ksvd_terms is not None for m in _primal_modules(model))  # the prefill keeps its terms
        for i in range(5, 12):
            logits.append(model(ids[:, i : i + 1], **cache_kw(cache), use_cache=True).logits)
            assert all(m.ksvd_terms is None for m in _primal_modules(model))  # decode steps skip them
    assert (torch.cat(logits, dim=1) - full).abs().max() < 1e-5


def test_left_padded_cached_decode_equals_full_forward():
    model = _gpt2()
    ids = torch.randint(1, 120, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :6], attention_mask=mask[:, :6], **cache_kw(cache), use_cache=True)
        steps = [model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], **cache_kw(cache), use_cache=True).logits
                 for i in range(6, 10)]
    assert (torch.cat(steps, dim=1) - full[:, 6:]).abs().max() < 1e-5


def test_training_and_no_grad_evaluation_with_a_cache_still_get_ksvd_terms():
    model = _gpt2()
    ids = torch.randint(1, 120, (2, 9))
    with torch.no_grad():
        model(ids, use_cache=False)
        expected = float(ksvd_loss(model))
    # Evaluation: no_grad, and transformers creates a cache because use_cache defaults to True.
    with torch.no_grad():
        model(ids, use_cache=True)
    assert float(ksvd_loss(model)) == pytest.approx(expected, rel=1e-6)
    # Training with a cache in use: the terms are differentiable and reach Lambda.
    model.train()
    out = model(ids, labels=ids, use_cache=True)
    (out.loss + ksvd_loss(model)).backward()
    for module in _primal_modules(model):
        assert module.primal.Lambda.grad is not None and module.primal.Lambda.grad.abs().sum() > 0
    # A decode step under no_grad leaves no terms: asking for the loss then says why.
    model.eval()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, **cache_kw(cache), use_cache=True)
        model(ids[:, :1], **cache_kw(cache), use_cache=True)
    with pytest.raises(ValueError, match="decod"):
        ksvd_loss(model)


def test_primal_trainer_eval_reports_ksvd_loss_for_a_causal_lm(tmp_path):
    model = _gpt2()
    ids = torch.randint(1, 120, (4, 8), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                              "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                             per_device_eval_batch_size=4, disable_tqdm=True, dataloader_num_workers=0)
    metrics = PrimalTrainer(model=model, args=args, eval_dataset=data).evaluate()
    with torch.no_grad():
        model(ids, use_cache=False)
    assert math.isfinite(metrics["eval_ksvd_loss"])
    assert metrics["eval_ksvd_loss"] == pytest.approx(float(ksvd_loss(model)), rel=1e-5)
