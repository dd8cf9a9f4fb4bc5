"""Every architecture in the registry (hf_primal/models/), one tiny model each (tests/architectures.py): parity with
the loop-by-loop reference, padding invariance, the from_pretrained load report, LoRA on q/k, a fresh-process round
trip, remote code without hf_primal, and cached generation where the architecture can be causal."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from peft import get_peft_model

import hf_primal
from hf_primal import PrimalAttentionConfig
from hf_primal.integration.hub import REMOTE_CODE_FILES, hub_heads
from hf_primal.modeling.cache import PrimalCacheLayer
from hf_primal.models import ARCHITECTURES, BY_NAME, find_architecture
from tests.architectures import CASES, inputs, pad_id
from tests.conftest import cache_kw, capture_layer_io, child_env
from tests.reference import reference_causal, reference_gammas, reference_noncausal

NAMES = [a.name for a in ARCHITECTURES]
TEXT = [n for n in NAMES if not CASES[n].image]
DECODERS = [n for n in NAMES if CASES[n].decoder]
PRIMAL_TENSORS = ("We", "Wr", "Lambda", "head_map.weight", "head_map.bias")


def test_every_registered_architecture_is_tested():
    assert set(CASES) == set(BY_NAME)
    for name, case in CASES.items():
        model = case.model("base")
        assert find_architecture(model) is BY_NAME[name]
        assert len(BY_NAME[name].list_layers(model)) == 2


def _base(model):
    return getattr(model, model.base_model_prefix, model)


def _split(t, heads=4):
    batch, length, channels = t.shape
    return t.view(batch, length, heads, channels // heads).transpose(1, 2)


def _project_qk(attn, architecture, x):
    if len(architecture.qk_names) == 1:  # GPT-2's fused c_attn: q, k, v thirds
        qkv = getattr(attn, architecture.qk_names[0])(x)
        width = x.shape[-1]
        return _split(qkv[..., :width]), _split(qkv[..., width:2 * width])
    query, key = (getattr(attn, n) for n in architecture.qk_names)
    return _split(query(x)), _split(key(x))


VARIANTS = [pytest.param(n, False, id=n) for n in NAMES] + [
    pytest.param(n, True, id=f"{n}-decoder") for n in NAMES if CASES[n].decoder_flags
]


@pytest.mark.parametrize("name, decoder", VARIANTS)
def test_layer_matches_the_reference(name, decoder):
    case, architecture = CASES[name], BY_NAME[name]
    flags = dict(case.decoder_flags) if decoder else {}
    model = case.model("base", primal_attention={"layers": "all", "low_rank": 5, "rank_multi": 2}, **flags).eval()
    attn = architecture.list_layers(_base(model))[1][1]
    causal = architecture.causal(model.config)
    rule = PrimalAttentionConfig().sampling  # the default rule of a new config
    assert causal == (decoder or name == "gpt2") and attn.primal.sampling == rule
    assert attn.primal.num_samples == (0 if causal else 10)  # p = min(N_max, 5 * 2)
    batch = inputs(name, model.config, length=14, lengths=[14, 9, 3])  # 3 tokens < p: tokens repeat
    store, handle = capture_layer_io(attn)
    with torch.no_grad():
        model(**batch)
    handle.remove()
    x = store["x"]
    q, k = _project_qk(attn, architecture, x)
    valid = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(x.shape[:2], dtype=torch.bool)
    core = attn.primal
    weights = (core.We, core.Wr, core.head_map.weight, core.head_map.bias)
    if causal:
        y, _, _ = reference_causal(q, k, valid, *weights, gammas=reference_gammas(q.shape[1]))  # the default rule
    else:
        y, _, _ = reference_noncausal(x, q, k, valid, *weights, rule=rule)
    expected = y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    if architecture.out_name:
        expected = getattr(attn, architecture.out_name)(expected.float()).double()
    assert (store["out"].double()[valid] - expected[valid]).abs().max() <= 1e-5


def _alone_vs_padded(model, name, side, length, total=20):
    """Max difference at real tokens between one sequence run alone and the same sequence padded in a batch."""
    batch = inputs(name, model.config, batch=2, length=total, lengths=[length, total], side=side, seed=1)
    real = batch["attention_mask"][0].bool()
    alone = {"input_ids": batch["input_ids"][:1, real]}
    # RoBERTa numbers positions itself, skipping its pad id; the others are told the positions of left padding.
    if side == "left" and name != "roberta":
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = model(**alone).last_hidden_state[0]
        b = model(**batch).last_hidden_state[0, real]
    return (a - b).abs().max()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", TEXT)
def test_padding_invariance(name, side):
    model = CASES[name].model("base", primal_attention={"layers": "all", "low_rank": 4, "rank_multi": 3}).eval()
    for length in (3, 11):  # shorter and longer than p = 12
        assert _alone_vs_padded(model, name, side, length) <= 1e-5, length
    # The check can fail: with the (left) padding marked as real tokens the outputs differ, causal models included.
    # (Positions continue through the padding: a restart would mark a packed sequence, which is kept apart.)
    leaky = inputs(name, model.config, batch=2, length=20, lengths=[3, 20], side="left")
    leaky["attention_mask"] = torch.ones_like(leaky["attention_mask"])
    alone = {"input_ids": leaky["input_ids"][:1, -3:]}
    if name != "roberta":
        leaky["position_ids"] = torch.arange(20).expand(2, 20)
        alone["position_ids"] = torch.arange(17, 20)[None]
    with torch.no_grad():
        a = model(**alone).last_hidden_state[0]
        b = model(**leaky).last_hidden_state[0, -3:]
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_from_pretrained_load_report(tmp_path, name):
    case, architecture = CASES[name], BY_NAME[name]
    stock = case.model("base")
    stock.save_pretrained(tmp_path)
    auto = getattr(transformers, case.auto_head)
    _, plain = auto.from_pretrained(tmp_path, output_loading_info=True)
    model, info = auto.from_pretrained(tmp_path, primal_attention={"layers": [-1], "low_rank": 4},
                                       output_loading_info=True)
    path, attn = architecture.list_layers(_base(model))[-1]
    prefix = f"{model.base_model_prefix}." if _base(model) is not model else ""
    # Exactly the new primal tensors are newly initialised beyond what the stock head load reports, and the dropped
    # value projection is not reported as unused.
    new = {f"{prefix}{path}.primal.{tensor}" for tensor in PRIMAL_TENSORS}
    assert set(info["missing_keys"]) == set(plain["missing_keys"]) | new
    assert set(info["unexpected_keys"]) == set(plain["unexpected_keys"])
    assert not info["mismatched_keys"]
    stock_attn = architecture.list_layers(stock)[-1][1]
    for sub in (*architecture.qk_names, *([architecture.out_name] if architecture.out_name else [])):
        assert torch.equal(getattr(stock_attn, sub).weight, getattr(attn, sub).weight), sub
        assert torch.equal(getattr(stock_attn, sub).bias, getattr(attn, sub).bias), sub
    if architecture.value_attr:
        assert not hasattr(attn, architecture.value_attr)
        assert hasattr(architecture.list_layers(_base(model))[0][1], architecture.value_attr)  # softmax layer keeps it
    we = attn.primal.We.flatten(1)
    assert torch.allclose(we @ we.T, torch.eye(we.shape[0]), atol=1e-5)  # docs/method.md "Initialisation"


@pytest.mark.parametrize("name", NAMES)
def test_lora_targets_the_qk_projections(name):
    architecture = BY_NAME[name]
    model = CASES[name].model("head", primal_attention={"layers": [-1], "low_rank": 4})
    config = hf_primal.lora_config(model)
    assert set(config.target_modules) == set(architecture.qk_names) and "primal" in config.modules_to_save
    peft_model = get_peft_model(model, config)
    batch = inputs(name, model.config, lengths=[9, 6, 9])
    peft_model(**batch).logits.float().square().mean().backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    lora = [n for n in grads if "lora_B" in n]
    assert len(lora) == 2 * len(architecture.qk_names)  # two layers
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in lora)
    assert any(n.endswith("primal.modules_to_save.default.We") and grads[n] is not None for n in grads)


def _child(code, cwd, plugin):
    env = child_env()
    block = "" if plugin else "import sys; sys.modules['hf_primal'] = None  # as where hf_primal is not installed\n"
    return subprocess.run([sys.executable, "-c", block + textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def _saved_models(tmp_path, convert):
    """Every architecture with primal layers, saved; {name: (folder, inputs, output)}.

    `convert`: a converted base model saved with `save_converted` (every head loads from it), output its last hidden
    state; else a head model built with primal_attention and saved with save_pretrained, output its logits.
    """
    saved = {}
    for name in NAMES:
        case = CASES[name]
        torch.manual_seed(0)
        if convert:
            model = hf_primal.convert(case.model("base"), {"layers": [0, -1], "low_rank": 4, "rank_multi": 2})
        else:
            model = case.model("head", primal_attention={"layers": "all", "low_rank": 4, "rank_multi": 2})
        model.eval()
        batch = inputs(name, model.config, lengths=[9, 6, 9])
        with torch.no_grad():
            output = model(**batch)
        folder = tmp_path / name
        if convert:
            hf_primal.save_converted(model, folder)
        else:
            model.save_pretrained(folder)
        torch.save(batch, tmp_path / f"{name}.pt")
        saved[name] = (folder, batch, output.last_hidden_state if convert else output.logits)
    return saved


def test_save_reload_in_a_fresh_process_is_exact(tmp_path):
    saved = _saved_models(tmp_path, convert=False)
    result = _child(f"""
        import torch, hf_primal, transformers
        out = {{}}
        for name, auto in {[(n, CASES[n].auto_head) for n in NAMES]!r}:
            model = getattr(transformers, auto).from_pretrained({str(tmp_path)!r} + "/" + name).eval()
            assert len(hf_primal.primal_layers(model)) == 2, name
            with torch.no_grad():
                out[name] = model(**torch.load({str(tmp_path)!r} + f"/{{name}}.pt")).logits
        torch.save(out, {str(tmp_path / 'out.pt')!r})
        """, tmp_path, plugin=True)
    assert result.returncode == 0, result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    for name, (_, _, logits) in saved.items():
        assert torch.equal(out[name], logits), name


def test_remote_code_loads_every_head_without_hf_primal(tmp_path):
    saved = _saved_models(tmp_path, convert=True)
    for name, (folder, _, _) in saved.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == f"primal_{name}"
        assert config["primal_attention"]["sampling"] == PrimalAttentionConfig().sampling
        assert set(config["auto_map"]) == {"AutoConfig", *hub_heads(name)}
        assert {"AutoModel", CASES[name].auto_head} <= set(config["auto_map"])
        assert all(v.startswith(f"modeling_primal_{name}.Primal") for v in config["auto_map"].values())
        files = set(os.listdir(folder))
        expected = {"config.json", "model.safetensors", f"modeling_primal_{name}.py", *REMOTE_CODE_FILES, "README.md"}
        assert expected <= files
        # The code is flat: every relative import names a module saved beside it (what transformers' loader follows).
        for source in [f for f in files if f.endswith(".py")]:
            text = (folder / source).read_text()
            assert "from .." not in text, source
            assert {f"{m}.py" for m in re.findall(r"^\s*from \.(\w+) import", text, re.MULTILINE)} <= files, source
    # A folder as hf_primal 0.1 wrote it (no "sampling" field) keeps the legacy rule under remote code too.
    shutil.copytree(saved["bert"][0], tmp_path / "bert-0.1")
    old = json.loads((tmp_path / "bert-0.1" / "config.json").read_text())
    del old["primal_attention"]["sampling"]
    (tmp_path / "bert-0.1" / "config.json").write_text(json.dumps(old))
    result = _child(f"""
        import json, sys, torch, transformers
        assert sys.modules["hf_primal"] is None
        out = {{}}
        for name in {NAMES!r}:
            folder = {str(tmp_path)!r} + "/" + name
            batch = torch.load(folder + ".pt")
            out[name] = {{}}
            for auto in json.load(open(folder + "/config.json"))["auto_map"]:
                if auto == "AutoConfig":
                    continue
                model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
                layers = [type(m).__name__ for m in model.modules() if hasattr(m, "primal")]
                with torch.no_grad():
                    hidden = model.base_model(**batch).last_hidden_state
                out[name][auto] = (type(model).__name__, type(model).__module__, layers, hidden)
        old = transformers.AutoModel.from_pretrained({str(tmp_path / 'bert-0.1')!r}, trust_remote_code=True)
        cores = {{m.sampling for m in old.modules() if hasattr(m, "sampling")}}
        out["rules"] = (old.config.primal_attention["sampling"], cores)
        torch.save(out, {str(tmp_path / 'remote.pt')!r})
        """, tmp_path, plugin=False)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "remote.pt")
    assert remote.pop("rules") == ("legacy", {"legacy"})
    for name, (folder, batch, hidden) in saved.items():
        attention = BY_NAME[name].primal_class.__name__
        assert set(remote[name]) == set(hub_heads(name))
        for auto, (cls, module, layers, states) in remote[name].items():
            assert cls.startswith("Primal") and module.startswith("transformers_modules"), (name, auto, cls, module)
            assert layers == [attention] * 2, (name, auto, layers)
            assert torch.equal(states, hidden), (name, auto)  # every head holds the converted base model
        # With the plugin installed, no remote code is needed and the result is the same.
        again = transformers.AutoModel.from_pretrained(folder).eval()
        assert type(again).__module__ == f"hf_primal.models.{name}"
        with torch.no_grad():
            assert torch.equal(again(**batch).last_hidden_state, hidden), name


@pytest.mark.parametrize("name", DECODERS)
def test_cached_generation_matches_full_recomputation(name):
    case = CASES[name]
    config = case.config(initializer_range=0.3, primal_attention={"layers": "all", "low_rank": 4},
                         **dict(case.decoder_flags))
    model = getattr(transformers, case.decoder)(config).eval()
    model.generation_config.eos_token_id = None  # run every step
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        cache = transformers.DynamicCache(config=model.config)
        steps = [model(ids[:, :5], **cache_kw(cache), use_cache=True).logits]
        for t in range(5, 12):
            steps.append(model(ids[:, t:t + 1], **cache_kw(cache), use_cache=True).logits)
        mask = torch.ones(2, 4, dtype=torch.long)
        cached = model.generate(ids[:, :4], attention_mask=mask, max_new_tokens=10, do_sample=False,
                                pad_token_id=pad_id(config))
        uncached = model.generate(ids[:, :4], attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  use_cache=False, pad_token_id=pad_id(config))
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5
    assert all(isinstance(layer, PrimalCacheLayer) and layer.seen == 12 for layer in cache.layers)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("method", ["transfer", "distill"])
@pytest.mark.parametrize("name", NAMES)
def test_convert_by_transfer_and_distillation(tmp_path, name, method):
    case = CASES[name]
    torch.manual_seed(0)
    model = case.model("head", initializer_range=0.2)
    config = model.config
    batches = [inputs(name, config, batch=4, length=10, lengths=[10, 7, 10, 5], seed=s) for s in range(10)]
    if case.image:
        batches = [inputs(name, config, batch=4, seed=s) for s in range(10)]
    torch.manual_seed(1)
    converted = hf_primal.convert(model, {"layers": [-1], "low_rank": 4, "rank_multi": 2}, batches, method=method,
                                  steps=20, learning_rate=3e-3 if method == "transfer" else 1e-3, progress=False)
    report = converted.primal_conversion_report
    assert report["method"] == method and len(hf_primal.primal_layers(converted)) == 1
    if method == "transfer":
        (row,) = report["layers"]
        assert row["error_after"] < row["error_before"], row
    else:
        assert report["distillation"]["loss_after"] < report["distillation"]["loss_before"]
    converted.eval()
    with torch.no_grad():
        want = converted(**batches[0]).logits
    hf_primal.save_converted(converted, tmp_path / "out")
    reloaded = getattr(transformers, case.auto_head).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batches[0]).logits, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_every_primal_class_is_findable_by_name_in_its_module(name):
    # The attention class is a `class` statement; the config and model twins, made by define_architecture, are
    # listed by name in __all__, which must be exactly what the module holds (a new head in transformers shows up
    # here as a missing name).
    module = sys.modules[BY_NAME[name].primal_class.__module__]
    source = Path(module.__file__).read_text(encoding="utf-8")
    made = {n for n, v in vars(module).items() if isinstance(v, type) and n.startswith("Primal")
            and v.__module__ == module.__name__}
    assert set(module.__all__) == made | {"ARCHITECTURE"}
    assert re.search(rf"^class {BY_NAME[name].primal_class.__name__}\(", source, re.MULTILINE)
    assert all(f'"{n}"' in source for n in made)
