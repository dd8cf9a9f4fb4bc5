"""Folders saved by an earlier layout of hf_primal keep loading, with the plugin and without it (remote code).

`tests/fixtures/flat_layout_folders/` holds two tiny shared folders and their outputs, written once by hf_primal's
flat module layout and never regenerated (see ABOUT.md there): the current package must read their config and
weights into the same model, and the remote code frozen inside them must still run on the installed transformers.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import hf_primal  # noqa: F401
from tests.conftest import child_env
from tests.helpers.flat_layout import FOLDERS, outputs, reference


def _assert_same(outputs):
    ref = reference()
    assert (outputs["bert_last_hidden_state"] - ref["bert_last_hidden_state"]).abs().max() <= 1e-5
    assert (outputs["gpt2_logits"] - ref["gpt2_logits"]).abs().max() <= 1e-5
    assert torch.equal(outputs["gpt2_greedy"], ref["gpt2_greedy"])


def test_flat_layout_folders_load_with_the_plugin():
    bert = transformers.AutoModel.from_pretrained(FOLDERS / "bert").eval()
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(FOLDERS / "gpt2").eval()
    gpt2.generation_config.eos_token_id = None
    # The current package's classes, not the code frozen in the folders.
    assert type(bert).__module__.startswith("hf_primal.") and type(gpt2).__module__.startswith("hf_primal.")
    primal = lambda block: any(getattr(m, "_is_primal_attention", False) for m in block.modules())
    assert [primal(layer) for layer in bert.encoder.layer] == [False, True]
    assert [primal(block) for block in gpt2.transformer.h] == [True, True]
    _assert_same(outputs(bert, gpt2))


def test_flat_layout_folders_load_without_the_plugin(tmp_path):
    for name in ("bert", "gpt2"):
        shutil.copytree(FOLDERS / name, tmp_path / name)  # the committed folders stay untouched
    code = f"""
        import sys; sys.modules["hf_primal"] = None  # as where hf_primal is not installed
        import torch, transformers
        sys.path.insert(0, {str(Path(__file__).parent / "helpers")!r})
        from flat_layout import outputs
        bert = transformers.AutoModel.from_pretrained({str(tmp_path / 'bert')!r}, trust_remote_code=True).eval()
        gpt2 = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'gpt2')!r},
                                                                 trust_remote_code=True).eval()
        gpt2.generation_config.eos_token_id = None
        assert type(bert).__module__.startswith("transformers_modules"), type(bert).__module__
        torch.save(outputs(bert, gpt2), {str(tmp_path / 'out.pt')!r})
        """
    env = child_env(HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same(torch.load(tmp_path / "out.pt"))


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_flat_layout_folders_are_what_they_say(name):
    # Guards the fixture itself: a folder rewritten by the current code would make the tests above vacuous.
    config = json.loads((FOLDERS / name / "config.json").read_text())
    assert config["model_type"] == f"primal_{name}"
    frozen = (FOLDERS / name / f"modeling_primal_{name}.py").read_text()
    assert "from .conversion import" in frozen or "from .shareable import" in frozen
    assert {"cache_layer.py", "static_cache.py", "conversion.py"} <= set(os.listdir(FOLDERS / name))
