"""What transformers' own model tests expect of an attention layer, checked on primal BERT / GPT-2 / ViT.

Modelled on transformers' ``test_attention_outputs``, ``test_retain_grad_hidden_states_attentions``,
``test_model_outputs_equivalence``, ``_check_attentions_for_generate``, ``test_{eager,sdpa}_padding_matches_padding_free
_with_position_ids``, ``test_past_key_values_format`` and ViT's ``test_reverse_loading_mapping``; each compares numbers
with an independent computation: attention matrices with loops over the layer's own q/k (read back through hooks),
packed rows with the same sequences run padded, cached attention rows with a full forward, cache states with sums
of the keys themselves, reloaded weights with the saved ones.
"""

import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForImageClassification,
    BertForSequenceClassification,
    BertModel,
    DataCollatorWithFlattening,
    DynamicCache,
    GPT2LMHeadModel,
    ViTForImageClassification,
    ViTModel,
)
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming

import hf_primal
from hf_primal.modeling.cache import PrimalCacheLayer, cache_nbytes
from hf_primal.modeling.primal import PrimalCore
from tests.conftest import bert_config, cache_kw, child_env, gpt2_config, vit_config

HEADS, HEAD_DIM = 4, 8  # every tiny config: hidden 32, 4 heads
ALL = {"layers": "all", "low_rank": 4, "rank_multi": 2}


# ---------------------------------------------------------------------------------------------- independent references
def _capture_layer_inputs(model):
    """Forward pre-hooks that record the hidden states entering every primal attention module, by layer index."""
    store, handles = {}, []
    for module in model.modules():
        if getattr(module, "_is_primal_attention", False):
            def hook(mod, args, kwargs):
                store.setdefault(mod.layer_idx, []).append((args[0] if args else kwargs["hidden_states"]).detach())
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return store, handles


def _split(t):
    return t.double().view(t.shape[0], t.shape[1], HEADS, HEAD_DIM).transpose(1, 2)  # (B, H, N, d)


def _qk(module, x):
    """The layer's own q and k, from its weights, in float64."""
    x = x.double()
    if hasattr(module, "c_attn"):  # GPT-2 fused Conv1D
        qk = x @ module.c_attn.weight.double() + module.c_attn.bias.double()
        return _split(qk[..., :32]), _split(qk[..., 32:64])
    q_lin = getattr(module, "query", None) or module.q_proj
    k_lin = getattr(module, "key", None) or module.k_proj
    q = _split(x @ q_lin.weight.double().T + q_lin.bias.double())
    k = _split(x @ k_lin.weight.double().T + k_lin.bias.double())
    return q, k


def _reference_noncausal_kernel(x, q, k, valid, samples):
    """K_h = q_hat F_h^T F_h k_hat^T over each sequence's valid tokens, loop by loop.

    See docs/method.md, "Non-causal layer" sampling rule.
    """
    batch, heads, length, dim = q.shape
    kernel = torch.zeros(batch, heads, length, length, dtype=torch.float64)
    for b in range(batch):
        positions = [n for n in range(length) if bool(valid[b, n])]
        from hf_primal import PrimalAttentionConfig
        from tests.reference import _slot_rows  # the rows of a new config's rule

        rows = _slot_rows(x[b], positions, samples, PrimalAttentionConfig().sampling).view(samples, heads, dim)
        for h in range(heads):
            for i in positions:
                q_hat = q[b, h, i] / q[b, h, i].norm()
                for j in positions:
                    k_hat = k[b, h, j] / k[b, h, j].norm()
                    kernel[b, h, i, j] = (rows[:, h] @ q_hat) @ (rows[:, h] @ k_hat)
    return kernel


