import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import hf_primal  # noqa: F401  (installs the hooks under test)
from hf_primal.cache import cache_kwarg
from transformers import BertConfig, GPT2Config, ViTConfig


def cache_kw(cache) -> dict:
    """``{"cache": cache}`` (transformers >= 5.24) or ``{"past_key_values": cache}`` (5.23), to pass as ``**``."""
    return {cache_kwarg(): cache}


def returned_cache(output):
    """The cache on a model / generate() output, whichever name this transformers release gives it."""
    return getattr(output, cache_kwarg())


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
