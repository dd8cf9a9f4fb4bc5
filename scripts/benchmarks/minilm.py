"""What the MiniLM benchmarks share (`conversion`, `conversion_tasks`): the tokenizer of the bundled
all-MiniLM-L6-v2 and mean-pooled sentence embeddings."""

from __future__ import annotations

import torch

from hf_primal.tools.data import minilm_path
from hf_primal.training.teacher_loss import masked_mean_pool

# all-MiniLM-L6-v2's transformer layers: K = LAYERS is "every layer", and "last" counts down from LAYERS - 1.
LAYERS = 6


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path())


@torch.no_grad()
def embeddings(model, tokenizer, texts, max_length, batch_size=64) -> torch.Tensor:
    """Mean-pooled final hidden states, in the order of `texts`."""
    model.eval()
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt")
        out.append(masked_mean_pool(model(**batch).last_hidden_state, batch["attention_mask"]))
    return torch.cat(out)