def _reference_causal_kernel(q, k, valid):
    """K_ij = <q_hat_i, k_hat_j> on normalised masked prefix means, j <= i, valid i and j.

    See docs/method.md, "Causal layer".
    """
    batch, heads, length, _ = q.shape
    kernel = torch.zeros(batch, heads, length, length, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            def hat(v, i, b=b, h=h):
                seen = [v[b, h, j] for j in range(i + 1) if bool(valid[b, j])]
                mean = torch.stack(seen).mean(0)
                return mean / mean.norm()
            for i in range(length):
                if not bool(valid[b, i]):
                    continue
                for j in range(i + 1):
                    if bool(valid[b, j]):
                        kernel[b, h, i, j] = hat(q, i) @ hat(k, j)
    return kernel


def _text(batch=2, length=9, padded_row=1, keep=6, left=False):
    ids = torch.randint(1, 120, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    if left:
        mask[padded_row, : length - keep] = 0
    else:
        mask[padded_row, keep:] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------------- attention outputs
@pytest.mark.parametrize("how", ["argument", "config"])
def test_attention_outputs_bert_are_the_sampled_primal_kernel(how):
    config = bert_config(primal_attention=ALL)
    config._attn_implementation = "eager"
    if how == "config":
        config.output_attentions = True
    model = BertModel(config).eval()
    ids, mask = _text()
    store, handles = _capture_layer_inputs(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **({"output_attentions": True} if how == "argument" else {}))
    for handle in handles:
        handle.remove()
    assert len(out.attentions) == 2
    samples = model.encoder.layer[0].attention.self.primal.num_samples
    assert samples == 8  # min(N_max = 64, s * m = 8): more samples than the padded row's 6 tokens, so some repeat
    for i, attention in enumerate(out.attentions):
        module = model.encoder.layer[i].attention.self
        x = store[i][0]
        q, k = _qk(module, x)
        expected = _reference_noncausal_kernel(x, q, k, mask.bool(), samples)
        assert attention.shape == (2, HEADS, 9, 9) and attention.dtype == torch.float32
        assert (attention.double() - expected).abs().max() < 1e-4 * expected.abs().max()
        assert torch.all(attention[1, :, 6:, :] == 0) and torch.all(attention[1, :, :, 6:] == 0)  # padding
        assert not torch.allclose(attention.sum(-1), torch.ones(2, HEADS, 9), atol=0.1)  # not a softmax


def test_attention_outputs_gpt2_are_the_causal_prefix_mean_kernel():
    # The paper's rule by name (the kernel of the default rule: tests/test_analysis.py).
    model = GPT2LMHeadModel(gpt2_config(primal_attention={"layers": [-1], "low_rank": 4,
                                                          "causal_mixing": "prefix_mean"}))
    model.set_attn_implementation("eager")
    model.eval()
    ids, mask = _text(left=True)  # left padding, as batched generation has it
    store, handles = _capture_layer_inputs(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
    for handle in handles:
        handle.remove()
    assert [tuple(a.shape) for a in out.attentions] == [(2, HEADS, 9, 9)] * 2
    assert torch.allclose(out.attentions[0].sum(-1)[0], torch.ones(HEADS, 9), atol=1e-5)  # softmax layer 0
    q, k = _qk(model.transformer.h[1].attn, store[1][0])
    expected = _reference_causal_kernel(q, k, mask.bool())
    assert (out.attentions[1].double() - expected).abs().max() < 1e-5
    assert torch.all(out.attentions[1].triu(1) == 0)  # causal
    assert torch.all(out.attentions[1][1, :, :3] == 0) and torch.all(out.attentions[1][1, :, :, :3] == 0)


def test_attention_outputs_vit_every_token_valid():
    model = ViTModel(vit_config(primal_attention=ALL)).eval()
    store, handles = _capture_layer_inputs(model)
    with torch.no_grad():
        out = model(pixel_values=torch.randn(2, 3, 16, 16), output_attentions=True)
    for handle in handles:
        handle.remove()
    module = model.layers[1].attention
    q, k = _qk(module, store[1][0])
    expected = _reference_noncausal_kernel(
        store[1][0], q, k, torch.ones(2, 17, dtype=torch.bool), module.primal.num_samples
    )
    assert out.attentions[1].shape == (2, HEADS, 17, 17)
    assert (out.attentions[1].double() - expected).abs().max() < 1e-4 * expected.abs().max()


def test_attention_matrix_is_computed_only_when_asked(monkeypatch):
    model = BertModel(bert_config(primal_attention=ALL)).eval()
    ids, mask = _text()
    calls = []
    original = PrimalCore.attention_kernel
    monkeypatch.setattr(
        PrimalCore, "attention_kernel", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw)
    )
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask)
        assert calls == [] and plain.attentions is None
        model.set_attn_implementation("eager")
        asked = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        unasked = model(input_ids=ids, attention_mask=mask, output_attentions=False)
    assert len(calls) == 2 and len(asked.attentions) == 2 and unasked.attentions is None
    assert torch.equal(plain.last_hidden_state, asked.last_hidden_state)  # asking changes no output


# ---------------------------------------------------------------------------------------------- retain_grad
@pytest.mark.parametrize("arch", ["bert", "gpt2", "vit"])
def test_retain_grad_hidden_states_attentions(arch):
    if arch == "bert":
        model, inputs = BertModel(bert_config(primal_attention=ALL)), {"input_ids": torch.randint(1, 120, (2, 7))}
    elif arch == "gpt2":
        model, inputs = GPT2LMHeadModel(gpt2_config(primal_attention=ALL)), {"input_ids": torch.randint(1, 120, (2, 7))}
    else:
        model, inputs = ViTModel(vit_config(primal_attention=ALL)), {"pixel_values": torch.randn(2, 3, 16, 16)}
    model.set_attn_implementation("eager")
    outputs = model(**inputs, output_hidden_states=True, output_attentions=True)
    output = outputs[0]
    hidden_states, attentions = outputs.hidden_states[0], outputs.attentions[0]
    hidden_states.retain_grad()
    attentions.retain_grad()
    output.flatten()[0].backward(retain_graph=True)
    assert hidden_states.grad is not None and attentions.grad is not None
    # The layer never forms the kernel: it reaches the output through a zero-weight tie only.
    assert torch.all(attentions.grad == 0) and hidden_states.grad.abs().sum() > 0
    # ... but the kernel is a function of the layer's q/k projections, inside the graph.
    model.zero_grad()
    outputs.attentions[-1].sum().backward()
    last = len(outputs.attentions) - 1
    module = next(m for m in model.modules() if getattr(m, "_is_primal_attention", False) and m.layer_idx == last)
    projection = getattr(module, "query", None) or getattr(module, "q_proj", None) or module.c_attn
    assert projection.weight.grad is not None and projection.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], output)  # the tie adds exactly zero


