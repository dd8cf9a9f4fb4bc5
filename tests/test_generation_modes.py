"""generate() modes beyond plain greedy / beam / sampling with primal GPT-2: static caches, compiled decoding,
assisted and prompt-lookup decoding (cache cropping), modelled on transformers' own generation tests
(test_generate_with_static_cache, test_generate_compile_model_forward_fullgraph,
test_static_cache_no_recompile_with_smaller_length, test_assisted_decoding_matches_greedy_search,
test_prompt_lookup_decoding_matches_greedy_search).

The reference in every test is plain greedy `generate` with the default dynamic cache (already checked against
full recomputation in test_generation.py), run independently of the mode under test.
"""

import pytest
import torch
import torch._dynamo as dynamo
from transformers import DynamicCache, DynamicLayer, GPT2LMHeadModel, StaticCache, StaticLayer
from transformers.generation import CompileConfig

from hf_primal.modeling.cache import PrimalCacheLayer, PrimalStaticCacheLayer
from tests.conftest import cache_kw, gpt2_config, primal_block_indices, returned_cache

LAYOUTS = [pytest.param("all", id="all-primal"), pytest.param([-1], id="last-layer-primal")]
HEADS, HEAD_DIM = 4, 8


def _gpt2(layers, seed=0, attn="sdpa", **primal):
    torch.manual_seed(seed)
    spec = None if layers is None else {"layers": layers, "low_rank": 4, **primal}
    config = gpt2_config(initializer_range=0.3, primal_attention=spec)
    config._attn_implementation = attn
    model = GPT2LMHeadModel(config).eval()
    model.generation_config.eos_token_id = None  # run every step; token 0 stays the pad token
    return model


def _greedy(model, ids, **kw):
    """Independent reference: plain greedy decoding with the default dynamic cache."""
    with torch.no_grad():
        return model.generate(ids, do_sample=False, return_dict_in_generate=True, output_logits=True, **kw)


def _left_padded(lengths):
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, 120, (n,))
        mask[row, width - n:] = 1
    return ids, mask


def _compile_config():
    config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # generate compiles only on accelerators unless told otherwise
    return config


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- static cache
@pytest.mark.parametrize("layers", LAYOUTS)
def test_generate_with_static_cache_matches_dynamic_cache(layers):
    model = _gpt2(layers)
    ids, mask = _left_padded([5, 9, 3])  # left padding: the static mask has a column per cache slot
    reference = _greedy(model, ids, attention_mask=mask, max_new_tokens=15)
    with torch.no_grad():
        static = model.generate(
            ids, attention_mask=mask, max_new_tokens=15, do_sample=False, cache_implementation="static",
            return_dict_in_generate=True, output_logits=True,
        )
    assert torch.equal(static.sequences, reference.sequences)
    assert _max_diff(static.logits, reference.logits) <= 1e-5
    assert len(set(reference.sequences[0, 9:].tolist())) > 3  # not one repeated token
    cache = returned_cache(static)
    assert isinstance(cache, StaticCache)
    primal = primal_block_indices(model)
    kinds = [PrimalStaticCacheLayer if i in primal else StaticLayer for i in range(model.config.n_layer)]
    assert [type(layer) for layer in cache.layers] == kinds
    for i in primal:  # fixed (B, H, d) sums and (B,) count, whatever the length
        layer = cache.layers[i]
        assert layer.state.sum_q.shape == layer.state.sum_k.shape == (3, HEADS, HEAD_DIM)
        assert layer.state_numel() == 3 * (2 * HEADS * HEAD_DIM + 1)
        assert int(layer.get_seq_length()) == 9 + 14  # the last token is never fed back
        assert layer.state.count.tolist() == [5 + 14, 9 + 14, 3 + 14]  # valid tokens only
    assert cache.is_compileable


@pytest.mark.parametrize("layers", LAYOUTS)
def test_generate_with_a_user_static_cache_and_from_inputs_embeds(layers):
    model = _gpt2(layers)
    ids = torch.randint(1, 120, (2, 6))
    reference = _greedy(model, ids, max_new_tokens=10)
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=16)
        given = model.generate(ids, max_new_tokens=10, do_sample=False, **cache_kw(cache))
        embeds = model.get_input_embeddings()(ids)
        from_embeds = model.generate(
            inputs_embeds=embeds, max_new_tokens=10, do_sample=False, cache_implementation="static"
        )
        dynamic_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=10, do_sample=False)
    assert torch.equal(given, reference.sequences)
    assert isinstance(cache.layers[primal_block_indices(model)[0]], PrimalStaticCacheLayer)
    assert torch.equal(from_embeds, dynamic_embeds)
    assert torch.equal(from_embeds, reference.sequences[:, 6:])


