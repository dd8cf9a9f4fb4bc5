"""Each transformers hook of a primal model does its work once (hf_primal/modeling/hooks.py), whichever class
carries it.

The global patches act on models whose config asks for primal attention; the shareable Primal* classes carry the
same hooks as methods for where hf_primal is not installed, and defer to the patches where it is. Counted here, for
stock classes, hf_primal's shareable classes and a shareable class loaded from a folder's remote code (with
hf_primal imported): every attention layer is made primal once, every primal core initialised once, and every
generate() call prepares its cache once, with one copy of the layer and cache classes.
"""

import sys
from collections import Counter

import pytest
import torch
import transformers
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from hf_primal.modeling import hooks
from hf_primal.models import bert as bert_module
from hf_primal.models import gpt2 as gpt2_module
from tests.conftest import bert_config, gpt2_config

SPEC = {"layers": "all", "low_rank": 4}
CORES = 2  # both layers of the tiny configs


def _count(monkeypatch, module, counts):
    """Count the work done through `module` (a copy of hooks.py): conversions (per model object: a head model and
    the stock base model inside it are each converted by their own post_init), cores built, cores initialised (per
    core), caches prepared."""
    core_class = sys.modules[module.__name__.rsplit(".", 1)[0] + ".primal"].PrimalCore
    original_core_init = core_class.__init__

    def core_init(self, *args, **kwargs):
        counts["cores built"] += 1
        original_core_init(self, *args, **kwargs)

    monkeypatch.setattr(core_class, "__init__", core_init)
    original_convert = module.convert_layers
    monkeypatch.setattr(module, "convert_layers", lambda model, *a, **k: (counts.update([("convert", id(model))]),
                                                                          original_convert(model, *a, **k))[1])
    original_init, original_prepare = module.init_primal_core, module.prepare_primal_cache
    monkeypatch.setattr(module, "init_primal_core", lambda core: (counts.update([("init", id(core))]),
                                                                  original_init(core))[1])
    monkeypatch.setattr(module, "prepare_primal_cache", lambda *a, **k: (counts.update(["caches prepared"]),
                                                                         original_prepare(*a, **k))[1])


def _per_object(counts, what):
    return [n for key, n in counts.items() if isinstance(key, tuple) and key[0] == what]


def _converted_once(counts):
    return bool(_per_object(counts, "convert")) and set(_per_object(counts, "convert")) == {1}


def _initialised_once(counts):
    inits = _per_object(counts, "init")
    return len(inits) == CORES and set(inits) == {1} and _converted_once(counts)


@pytest.fixture
def counts(monkeypatch):
    counts = Counter()
    _count(monkeypatch, hooks, counts)
    return counts


def _generate(model):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(torch.tensor([[5, 17, 3, 90]]), max_new_tokens=3, do_sample=False, pad_token_id=0)


ENCODERS = {
    "stock base": lambda c: transformers.BertModel(c),
    "stock head": lambda c: transformers.BertForSequenceClassification(c),
    "shareable base": lambda c: bert_module.PrimalBertModel(c),
    "shareable head": lambda c: bert_module.PrimalBertForSequenceClassification(c),
}


@pytest.mark.parametrize("kind", ENCODERS)
def test_encoder_layers_are_converted_and_initialised_once(kind, counts):
    model = ENCODERS[kind](bert_config(primal_attention=SPEC))
    assert counts["cores built"] == CORES and _initialised_once(counts), counts
    assert sum(getattr(m, "_is_primal_core", False) for m in model.modules()) == CORES


@pytest.mark.parametrize("shareable", [False, True], ids=["stock class", "shareable class"])
def test_decoder_prepares_each_generation_cache_once(shareable, counts):
    cls = gpt2_module.PrimalGPT2LMHeadModel if shareable else transformers.GPT2LMHeadModel
    model = cls(gpt2_config(primal_attention=SPEC)).eval()
    assert counts["cores built"] == CORES and _initialised_once(counts), counts
    counts.clear()
    _generate(model)
    _generate(model)
    assert counts == {"caches prepared": 2}


def test_remote_code_class_with_the_plugin_does_each_hook_once(tmp_path, monkeypatch, counts):
    source = transformers.GPT2LMHeadModel(gpt2_config(primal_attention=SPEC)).eval()
    source.save_pretrained(tmp_path / "shared")
    reference = _generate(source)
    # With the plugin, the Auto classes pick hf_primal's own class; take the folder's code as a program that
    # resolves the auto_map itself would.
    remote_class = get_class_from_dynamic_module("modeling_primal_gpt2.PrimalGPT2LMHeadModel", tmp_path / "shared")
    assert remote_class.__module__.startswith("transformers_modules")
    remote = Counter()
    _count(monkeypatch, sys.modules[remote_class.__module__.rsplit(".", 1)[0] + ".hooks"], remote)
    counts.clear()
    model = remote_class.from_pretrained(tmp_path / "shared").eval()
    assert counts["cores built"] == CORES and not remote  # hf_primal's patches did the work, the folder's code none
    assert _converted_once(counts), counts
    layers = {type(m).__module__ for m in model.modules() if getattr(m, "_is_primal_attention", False)}
    assert layers == {"hf_primal.models.gpt2"}
    counts.clear()
    assert torch.equal(_generate(model), reference)
    assert counts == {"caches prepared": 1} and not remote


def test_shareable_methods_run_the_hooks_where_hf_primal_is_not_installed(monkeypatch):
    # What a folder's remote code does without the plugin: transformers' own methods in place, the classes' own
    # hook methods convert, initialise and prepare the cache.
    from transformers import GenerationMixin, PreTrainedModel

    for owner, name in ((PreTrainedModel, "post_init"), (PreTrainedModel, "_init_weights"),
                        (GenerationMixin, "_prepare_cache_for_generation")):
        patched = getattr(owner, name)
        assert hooks.global_hook_installed(patched)
        monkeypatch.setattr(owner, name, patched.__wrapped__)
        assert not hooks.global_hook_installed(getattr(owner, name))
    counts = Counter()
    _count(monkeypatch, hooks, counts)
    model = gpt2_module.PrimalGPT2LMHeadModel(gpt2_config(primal_attention=SPEC)).eval()
    assert counts["cores built"] == CORES and _initialised_once(counts), counts
    counts.clear()
    _generate(model)
    assert counts == {"caches prepared": 1}