# ---------------------------------------------------------------------------------------------- tuple == dict outputs
def _check_equivalent(a, b):
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for x, y in zip(a, b):
            _check_equivalent(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.numel() > 0  # transformers takes a max() over every returned tensor
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), (a - b).abs().max()
    else:
        assert a == b or (a is None and b is None)


@pytest.mark.parametrize("arch", ["bert", "gpt2", "vit", "bert-kep"])
def test_model_outputs_equivalence(arch):
    if arch.startswith("bert"):
        variant = {"variant": "kep_svgp"} if arch == "bert-kep" else {}
        model = BertForSequenceClassification(bert_config(primal_attention={"layers": [-1], "low_rank": 4, **variant}))
        ids, mask = _text()
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    elif arch == "gpt2":
        model = GPT2LMHeadModel(gpt2_config(primal_attention=ALL))
        ids, mask = _text(left=True)
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": False}
    else:
        model = ViTForImageClassification(vit_config(primal_attention=ALL))
        inputs = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([0, 2])}
    model.set_attn_implementation("eager")
    model.eval()
    with torch.no_grad():
        for flags in ({}, {"output_attentions": True}, {"output_hidden_states": True},
                      {"output_attentions": True, "output_hidden_states": True}):
            tuple_output = model(**inputs, **flags, return_dict=False)
            dict_output = model(**inputs, **flags, return_dict=True)
            _check_equivalent(tuple_output, dict_output.to_tuple())
            if "output_attentions" in flags:
                attentions = dict_output.attentions
                assert len(attentions) == 2 and all(a.shape[-1] == a.shape[-2] > 0 for a in attentions)
                assert all(torch.isfinite(a).all() and a.abs().max() > 0 for a in attentions)


