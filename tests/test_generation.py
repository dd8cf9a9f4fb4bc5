"""GPT-2 / causal BERT generation with the constant-size primal cache (hf_primal/modeling/cache.py).

Reference for every check is the model itself without a cache: a full forward over the whole sequence,
or `generate(use_cache=False)`, which re-runs the full prefix at each step. The tiny models use a large
initializer_range so that greedy decoding does not collapse onto one repeated token; identical token
sequences then say something about the cache.
"""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertLMHeadModel, DynamicCache, DynamicLayer, GPT2LMHeadModel

from hf_primal.modeling.cache import PrimalCacheLayer, cache_nbytes
from tests.conftest import bert_config, cache_kw, gpt2_config, primal_block_indices, returned_cache

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [pytest.param("all", id="all-primal"), pytest.param([-1], id="last-layer-primal")]
HEADS, HEAD_DIM = 4, 8  # gpt2_config: n_embd 32, 4 heads


def _gpt2(layers, attn="sdpa", **kw):
    config = gpt2_config(initializer_range=0.3, primal_attention={"layers": layers, "low_rank": 4}, **kw)
    config._attn_implementation = attn
    model = GPT2LMHeadModel(config).eval()
    model.generation_config.eos_token_id = None  # run every step; token 0 stays the pad token
    return model


def _left_padded(lengths, width=None):
    width = width or max(lengths)
    prompts = [torch.randint(1, 120, (n,)) for n in lengths]
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return prompts, ids, mask


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ------------------------------------------------------------------ incremental == full recomputation
@pytest.mark.parametrize("layers", LAYOUTS)
def test_every_generated_step_matches_a_full_forward(layers):
    model = _gpt2(layers)
    prompt = torch.randint(1, 120, (2, 4))
    # Decode to the last learned position: the primal state itself has no length limit.
    new = model.config.n_positions - prompt.shape[1]
    with torch.no_grad():
        cached = model.generate(
            prompt, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
        uncached = model.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=False)
        full = model(cached.sequences).logits
    assert cached.sequences.shape == (2, model.config.n_positions)
    steps = torch.stack(cached.logits, dim=1)  # logits that chose tokens 4..63
    assert (steps - full[:, 3:-1]).abs().max() <= 1e-5
    assert torch.equal(cached.sequences, uncached)
    assert len(set(cached.sequences[0, 4:].tolist())) > 5  # not a single repeated token
    primal = primal_block_indices(model)
    kinds = [PrimalCacheLayer if i in primal else DynamicLayer for i in range(model.config.n_layer)]
    assert [type(layer) for layer in returned_cache(cached).layers] == kinds


@pytest.mark.parametrize("layers", ["all", [0]], ids=["all-primal", "first-layer-primal"])
def test_causal_bert_stepwise_matches_full_forward(layers):
    config = bert_config(is_decoder=True, initializer_range=0.3, primal_attention={"layers": layers, "low_rank": 4})
    model = BertLMHeadModel(config).eval()
    ids = torch.randint(1, 120, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :5], **cache_kw(cache), use_cache=True).logits]
        for t in range(5, 12):
            steps.append(model(ids[:, t:t + 1], **cache_kw(cache), use_cache=True).logits)
        cached = model.generate(ids[:, :4], max_new_tokens=10, do_sample=False)
        uncached = model.generate(ids[:, :4], max_new_tokens=10, do_sample=False, use_cache=False)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5
    assert isinstance(cache.layers[0], PrimalCacheLayer) and cache.layers[0].seen == 12
    assert isinstance(cache.layers[1], PrimalCacheLayer if layers == "all" else DynamicLayer)
    assert torch.equal(cached, uncached)


# ------------------------------------------------------------------ padding
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layers", LAYOUTS)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(layers, attn):
    model = _gpt2(layers, attn)
    prompts, ids, mask = _left_padded([3, 10, 6])
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kw)
        for row, prompt in enumerate(prompts):
            alone = model.generate(prompt[None], **kw)
            assert torch.equal(batch.sequences[row, ids.shape[1]:], alone.sequences[0, len(prompt):])
            assert _max_diff([step[row] for step in batch.logits], [step[0] for step in alone.logits]) <= 1e-5


