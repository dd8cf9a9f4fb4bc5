import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import BertConfig, GPT2Config, ViTConfig

import hf_primal  # noqa: F401  (installs the hooks under test)
from hf_primal.modeling.cache import cache_kwarg


def cache_kw(cache) -> dict:
    """``{"cache": cache}`` (transformers >= 5.24) or ``{"past_key_values": cache}`` (5.23), to pass as ``**``."""
    return {cache_kwarg(): cache}


def returned_cache(output):
    """The cache on a model / generate() output, whichever name this transformers release gives it."""
    return getattr(output, cache_kwarg())


def capture_layer_io(module):
    """Record an attention module's input hidden states ("x") and its output ("out") at every forward."""
    store = {}

    def hook(mod, args, kwargs, output):
        store["x"] = args[0] if args else kwargs["hidden_states"]
        store["out"] = output[0]

    return store, module.register_forward_hook(hook, with_kwargs=True)


def primal_block_indices(model):
    """Indices of the GPT-2 blocks whose attention is primal."""
    return [i for i, block in enumerate(model.transformer.h) if getattr(block.attn, "_is_primal_attention", False)]


def largest_steps(model, before: dict) -> tuple[float, float]:
    """(primal, other): the largest change of any primal-layer parameter and of any other parameter since `before`
    (name -> tensor). With AdamW every parameter moves by about its group's learning rate per step."""
    steps = {True: 0.0, False: 0.0}
    for name, p in model.named_parameters():
        primal = ".primal." in name
        steps[primal] = max(steps[primal], float((p.detach() - before[name]).abs().max()))
    return steps[True], steps[False]


def bert_config(**kw):
    base = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=120,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    base.update(kw)
    return BertConfig(**base)


def vit_config(**kw):
    base = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=4, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    base.update(kw)
    return ViTConfig(**base)


def gpt2_config(**kw):
    base = dict(
        n_embd=32, n_layer=2, n_head=4, vocab_size=120, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    base.update(kw)
    return GPT2Config(**base)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


SESSION_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    # A benchmark job run in-process sets torch's thread count for the rest of the process; tests that compare this
    # process's outputs bit for bit with a child's (child_env) need both to split their kernels the same way.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def child_env(**extra: str) -> dict:
    """Environment of a child Python process that must compute exactly what this one computes: offline, without
    this checkout on PYTHONPATH (so it imports only what is installed) and with this process's torch thread count
    (kernels split their sums by thread, so a different count can change the last bits)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(torch.get_num_threads()))
    env.update(extra)
    return env


# Tests that take 5 s or more on 2 CPU cores (fresh subprocesses, `accelerate launch`, torch.compile, the notebook,
# the demo, benchmark and training scripts; measured with --durations), in one place: "file.py" marks a whole file,
# "file.py::test" every parametrisation of one test. `python -m pytest -m "not slow" tests` runs the rest (README,
# "Tests"); tests/test_markers.py checks that every entry names an existing test.
SLOW = {
    "test_benchmark_conversion.py",
    "test_benchmark_conversion_tasks.py",
    "test_benchmark_causal_lm.py::test_quick_run_has_every_row_a_constant_primal_state_and_does_not_rerun",
    "test_benchmark_long_documents.py::test_quick_run_has_every_job_and_a_reproducible_row",
    "test_benchmark_long_documents.py::test_quick_run_summary_and_timing_ratios_from_the_raw_rows",
    "test_benchmark_peers.py",
    "test_benchmark_script.py",
    "test_benchmark_uncertainty.py::test_quick_run_has_every_method_and_sane_metrics",
    "test_compile.py",
    "test_distributed.py",
    "test_notebook.py",
    "test_run_gpu_benchmarks.py",
    "test_readme.py",
    "test_resume.py::test_two_processes_killed_after_a_checkpoint_resume_to_the_uninterrupted_result",
    "test_architectures.py::test_remote_code_loads_every_head_without_hf_primal",
    "test_architectures.py::test_save_reload_in_a_fresh_process_is_exact",
    "test_cli_and_sharing.py::test_base_conversion_loads_with_every_head_without_plugin",
    "test_cli_and_sharing.py::test_plain_save_pretrained_writes_the_shareable_form",
    "test_cli_and_sharing.py::test_processors_load_without_prompt",
    "test_convert_hub.py::test_demo_reduced_mode",
    "test_generation.py::test_benchmark_script_quick_mode",
    "test_models.py::test_models_without_option_are_stock_bit_for_bit",
    "test_scripts.py::test_causal_lm_command_line_from_scratch_with_bert_tokenizer",
    "test_transformers_contract.py::test_shareable_vit_loads_its_own_weights_with_and_without_the_plugin",
}


# Property-based tests (tests/test_fuzz.py): "ci" (few examples, derandomised: the normal run never flakes) unless
# `--hypothesis-profile=long` asks for a long exploration with fresh random draws.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=1000, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])


def pytest_configure(config):
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("ci")
    config.addinivalue_line("markers", "slow: takes 5 s or more on 2 CPU cores; -m 'not slow' leaves it out")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW or f"{item.path.name}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)