# ---------------------------------------------------------------------------------------------- generate() attentions
def test_generate_dict_outputs_attentions_match_a_full_forward():
    model = GPT2LMHeadModel(gpt2_config(primal_attention=ALL, initializer_range=0.3))
    model.set_attn_implementation("eager")
    model.eval()
    model.generation_config.eos_token_id = None
    ids, mask = _text(length=6, keep=4, left=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_attentions=True,
                             return_dict_in_generate=True)
        full_mask = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)  # as generate() numbers them
        full = model(input_ids=out.sequences, attention_mask=full_mask, position_ids=positions,
                     output_attentions=True, use_cache=False)
    # transformers' _check_attentions_for_generate: one tuple per step, (B, H, new tokens, tokens so far)
    assert len(out.attentions) == 4
    for step, per_layer in enumerate(out.attentions):
        queries, keys = (6, 6) if step == 0 else (1, 6 + step)
        assert [tuple(a.shape) for a in per_layer] == [(2, HEADS, queries, keys)] * 2
        for layer, attention in enumerate(per_layer):
            # Causal: the rows of the cached step are rows of the kernel over the whole generated sequence.
            reference = full.attentions[layer][:, :, keys - queries : keys, :keys]
            assert (attention - reference).abs().max() < 1e-5, (step, layer)
    # Without output_attentions the cache stays constant-size; with it, it keeps the keys' features.
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kw(cache), use_cache=True)
    assert all(layer.key_features is None for layer in cache.layers)
    with pytest.raises(ValueError, match="output_attentions=True from the first forward"):
        with torch.no_grad():
            model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), **cache_kw(cache),
                  use_cache=True, output_attentions=True)


def test_beam_search_with_attentions_gives_the_same_tokens():
    model = GPT2LMHeadModel(gpt2_config(primal_attention=ALL, initializer_range=0.3))
    model.set_attn_implementation("eager")
    model.eval()
    model.generation_config.eos_token_id = None
    ids, mask = _text(length=5, keep=3, left=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        plain = model.generate(ids, **kwargs)
        asked = model.generate(ids, output_attentions=True, **kwargs)
    assert torch.equal(plain.sequences, asked.sequences)
    assert [tuple(a[0].shape) for a in asked.attentions] == [(4, HEADS, 5, 5), (4, HEADS, 1, 6), (4, HEADS, 1, 7)]


# ---------------------------------------------------------------------------------------------- padding-free rows
def _sequences(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 120, (n,), generator=generator) for n in lengths]


def _padded(seqs):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def _flattened(seqs, **kwargs):
    batch = DataCollatorWithFlattening(return_tensors="pt", **kwargs)([{"input_ids": s.tolist()} for s in seqs])
    batch.pop("labels")
    return batch


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layers", ["all", [-1]])
def test_gpt2_padding_matches_padding_free_with_position_ids(attn, layers):
    seqs = _sequences([5, 3, 7])
    model = GPT2LMHeadModel(gpt2_config(primal_attention={"layers": layers, "low_rank": 4}, initializer_range=0.3))
    model.set_attn_implementation(attn)
    model.eval()
    ids, mask = _padded(seqs)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
        packed = model(**_flattened(seqs), use_cache=False).logits[0]
        fa_kwargs = model(**_flattened(seqs, return_flash_attn_kwargs=True), use_cache=False).logits[0]
        leaking = model(input_ids=_flattened(seqs)["input_ids"], use_cache=False).logits[0]
    assert (packed - padded).abs().max() < 1e-5
    assert (fa_kwargs - padded).abs().max() < 1e-5
    assert (leaking - padded).abs().max() > 1e-2  # one sequence of 15 tokens would differ: the check can fail