@pytest.mark.parametrize("layers", LAYOUTS)
def test_static_cache_refuses_attentions_and_overflow_with_clear_errors(layers):
    model = _gpt2(layers, attn="eager")
    ids = torch.randint(1, 120, (1, 5))
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions=True is not supported.*static cache"):
            model.generate(ids, max_new_tokens=3, cache_implementation="static", output_attentions=True,
                           return_dict_in_generate=True)
        cache = StaticCache(config=model.config, max_cache_len=6)
        model(ids, **cache_kw(cache), use_cache=True)
        layer = cache.layers[primal_block_indices(model)[0]]
        with pytest.raises(ValueError, match="holds 6 tokens"):
            layer.write(layer.state, 2)


# ---------------------------------------------------------------------------------------------- compiled decoding
@pytest.mark.parametrize("layers", LAYOUTS)
def test_compiled_forward_fullgraph_decodes_the_dynamic_cache_tokens(layers):
    model = _gpt2(layers)
    ids = torch.randint(1, 120, (2, 7))
    steps = 12
    reference = _greedy(model, ids, max_new_tokens=steps)

    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps)
    with torch.no_grad():
        logits = model(ids, **cache_kw(cache), use_cache=True).logits[:, -1]  # eager prefill, as generate does
        tokens, step_logits = [], [logits]
        for step in range(steps - 1):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            position = torch.full((2, 1), ids.shape[1] + step)
            logits = compiled(input_ids=token, **cache_kw(cache), use_cache=True, position_ids=position).logits[:, -1]
            step_logits.append(logits)
        tokens.append(logits.argmax(-1, keepdim=True))
    assert torch.equal(torch.cat([ids, *tokens], dim=1), reference.sequences)
    assert _max_diff(step_logits, reference.logits) <= 1e-5
    assert not dynamo.utils.counters["graph_break"]
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for every decoding step

    # The same through generate's own compiled decoding (compile_config, fullgraph=True).
    dynamo.reset()
    dynamo.utils.counters.clear()
    with torch.no_grad():
        auto = model.generate(ids, max_new_tokens=steps, do_sample=False, cache_implementation="static",
                              compile_config=_compile_config())
    assert torch.equal(auto, reference.sequences)
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1 and not dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("layers", LAYOUTS)
def test_static_cache_no_recompile_with_smaller_length(layers):
    model = _gpt2(layers)
    ids = torch.randint(1, 120, (1, 8))
    dynamo.reset()
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static",
                               compile_config=_compile_config())
        with dynamo.config.patch(error_on_recompile=True):
            second = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False, cache_implementation="static",
                                    compile_config=_compile_config())
    assert torch.equal(first, _greedy(model, ids, max_new_tokens=12).sequences)
    assert torch.equal(second, _greedy(model, ids[:, :5], max_new_tokens=6).sequences)


# ------------------------------------------------------------------------------------------ assisted / prompt lookup
@pytest.fixture
def crops(monkeypatch):
    """Every crop a primal cache layer performs (the number of tokens removed)."""
    seen = []
    crop = PrimalCacheLayer.crop

    def spy(self, tokens_to_remove):
        seen.append(-tokens_to_remove)
        crop(self, tokens_to_remove)

    monkeypatch.setattr(PrimalCacheLayer, "crop", spy)
    return seen


@pytest.mark.parametrize("assistant", ["stock", "primal"])
@pytest.mark.parametrize("layers", LAYOUTS)
def test_assisted_decoding_matches_greedy_search(layers, assistant, crops):
    model = _gpt2(layers)
    helper = _gpt2(None if assistant == "stock" else "all", seed=1)  # another tiny GPT-2 on the same vocabulary
    prompt = torch.randint(1, 120, (1, 6))
    reference = _greedy(model, prompt, max_new_tokens=25)
    with torch.no_grad():
        assisted = model.generate(
            prompt, assistant_model=helper, max_new_tokens=25, do_sample=False, return_dict_in_generate=True,
            output_logits=True,
        )
    assert torch.equal(assisted.sequences, reference.sequences)
    assert _max_diff(assisted.logits, reference.logits) <= 1e-5
    assert any(n > 0 for n in crops)  # rejected drafts were really rolled back