# ------------------------------------------------------------------ beams, sampling, several sequences
@pytest.mark.parametrize("layers", LAYOUTS)
def test_beam_search_with_several_returned_sequences_matches_uncached(layers, monkeypatch):
    model = _gpt2(layers)
    _, ids, mask = _left_padded([4, 7])
    seen_orders = []
    reorder = PrimalCacheLayer.reorder_cache

    def spy(self, beam_idx):
        seen_orders.append(beam_idx.clone())
        reorder(self, beam_idx)

    monkeypatch.setattr(PrimalCacheLayer, "reorder_cache", spy)
    kw = dict(
        attention_mask=mask, max_new_tokens=10, num_beams=4, num_return_sequences=3, do_sample=False,
        return_dict_in_generate=True, output_scores=True,
    )
    with torch.no_grad():
        cached = model.generate(ids, **kw)
        uncached = model.generate(ids, use_cache=False, **kw)
    assert cached.sequences.shape[0] == 6
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=1e-5)
    # Beams really changed places, so the primal states had to follow them.
    assert any(not torch.equal(order, torch.arange(len(order))) for order in seen_orders)


@pytest.mark.parametrize("layers", LAYOUTS)
def test_sampling_with_several_returned_sequences_matches_uncached(layers):
    model = _gpt2(layers)
    _, ids, mask = _left_padded([5, 2])
    kw = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=0, num_return_sequences=3,
        return_dict_in_generate=True, output_logits=True,
    )
    with torch.no_grad():
        torch.manual_seed(7)
        cached = model.generate(ids, **kw)
        torch.manual_seed(7)
        uncached = model.generate(ids, use_cache=False, **kw)
    assert cached.sequences.shape[0] == 6
    assert torch.equal(cached.sequences, uncached.sequences)
    assert _max_diff(cached.logits, uncached.logits) <= 1e-5
    assert len({tuple(s) for s in cached.sequences[:3, 5:].tolist()}) > 1  # the samples differ


@pytest.mark.parametrize("layers", LAYOUTS)
def test_cache_batch_repeat_and_select_continue_exactly(layers):
    model = _gpt2(layers)
    ids, more = torch.randint(1, 120, (2, 8)), torch.randint(1, 120, (2, 3))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, **cache_kw(cache), use_cache=True)
        cache.batch_repeat_interleave(2)  # rows a, a, b, b
        cache.batch_select_indices(torch.tensor([2, 1]))  # rows b, a
        continued = model(more, **cache_kw(cache), use_cache=True).logits
        full = model(torch.cat([ids[[1, 0]], more], dim=1)).logits[:, -3:]
    assert (continued - full).abs().max() <= 1e-5


@pytest.mark.parametrize("layers", LAYOUTS)
def test_generation_continues_from_a_returned_cache(layers):
    model = _gpt2(layers)
    prompt = torch.randint(1, 120, (1, 6))
    with torch.no_grad():
        first = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
        resumed = model.generate(first.sequences, **cache_kw(returned_cache(first)), max_new_tokens=7, do_sample=False)
        fresh = model.generate(first.sequences, max_new_tokens=7, do_sample=False, use_cache=False)
    assert torch.equal(resumed, fresh)