@pytest.mark.parametrize("attn, variant", [("eager", "primal"), ("sdpa", "primal"), ("sdpa", "kep_svgp")])
def test_bert_padding_matches_padding_free_with_position_ids(attn, variant):
    seqs = _sequences([6, 2, 9], seed=1)
    model = BertModel(bert_config(primal_attention={**ALL, "variant": variant}))
    model.set_attn_implementation(attn)
    model.eval()
    ids, mask = _padded(seqs)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        packed = model(**_flattened(seqs)).last_hidden_state[0]
        flat = _flattened(seqs)
        leaking = model(input_ids=flat["input_ids"], position_ids=torch.arange(17)[None]).last_hidden_state[0]
    assert (packed - padded).abs().max() < 1e-5
    assert (leaking - padded).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_padding_free_bf16_within_transformers_tolerance(arch):
    seqs = _sequences([5, 3, 7], seed=2)
    if arch == "gpt2":
        model = GPT2LMHeadModel(gpt2_config(primal_attention=ALL))
    else:
        model = BertModel(bert_config(primal_attention=ALL))
    model = model.to(torch.bfloat16).eval()
    ids, mask = _padded(seqs)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, **({"use_cache": False} if arch == "gpt2" else {}))[0]
        packed = model(**_flattened(seqs), **({"use_cache": False} if arch == "gpt2" else {}))[0]
    tol = torch.finfo(torch.bfloat16).eps  # what transformers' padding-free test allows in half precision
    torch.testing.assert_close(packed[0], padded[mask.bool()], rtol=tol, atol=tol)


def test_padding_free_ksvd_terms_and_gradients_match_padded():
    seqs = _sequences([4, 6], seed=3)
    model = GPT2LMHeadModel(gpt2_config(primal_attention=ALL))
    ids, mask = _padded(seqs)
    padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
    padded_ksvd = hf_primal.ksvd_loss(model, reduction="batch")
    (padded.square().mean() + padded_ksvd).backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    packed = model(**_flattened(seqs), use_cache=False).logits[0]
    packed_ksvd = hf_primal.ksvd_loss(model, reduction="batch")
    (packed.square().mean() + packed_ksvd).backward()
    # KSVD terms stay per row: summed over a packed row they equal the padded batch's, so "batch" reduction agrees.
    assert abs(packed_ksvd.item() - padded_ksvd.item()) < 1e-6 * max(1.0, abs(padded_ksvd.item()))
    for name, grad in padded_grads.items():
        got = dict(model.named_parameters())[name].grad
        assert (got - grad).abs().max() <= 1e-5 * max(1.0, grad.abs().max().item()), name


def test_padding_free_attention_matrices_are_block_diagonal():
    seqs = _sequences([4, 5], seed=4)
    for model in (BertModel(bert_config(primal_attention=ALL)), GPT2LMHeadModel(gpt2_config(primal_attention=ALL))):
        model.set_attn_implementation("eager")
        model.eval()
        extra = {"use_cache": False} if isinstance(model, GPT2LMHeadModel) else {}
        with torch.no_grad():
            packed = model(**_flattened(seqs), output_attentions=True, **extra).attentions
            alone = [model(input_ids=s[None], output_attentions=True, **extra).attentions for s in seqs]
        for layer, attention in enumerate(packed):
            assert torch.all(attention[0, :, :4, 4:] == 0) and torch.all(attention[0, :, 4:, :4] == 0)
            assert (attention[0, :, :4, :4] - alone[0][layer][0]).abs().max() < 1e-4
            assert (attention[0, :, 4:, 4:] - alone[1][layer][0]).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------- cache introspection