@pytest.mark.parametrize("layers", LAYOUTS)
def test_prompt_lookup_decoding_matches_greedy_search(layers, crops):
    model = _gpt2(layers)
    # Repeated n-grams give prompt lookup candidates to draft from; most get rejected by the random model.
    chunk = torch.randint(1, 120, (1, 5))
    prompt = torch.cat([chunk, torch.randint(1, 120, (1, 2)), chunk, chunk[:, :2]], dim=1)
    reference = _greedy(model, prompt, max_new_tokens=20)
    with torch.no_grad():
        lookup = model.generate(prompt, prompt_lookup_num_tokens=3, max_new_tokens=20, do_sample=False,
                                return_dict_in_generate=True, output_logits=True)
    assert torch.equal(lookup.sequences, reference.sequences)
    assert _max_diff(lookup.logits, reference.logits) <= 1e-5
    assert any(n > 0 for n in crops)


# ---------------------------------------------------------------------------------------------- crop itself
def _prefill(model, ids, window_recording=True):
    cache = DynamicCache(config=model.config)
    from hf_primal.modeling.hooks import prepare_primal_cache

    prepare_primal_cache(model, cache_kw(cache))
    if window_recording:
        cache.activate_past_recording()
    with torch.no_grad():
        model(ids, **cache_kw(cache), use_cache=True)
    return cache


@pytest.mark.parametrize("layers", LAYOUTS)
def test_crop_restores_the_state_of_the_token_it_returns_to(layers):
    model = _gpt2(layers)
    ids = torch.randint(1, 120, (2, 14))
    with torch.no_grad():
        full = model(ids).logits
        cache = _prefill(model, ids[:, :8])
        model(ids[:, 8:12], **cache_kw(cache), use_cache=True)  # 4 draft tokens ...
        cache.crop(-3)  # ... of which only the first is kept
        assert cache.get_seq_length() == 9
        continued = model(ids[:, 9:14], **cache_kw(cache), use_cache=True).logits
        cache.crop(-cache.get_seq_length())  # all the way back: an empty sequence
        restart = model(ids[:, :4], **cache_kw(cache), use_cache=True).logits
    assert (continued - full[:, 9:14]).abs().max() <= 1e-5
    assert (restart - full[:, :4]).abs().max() <= 1e-5


@pytest.mark.parametrize("layers", LAYOUTS)
def test_crop_beyond_the_window_raises_before_cropping_anything(layers):
    model = _gpt2(layers, crop_window=2)
    chunk = torch.randint(1, 120, (1, 5))
    ids = torch.cat([chunk, chunk[:, :4]], dim=1)  # its last token occurred before: prompt lookup drafts 5 tokens
    cache = _prefill(model, ids)
    primal = cache.layers[primal_block_indices(model)[0]]
    before = primal.state.sum_q.clone()
    assert primal.history_length() == 3  # the states after the last W + 1 tokens
    with pytest.raises(ValueError, match=r"Cannot crop 3 tokens.*crop_window=2"):
        cache.crop(-3)
    # Nothing was cropped, the softmax layer included.
    assert cache.get_seq_length() == 9 and all(layer.get_seq_length() == 9 for layer in cache.layers)
    assert torch.equal(primal.state.sum_q, before)
    cache.crop(-2)
    assert all(layer.get_seq_length() == 7 for layer in cache.layers)

    with pytest.raises(RuntimeError, match="does not record its past.*activate_past_recording"):
        _prefill(model, ids, window_recording=False).crop(-1)


@pytest.mark.parametrize("layers", LAYOUTS)
def test_drafts_longer_than_the_window_through_generate(layers, monkeypatch):
    # transformers >= 5.25 tells the cache how many tokens it drafts per step (the window widens to it); older
    # releases do not, and a draft longer than crop_window is refused naming the setting.
    model = _gpt2(layers, crop_window=2)
    chunk = torch.randint(1, 120, (1, 5))
    ids = torch.cat([chunk, chunk[:, :4]], dim=1)  # its last token occurred before: prompt lookup drafts 5 tokens
    told = []
    original = PrimalCacheLayer.activate_past_recording
    monkeypatch.setattr(PrimalCacheLayer, "activate_past_recording",
                        lambda self, *a, **kw: (told.append((a, kw)), original(self, *a, **kw))[1])
    lookup = dict(prompt_lookup_num_tokens=5, max_new_tokens=10, max_matching_ngram_size=1)
    with torch.no_grad():
        try:
            drafted = model.generate(ids, do_sample=False, return_dict_in_generate=True, output_logits=True, **lookup)
        except ValueError as error:
            assert "crop_window" in str(error)
            assert told and all(not a and not kw for a, kw in told)  # the cache was never told the draft length
            return
    assert told and all(kw == {"recurrent_states_to_keep": 5} for a, kw in told)
    reference = _greedy(model, ids, max_new_tokens=10)
    assert torch.equal(drafted.sequences, reference.sequences)
    assert _max_diff(drafted.logits, reference.logits) <= 1e-5


