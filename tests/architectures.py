"""One tiny test model per registered architecture (hidden 32, 2 layers, 4 heads), for the registry-wide tests.

Adding an architecture to hf_primal/models/ without a row here fails `test_every_registered_architecture_is_tested`.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import transformers

from tests.conftest import bert_config, gpt2_config, vit_config

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
DROPOUT_OFF = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def roberta_config(**kw):
    # Positions start after pad_token_id = 1, so 66 position embeddings hold 64 tokens.
    return transformers.RobertaConfig(**{**TINY, **DROPOUT_OFF, "vocab_size": 120, "max_position_embeddings": 66, **kw})


def distilbert_config(**kw):
    base = dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=120, max_position_embeddings=64,
                dropout=0.0, attention_dropout=0.0)
    return transformers.DistilBertConfig(**{**base, **kw})


def deit_config(**kw):
    return transformers.DeiTConfig(**{**TINY, **DROPOUT_OFF, "image_size": 16, "patch_size": 4, "num_labels": 3, **kw})


@dataclass(frozen=True)
class Case:
    config: Callable  # **kwargs -> a tiny config of the architecture
    base: str  # the base model class (transformers attribute name)
    head: str  # a model class with a head and logits
    auto_head: str  # the Auto class that loads `head`
    image: bool = False
    decoder: str = ""  # the causal-LM class when the architecture can run as a decoder
    decoder_flags: tuple = ()  # config settings that make it a decoder
    # Padding-free (packed) rows: whether transformers' stock model keeps packed sequences apart (marked by restarting
    # position_ids), and the first position id of a sequence.
    packing: bool = True
    first_position: int = 0

    def model(self, kind: str = "head", **config_kw):
        return getattr(transformers, getattr(self, kind))(self.config(**config_kw))


CASES = {
    "bert": Case(bert_config, "BertModel", "BertForSequenceClassification", "AutoModelForSequenceClassification",
                 decoder="BertLMHeadModel", decoder_flags=(("is_decoder", True),)),
    "vit": Case(vit_config, "ViTModel", "ViTForImageClassification", "AutoModelForImageClassification", image=True),
    "gpt2": Case(gpt2_config, "GPT2Model", "GPT2LMHeadModel", "AutoModelForCausalLM", decoder="GPT2LMHeadModel"),
    "roberta": Case(roberta_config, "RobertaModel", "RobertaForSequenceClassification",
                    "AutoModelForSequenceClassification", decoder="RobertaForCausalLM",
                    decoder_flags=(("is_decoder", True),), first_position=2),  # after pad_token_id = 1
    # Stock DistilBERT lets packed sequences see each other (its softmax differs from padded by 2e-2), and so do its
    # primal layers, which split rows where transformers' masks do.
    "distilbert": Case(distilbert_config, "DistilBertModel", "DistilBertForSequenceClassification",
                       "AutoModelForSequenceClassification", packing=False),
    "deit": Case(deit_config, "DeiTModel", "DeiTForImageClassification", "AutoModelForImageClassification",
                 image=True),
}


def pad_id(config) -> int:
    return config.pad_token_id if config.pad_token_id is not None else 0


def inputs(name: str, config, batch: int = 3, length: int = 9, lengths=None, side: str = "right", seed: int = 0):
    """Model inputs: images, or token ids (never the pad id) with `lengths` real tokens per row padded on `side`."""
    g = torch.Generator().manual_seed(seed)
    if CASES[name].image:
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    lengths = lengths or [length] * batch
    ids = torch.full((batch, length), pad_id(config), dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row, n in enumerate(lengths):
        real = slice(0, n) if side == "right" else slice(length - n, length)
        ids[row, real] = torch.randint(3, 120, (n,), generator=g)
        mask[row, real] = 1
    return {"input_ids": ids, "attention_mask": mask}