def test_past_key_values_format_and_cache_methods():
    # Plain sums under the paper's rule, so the state can be checked against q, k summed here.
    model = GPT2LMHeadModel(gpt2_config(primal_attention={"layers": [-1], "low_rank": 4,
                                                          "causal_mixing": "prefix_mean"})).eval()
    ids = torch.randint(1, 120, (3, 5))
    store, handles = _capture_layer_inputs(model)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    for handle in handles:
        handle.remove()
    assert len(cache) == 2 and cache.get_seq_length() == 5 and cache.get_seq_length(1) == 5
    assert cache.get_mask_sizes(1, 0) == cache.get_mask_sizes(1, 1) == (6, 0)
    assert cache.get_max_length() == -1 and cache.is_croppable and not cache.is_compileable
    # The softmax layer keeps (B, H, N, d) keys/values, as _check_past_key_values_for_generate expects ...
    assert cache.layers[0].keys.shape == cache.layers[0].values.shape == (3, HEADS, 5, HEAD_DIM)
    # ... the primal layer keeps running sums of its own keys, and says so when asked for keys.
    primal = cache.layers[1]
    assert isinstance(primal, PrimalCacheLayer)
    q, k = _qk(model.transformer.h[1].attn, store[1][0])
    assert (primal.state.sum_k.double() - k.sum(dim=2)).abs().max() < 1e-5
    assert (primal.state.sum_q.double() - q.sum(dim=2)).abs().max() < 1e-5
    assert primal.state.count.tolist() == [5.0, 5.0, 5.0]
    for attribute in ("keys", "values"):
        with pytest.raises(AttributeError, match=r"running sums.*state\.sum_q"):
            getattr(primal, attribute)
    with pytest.raises(AttributeError, match="caches no keys or values"):
        list(cache)  # DynamicCache.__iter__ yields every layer's keys and values
    with pytest.raises(RuntimeError, match="caches no keys or values"):
        cache.update(torch.zeros(3, HEADS, 1, HEAD_DIM), torch.zeros(3, HEADS, 1, HEAD_DIM), 1)
    with pytest.raises(RuntimeError, match="does not record its past.*activate_past_recording"):
        primal.crop(-1)  # a cache that did not record its past cannot roll back (test_generation_modes.py)
    sums = primal.state.sum_k.clone()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(primal.state.sum_k, sums[[2, 0, 1]])
    cache.batch_select_indices(torch.tensor([1, 2]))
    assert torch.equal(primal.state.sum_k, sums[[0, 1]])
    cache.batch_repeat_interleave(2)
    assert torch.equal(primal.state.sum_k, sums[[0, 0, 1, 1]]) and primal.state.count.shape == (4,)
    assert cache.get_seq_length() == 5
    cache.reset()
    assert primal.state is None and primal.get_seq_length() == 0


def test_cache_keeps_key_features_only_with_attentions_and_reorders_them():
    model = GPT2LMHeadModel(gpt2_config(primal_attention=ALL))
    model.set_attn_implementation("eager")
    model.eval()
    ids = torch.randint(1, 120, (2, 6))
    plain, asked = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=plain, use_cache=True)
        out = model(input_ids=ids, cache=asked, use_cache=True, output_attentions=True)
    assert cache_nbytes(plain) == 2 * (2 * 2 * HEADS * HEAD_DIM + 2) * 4  # constant-size running state
    layer = asked.layers[1]
    assert layer.key_features.shape == (2, HEADS, 6, HEAD_DIM)
    # The kept features are the normalised prefix means of the keys: row i of K is q_hat_i . k_hat_j.
    assert cache_nbytes(asked) > cache_nbytes(plain)
    kept = layer.key_features.clone()
    asked.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.key_features, kept[[1, 0]])
    assert out.attentions[1][0, :, 5, :].abs().max() > 0