def test_recording_for_a_longer_draft_widens_the_window():
    model = _gpt2([-1], crop_window=2)
    ids = torch.randint(1, 120, (2, 14))
    cache = DynamicCache(config=model.config)
    from hf_primal.modeling.hooks import prepare_primal_cache

    prepare_primal_cache(model, cache_kw(cache))
    cache.activate_past_recording()
    layer = cache.layers[primal_block_indices(model)[0]]
    layer.activate_past_recording(recurrent_states_to_keep=6)  # what transformers >= 5.25's Cache passes on
    assert layer.crop_window == 6
    with torch.no_grad():
        full = model(ids).logits
        model(ids[:, :12], **cache_kw(cache), use_cache=True)
        cache.crop(-6)  # three times the configured window
        continued = model(ids[:, 6:14], **cache_kw(cache), use_cache=True).logits
    assert (continued - full[:, 6:14]).abs().max() <= 1e-5
    layer.activate_past_recording(recurrent_states_to_keep=1)  # a smaller request never narrows it
    assert layer.crop_window == 6
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"recurrent_states_to_keep must be a non-negative int.*" + repr(bad)[:2]):
            layer.activate_past_recording(recurrent_states_to_keep=bad)


def test_static_cache_crop_is_refused_before_cropping_the_softmax_layer():
    model = _gpt2([-1])
    ids = torch.randint(1, 120, (1, 6))
    cache = StaticCache(config=model.config, max_cache_len=12)
    with torch.no_grad():
        model(ids, **cache_kw(cache), use_cache=True)
    with pytest.raises(NotImplementedError, match="static cache cannot be cropped"):
        cache.crop(-2)
    assert int(cache.layers[0].get_seq_length()) == 6 and not cache.is_croppable
    if hasattr(StaticLayer, "crop"):  # transformers < 5.24: static layers have no crop at all, even of 0 tokens
        cache.crop(0)  # nothing to undo: allowed


@pytest.mark.parametrize("layers", LAYOUTS)
def test_recorded_state_is_bounded_by_the_window(layers):
    model = _gpt2(layers, crop_window=5)
    primal = primal_block_indices(model)
    sizes = set()
    for length in (3, 17, 40):
        cache = _prefill(model, torch.randint(1, 120, (2, length)))
        with torch.no_grad():
            for _ in range(3):
                model(torch.randint(1, 120, (2, 1)), **cache_kw(cache), use_cache=True)
        for i in primal:
            sizes.add(cache.layers[i].state_numel())
    per_token = 2 * (2 * HEADS * HEAD_DIM + 1)  # batch 2: sums (B, H, d) x 2 and count (B,)
    # The running state plus the states after the last W + 1 = 6 tokens (fewer only for a shorter context).
    assert sizes == {per_token + 6 * per_token}
    assert isinstance(cache.layers[primal[0]], PrimalCacheLayer)
    assert all(isinstance(cache.layers[i], DynamicLayer) for i in range(2) if i not in primal)


def test_crop_window_setting_is_validated_and_saved_only_when_changed():
    from hf_primal import PrimalAttentionConfig

    assert "crop_window" not in PrimalAttentionConfig().to_dict()  # config.json of default models is unchanged
    assert PrimalAttentionConfig.from_dict({"crop_window": 8}).to_dict()["crop_window"] == 8
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="crop_window"):
            PrimalAttentionConfig(crop_window=bad)
    model = _gpt2("all", crop_window=8)
    cache = _prefill(model, torch.randint(1, 120, (1, 20)))
    assert {layer.crop_window for layer in cache.layers} == {8}
    assert {layer.history_length() for layer in cache.layers} == {9}
