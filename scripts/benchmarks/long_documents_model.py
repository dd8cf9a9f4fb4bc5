"""The network of the long-document task (`long_documents_task`): a byte-level BERT encoder of the paper's LRA shape
whose attention blocks are softmax (sdpa / eager), primal, a packaged peer (Performer, Nystromformer, Linformer) or
the identity, with a mean pool over the valid bytes and a linear head.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch
import torch.nn.functional as F

from . import bbc_news

# The same network with every attention block the identity: the floor a mixing layer must beat (trained), and what
# the rest of the model costs, so the most any attention variant can save against sdpa (timing phase).
NO_ATTENTION = "no-attention"
PEERS = ("performer", "nystrom", "linformer")
PRIMAL = {"primal": {"layers": "all", "low_rank": 20, "eta": 0.05},
          "primal-last": {"layers": [-1], "low_rank": 30, "eta": 0.1}}
PAD, VOCAB = 0, 257  # byte b is token b + 1


class IdentityAttention(torch.nn.Module):
    """In place of BertAttention: the hidden states pass through unchanged (no token sees another)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden_states, None


class PeerAttention(torch.nn.Module):
    """A packaged attention layer in place of BertAttention: LayerNorm(x + dropout(attention(x)))."""

    def __init__(self, kind: str, config, n: int, args: argparse.Namespace) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        d = hidden // heads
        if kind == "performer":
            from performer_pytorch import SelfAttention

            self.attention = SelfAttention(dim=hidden, heads=heads, dim_head=d)
        elif kind == "nystrom":
            from nystrom_attention import NystromAttention

            self.attention = NystromAttention(dim=hidden, dim_head=d, heads=heads, num_landmarks=args.landmarks)
        elif kind == "linformer":
            from linformer import LinformerSelfAttention

            self.attention = LinformerSelfAttention(dim=hidden, seq_len=n, k=args.linformer_k, heads=heads, dim_head=d)
        else:
            raise ValueError(f"unknown peer {kind!r}; use one of {PEERS}")
        self.kind = kind
        self.dropout = torch.nn.Dropout(config.hidden_dropout_prob)
        self.norm = torch.nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.padding: Optional[torch.Tensor] = None  # (batch, N) bool, set by DocumentClassifier before each call

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if self.kind == "linformer":
            out = self.attention(hidden_states)
        else:
            out = self.attention(hidden_states, mask=self.padding)
        return self.norm(hidden_states + self.dropout(out)), None


def encoder_config(variant: str, n: int, args: argparse.Namespace):
    from transformers import BertConfig

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=n, pad_token_id=PAD,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1 if variant == "sdpa-dropout" else 0.0)
    config._attn_implementation = "eager" if variant == "eager" else "sdpa"
    if variant in PRIMAL:
        config.primal_attention = {**PRIMAL[variant], "rank_multi": args.rank_multi,
                                   "ksvd_reduction": args.ksvd_reduction}
        if getattr(args, "sampling", None):
            config.primal_attention["sampling"] = args.sampling
    return config


class DocumentClassifier(torch.nn.Module):
    """Encoder + mean pool over the valid bytes + linear head."""

    def __init__(self, variant: str, n: int, args: argparse.Namespace) -> None:
        super().__init__()
        from transformers import BertModel

        import hf_primal

        config = encoder_config(variant, n, args)
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.peers = []
        if variant in PEERS:
            for layer in self.encoder.encoder.layer:
                layer.attention = PeerAttention(variant, config, n, args)
                self.peers.append(layer.attention)
        elif variant == NO_ATTENTION:
            for layer in self.encoder.encoder.layer:
                layer.attention = IdentityAttention()
        # Identity blocks and the peers (which take `mask` directly) read no attention mask: given none, the encoder
        # builds none, so the floor and the peers do not pay for softmax's (batch, 1, N, N) mask.
        self.encoder_reads_mask = variant not in PEERS and variant != NO_ATTENTION
        self.head = torch.nn.Linear(config.hidden_size, len(bbc_news.TOPICS))
        self.eta = PRIMAL[variant]["eta"] if variant in PRIMAL else 0.0
        if variant in PRIMAL and not hf_primal.primal_layers(self.encoder):
            raise RuntimeError(f"{variant}: the encoder has no primal layer")

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for peer in self.peers:
            peer.padding = mask
        hidden = self.encoder(input_ids=ids, attention_mask=mask if self.encoder_reads_mask else None).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp(min=1))

    def loss(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import hf_primal

        loss = F.cross_entropy(self(ids, mask).float(), labels)
        if self.eta:
            loss = loss + self.eta * hf_primal.ksvd_loss(self.encoder)
        return loss


def settings_text(variant: str, args: argparse.Namespace) -> str:
    if variant in PRIMAL:
        from hf_primal import PrimalAttentionConfig

        cfg = PRIMAL[variant]
        rule = getattr(args, "sampling", None) or PrimalAttentionConfig().sampling
        return (f"layers={cfg['layers']}, s={cfg['low_rank']}, m={args.rank_multi}, eta={cfg['eta']}, "
                f"ksvd_reduction={args.ksvd_reduction}, sampling={rule}")
    if variant == "performer":
        return "nb_features=int(d ln d)=110 (default), softmax kernel"
    if variant == "nystrom":
        return f"num_landmarks={args.landmarks}, pinv_iterations=6, residual conv 33 (defaults)"
    if variant == "linformer":
        return f"k={args.linformer_k} (default), sees padding"
    if variant == NO_ATTENTION:
        return "every attention block the identity: the cost of the rest of the network"
    return "attention-probability dropout " + ("0.1" if variant == "sdpa-dropout" else "0")