# ---------------------------------------------------------------------------------------------- weight loading
def _check_reverse_loading_mapping(model, model_class):
    """transformers' test_reverse_loading_mapping: every renaming rule of the model maps some serialized key, and
    save -> from_pretrained -> save gives back the same tensors under the same names."""
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    assert conversions, "the ViT renaming rules apply to this model"
    model_keys = list(model.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
        assert sorted(saved) != sorted(model_keys)  # the reverse mapping ran
        for conversion in conversions:
            assert isinstance(conversion, WeightRenaming)
            for pattern in conversion.source_patterns:
                assert any(re.search(pattern, key) for key in saved), (pattern, sorted(saved)[:8])
        reloaded, info = model_class.from_pretrained(tmp, output_loading_info=True)
        assert not any(info.values()), info
        for key, tensor in model.state_dict().items():
            assert torch.equal(reloaded.state_dict()[key], tensor), key
        reloaded.save_pretrained(tmp)
        again = load_file(os.path.join(tmp, "model.safetensors"))
    assert sorted(again) == sorted(saved) and all(torch.equal(again[k], saved[k]) for k in saved)
    return saved


@pytest.mark.parametrize("layers", ["all", [-1]])
@pytest.mark.parametrize("model_class", [ViTModel, ViTForImageClassification])
def test_vit_reverse_loading_mapping(layers, model_class):
    model = model_class(vit_config(primal_attention={"layers": layers, "low_rank": 4}))
    saved = _check_reverse_loading_mapping(model, model_class)
    values = [key for key in saved if "value" in key or "v_proj" in key]
    assert len(values) == (0 if layers == "all" else 2)  # value projections of the softmax layer only


def test_shareable_vit_loads_its_own_weights_with_and_without_the_plugin(tmp_path):
    model = ViTModel(vit_config(primal_attention={"layers": [-1], "low_rank": 4})).eval()
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        hidden = model(pixel_values=pixels).last_hidden_state
    model.save_pretrained(tmp_path / "vit")  # model_type primal_vit: AutoModel builds PrimalViTModel
    loaded, info = AutoModel.from_pretrained(tmp_path / "vit", output_loading_info=True)
    assert type(loaded).__name__ == "PrimalViTModel" and not any(info.values()), info
    with torch.no_grad():
        assert torch.equal(loaded.eval()(pixel_values=pixels).last_hidden_state, hidden)
    _check_reverse_loading_mapping(loaded, AutoModel)
    torch.save(pixels, tmp_path / "pixels.pt")
    code = f"""
        import sys; sys.modules['hf_primal'] = None  # as on a machine without the plugin
        import torch, transformers
        model, info = transformers.AutoModel.from_pretrained({str(tmp_path / 'vit')!r}, trust_remote_code=True,
                                                              output_loading_info=True)
        assert type(model).__name__ == "PrimalViTModel" and not any(info.values()), info
        with torch.no_grad():
            torch.save(model.eval()(pixel_values=torch.load({str(tmp_path / 'pixels.pt')!r})).last_hidden_state,
                       {str(tmp_path / 'remote.pt')!r})
        """
    env = child_env()
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "remote.pt"), hidden)


def test_stock_vit_checkpoint_into_all_primal_vit_reports_only_new_tensors(tmp_path):
    ViTModel(vit_config()).save_pretrained(tmp_path)
    stock = ViTModel.from_pretrained(tmp_path)
    model, info = AutoModelForImageClassification.from_pretrained(
        tmp_path, primal_attention={"layers": "all", "low_rank": 4}, output_loading_info=True
    )
    assert info["unexpected_keys"] <= {"pooler.dense.weight", "pooler.dense.bias"}  # value weights: expected drops
    assert {k for k in info["missing_keys"] if ".primal." not in k} == {"classifier.weight", "classifier.bias"}
    assert torch.equal(model.vit.layers[1].attention.q_proj.weight, stock.layers[1].attention.q_proj.weight)