# ------------------------------------------------------------------ constant size
@pytest.mark.parametrize("layers", LAYOUTS)
def test_primal_state_size_does_not_depend_on_context_length(layers):
    # Plain decoding keeps only the running state. A cache that records its past for cropping (assisted /
    # prompt-lookup decoding) also keeps the states after its last crop_window + 1 tokens: bounded by the window,
    # not by the context (test_generation_modes.py::test_recorded_state_is_bounded_by_the_window).
    model = _gpt2(layers)
    primal = primal_block_indices(model)
    numel, nbytes = set(), set()
    for length in (3, 17, 50):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.randint(1, 120, (2, length)), **cache_kw(cache), use_cache=True)
            for _ in range(3):
                model(torch.randint(1, 120, (2, 1)), **cache_kw(cache), use_cache=True)
        for i, layer in enumerate(cache.layers):
            if i in primal:
                assert isinstance(layer, PrimalCacheLayer) and layer.seen == length + 3
                assert layer.state.count.tolist() == [length + 3] * 2  # every token was valid
                numel.add(layer.state_numel())
                nbytes.add(cache_nbytes(_only(layer)))
            else:  # canonical layers keep growing KV caches
                assert layer.keys.shape == (2, HEADS, length + 3, HEAD_DIM)
    assert numel == {2 * (2 * HEADS * HEAD_DIM) + 2}  # sum_q, sum_k (B, H, d) and count (B,)
    assert nbytes == {4 * (2 * (2 * HEADS * HEAD_DIM) + 2)}


def _only(layer):
    cache = DynamicCache()
    cache.layers = [layer]
    return cache


def test_primal_state_owns_its_memory_right_after_prefill():
    # The prefill computes (B, H, L, d) prefix sums; the cached state must not keep them alive through views.
    model = _gpt2("all")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(1, 120, (1, 60)), **cache_kw(cache), use_cache=True)
    for layer in cache.layers:
        for tensor in layer.state:
            assert tensor.untyped_storage().nbytes() == tensor.numel() * 4
    assert cache_nbytes(cache) == 2 * 4 * (2 * HEADS * HEAD_DIM + 1)


def test_cache_nbytes_counts_kv_layers_and_primal_states():
    stock = GPT2LMHeadModel(gpt2_config()).eval()
    hybrid = _gpt2([-1])
    for model, expected in (
        (stock, 2 * 2 * HEADS * 9 * HEAD_DIM * 4),
        (hybrid, (2 * HEADS * 9 * HEAD_DIM + 2 * HEADS * HEAD_DIM + 1) * 4),
    ):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.randint(1, 120, (1, 9)), **cache_kw(cache), use_cache=True)
        assert cache_nbytes(cache) == expected


# ------------------------------------------------------------------ refused configurations
# Static caches, compiled decoding and cropping (assisted / prompt-lookup decoding): tests/test_generation_modes.py.
def test_cache_already_holding_keys_at_a_primal_layer_is_refused():
    # E.g. a cache filled by the stock model passed to its primal version: its KV entries cannot become sums.
    stock = GPT2LMHeadModel(gpt2_config()).eval()
    model = _gpt2([-1])
    ids = torch.randint(1, 120, (1, 5))
    cache = DynamicCache(config=stock.config)
    with torch.no_grad():
        stock(ids, **cache_kw(cache), use_cache=True)
        with pytest.raises(ValueError, match=r"layer 1 cannot use a DynamicCache whose layer is a DynamicLayer"):
            model(torch.randint(1, 120, (1, 1)), **cache_kw(cache), use_cache=True)


def test_sliding_window_cache_layer_at_a_primal_layer_is_refused():
    # Any KV layer kind other than dynamic / static (sliding window, quantized, ...) would keep keys a primal layer
    # never writes: refuse it by name rather than decode with stale keys.
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = _gpt2([-1])
    cache = DynamicCache(config=model.config)
    cache.layers[1] = DynamicSlidingWindowLayer(sliding_window=8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"layer 1 cannot use a DynamicCache whose layer is a "
                                                          r"DynamicSlidingWindowLayer.*not a quantized / sliding"):
        model(torch.randint(1, 120, (1, 3)), **cache_kw(cache), use_cache=True)


