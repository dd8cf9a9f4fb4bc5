"""The encoder the timing benchmarks share (`layers`, `peers`): a BERT classifier built from a `BertConfig` of a
given `Shape` (random init, dropout 0), with stock eager / SDPA attention or primal layers, and its training and
inference steps.

A training step is: zero grads, forward, mean-pool, a 10-class linear head, cross-entropy (+ 0.05 x KSVD loss for
primal variants), backward; no optimiser step. Inference is one forward under ``torch.inference_mode`` in eval mode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import BertConfig, BertModel  # noqa: E402

import hf_primal  # noqa: E402

from . import harness  # noqa: E402

KSVD_ETA = 0.05
NUM_CLASSES = 10


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    intermediate: int
    layers: int
    batch: int
    lengths: tuple[int, ...]
    low_rank: int = 30
    rank_multi: int = 10
    vocab: int = 512


def bert_config(shape: Shape, variant: str, max_len: int) -> BertConfig:
    config = BertConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=max_len,
        hidden_dropout_prob=0.0,  # dropout off everywhere: SDPA on CPU keeps its fused kernel only without it
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager" if variant == "eager" else "sdpa"
    if variant.startswith("primal"):
        layers = "all" if variant == "primal-all" else [-1]
        config.primal_attention = {"layers": layers, "low_rank": shape.low_rank, "rank_multi": shape.rank_multi}
    return config


class Classifier(torch.nn.Module):
    """Encoder + mean pooling + linear head, the LRA classification setup."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.head = torch.nn.Linear(config.hidden_size, NUM_CLASSES)
        self.primal = bool(hf_primal.primal_layers(self.encoder))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids=ids).last_hidden_state.mean(dim=1))


def make_step(model: Classifier, ids: torch.Tensor, labels: torch.Tensor, mode: str, device: str = "cpu",
              dtype: str = "fp32") -> Callable[[], None]:
    """One training or inference step; it synchronises at its end, so that a wall clock read after it is right."""
    if mode == "infer":
        model.eval()

        def infer() -> None:
            with torch.inference_mode(), harness.autocast(device, dtype):
                model(ids)
            harness.synchronize(device)

        return infer
    model.train()

    def train() -> None:
        model.zero_grad(set_to_none=True)
        with harness.autocast(device, dtype):
            loss = F.cross_entropy(model(ids), labels)
            if model.primal:
                loss = loss + KSVD_ETA * hf_primal.ksvd_loss(model.encoder)
        loss.backward()
        harness.synchronize(device)

    return train


def build(shape: Shape, variant: str, n: int, seed: int = 0,
          device: str = "cpu") -> tuple[Classifier, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)  # drawn on the CPU, so every device gets the same weights and inputs
    model = Classifier(bert_config(shape, variant, max(shape.lengths))).to(device)
    ids = torch.randint(1, shape.vocab, (shape.batch, n)).to(device)
    labels = torch.randint(0, NUM_CLASSES, (shape.batch,)).to(device)
    return model, ids, labels


def eager_estimate_gib(shape: Shape, n: int) -> float:
    return (3 * shape.layers + 2) * shape.batch * shape.heads * n * n * 4 / 2**30



def sublayer_module(shape: Shape, variant: str, n: int) -> torch.nn.Module:
    one_layer = replace(shape, layers=1, lengths=(n,))
    torch.manual_seed(0)
    return BertModel(bert_config(one_layer, variant, n), add_pooling_layer=False).encoder.layer[0].train()