# ------------------------------------------------------------------ benchmark script
def test_benchmark_script_quick_mode(tmp_path, monkeypatch):
    cmd = [
        sys.executable, "-m", "scripts.benchmarks.generation", "--quick", "--contexts", "16,48",
        "--out-dir", str(tmp_path),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "generation_benchmark.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((r["variant"], int(r["context"])) for r in rows) == sorted(
        (v, c) for v in ("all-primal", "last-layer-primal", "stock-sdpa") for c in (16, 48)
    )
    for row in rows:
        for key in ("latency_ms", "cache_bytes", "peak_rss_mb", "decode_peak_rss_mb", "prefill_s"):
            assert float(row[key]) > 0, (key, row)
    cache = {(r["variant"], int(r["context"])): int(r["cache_bytes"]) for r in rows}
    # Tiny shape: 2 layers, 4 heads, head dim 16, fp32, batch 1.
    assert cache[("stock-sdpa", 48)] == 2 * 2 * 48 * 64 * 4
    assert cache[("all-primal", 16)] == cache[("all-primal", 48)] == 2 * (2 * 64 + 1) * 4
    assert cache[("last-layer-primal", 48)] == (2 * 48 * 64 + 2 * 64 + 1) * 4
    # Every "x stock" column is the row's raw figure over the stock row's at the same context, recomputed here.
    raw = {(r["variant"], r["context"]): r for r in rows}
    for row in rows:
        stock = raw[("stock-sdpa", row["context"])]
        for key in ("latency_ms", "cache_bytes", "decode_peak_rss_mb"):
            assert float(row[f"{key}_vs_stock"]) == pytest.approx(float(row[key]) / float(stock[key]), rel=1e-6), key
    assert float(raw[("all-primal", "48")]["cache_bytes_vs_stock"]) == pytest.approx((2 * 64 + 1) / (2 * 48 * 64))
    png = tmp_path / "generation_benchmark.png"
    assert png.stat().st_size > 10_000
    assert "x stock" in result.stdout and "all-primal" in result.stdout
    # Compiled static-cache decoding (aot_eager in quick mode): both variants at the quick context; each worker
    # checked that its compiled greedy tokens equal eager decoding on the dynamic cache.
    with open(tmp_path / "generation_compiled.csv") as handle:
        compiled = {r["variant"]: r for r in csv.DictReader(handle)}
    assert set(compiled) == {"all-primal", "stock-sdpa"}
    for row in compiled.values():
        assert row["context"] == "16" and row["backend"] == "aot_eager" and row["tokens_match"] == "True"
        assert 0 < float(row["compiled_ms_min"]) <= float(row["compiled_ms"]) <= float(row["compiled_ms_max"])
    ratio = float(compiled["stock-sdpa"]["compiled_ms"]) / float(compiled["all-primal"]["compiled_ms"])
    assert float(compiled["all-primal"]["compiled_ms_vs_stock"]) == pytest.approx(ratio, rel=1e-6)

    # --replot redraws from the CSV alone, with the numbers read back as numbers.
    from scripts.benchmarks import generation as bench

    png.unlink()
    replotted = bench.main(["--replot", "--out-dir", str(tmp_path)])
    assert {(r["variant"], r["context"]): r["cache_bytes"] for r in replotted} == cache
    assert png.stat().st_size > 10_000


def test_benchmark_ratios_on_known_timings(monkeypatch):
    from scripts.benchmarks import generation as bench

    figures = dict(latency_ms=8.0, cache_bytes=4000, peak_rss_mb=100.0, decode_peak_rss_mb=50.0)
    rows = [
        {"variant": bench.BASELINE, "context": 64, **figures},
        {"variant": "all-primal", "context": 64, "latency_ms": 2.0, "cache_bytes": 40, "peak_rss_mb": 80.0,
         "decode_peak_rss_mb": 25.0},
        {"variant": "all-primal", "context": 128, **figures},  # no stock row at this context
    ]
    bench.add_ratios(rows)
    assert [rows[1][f"{k}_vs_stock"] for k in figures] == [0.25, 0.01, 0.8, 0.5]
    assert all(rows[0][f"{k}_vs_stock"] == 1.0 for k in figures)
    assert all(math.isnan(rows[2][f"{k}_vs_stock"]) for k in figures)
