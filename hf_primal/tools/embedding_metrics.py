"""How well frozen sentence embeddings keep what they served: k-NN label accuracy and neighbour overlap.

The mean cosine between an original and a converted model's embeddings says how far the vectors moved, not whether
retrieval still works. These two measures say that directly, for embeddings of held-out texts:

* `knn_accuracy`: each query takes the majority label of its k nearest index embeddings (cosine similarity);
* `neighbour_overlap`: the fraction of each query's k nearest index items that two models share.

`pooled_embeddings` and `heldout_neighbour_overlap` measure models on tokenised batches (the conversion report's
figure); the measures themselves are plain torch on embedding matrices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..training.teacher_loss import last_hidden, masked_mean_pool, model_inputs, needs_hidden_flag

Labels = Union[Sequence[int], torch.Tensor]


def _check(name: str, index: torch.Tensor, queries: torch.Tensor, k: int) -> None:
    if index.dim() != 2 or queries.dim() != 2 or index.shape[1] != queries.shape[1]:
        raise ValueError(
            f"{name}: index and queries must be (n, d) matrices of the same width; got {tuple(index.shape)} and "
            f"{tuple(queries.shape)}."
        )
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= index.shape[0]:
        raise ValueError(f"{name}: k={k!r} is not allowed: it must be an integer in 1 .. {index.shape[0]} (the index "
                         "size).")
    for label, tensor in (("index", index), ("queries", queries)):
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name}: the {label} embeddings contain NaN or inf values.")


def nearest_neighbours(index: torch.Tensor, queries: torch.Tensor, k: int = 10) -> torch.Tensor:
    """(n_queries, k) positions in `index` of each query's k most cosine-similar rows, most similar first.

    Ties are broken towards the lower index position, so the result does not depend on the hardware's sort.
    """
    _check("nearest_neighbours", index, queries, k)
    sims = F.normalize(queries.double(), dim=-1) @ F.normalize(index.double(), dim=-1).T
    # A stable descending sort orders equal similarities by position.
    return torch.sort(sims, dim=-1, descending=True, stable=True).indices[:, :k]


def knn_accuracy(index: torch.Tensor, index_labels: Labels, queries: torch.Tensor, query_labels: Labels,
                 k: int = 10) -> float:
    """Fraction of `queries` whose k nearest `index` rows (cosine) vote for the query's label.

    The vote is a plain majority; a tie goes to the label of the nearest neighbour among the tied labels.

    Example::

        >>> import torch
        >>> index = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
        >>> knn_accuracy(index, [0, 0, 1], torch.tensor([[1.0, 0.05], [0.1, 1.0]]), [0, 1], k=1)
        1.0
    """
    index_labels = torch.as_tensor(index_labels).long()
    query_labels = torch.as_tensor(query_labels).long()
    if index_labels.shape != (index.shape[0],) or query_labels.shape != (queries.shape[0],):
        raise ValueError(
            f"knn_accuracy: {index.shape[0]} index rows need as many labels (got {tuple(index_labels.shape)}), and "
            f"{queries.shape[0]} queries as many (got {tuple(query_labels.shape)})."
        )
    neighbours = nearest_neighbours(index, queries, k)
    votes = index_labels[neighbours]  # (q, k), nearest first
    num_labels = int(max(index_labels.max(), query_labels.max())) + 1
    counts = F.one_hot(votes, num_labels).sum(1)  # (q, L)
    top = counts.max(-1, keepdim=True).values
    tied = counts == top  # labels with the most votes
    # Among the tied labels, the one whose first vote comes earliest (nearest neighbour) wins.
    first_rank = torch.where(F.one_hot(votes, num_labels).bool(), torch.arange(k)[None, :, None],
                             torch.full((1, 1, 1), k)).min(1).values  # (q, L)
    predicted = torch.where(tied, first_rank, torch.full_like(first_rank, k + 1)).argmin(-1)
    return float((predicted == query_labels).double().mean())


def neighbour_overlap(index_a: torch.Tensor, queries_a: torch.Tensor, index_b: torch.Tensor,
                      queries_b: torch.Tensor, k: int = 10) -> float:
    """Mean fraction of each query's k nearest index items shared by model a and model b.

    The same texts are embedded by both models (row i of `index_a` and `index_b` is the same text); 1.0 means the
    converted model retrieves exactly what the original did.
    """
    if index_a.shape[0] != index_b.shape[0] or queries_a.shape[0] != queries_b.shape[0]:
        raise ValueError(
            f"neighbour_overlap: both models must embed the same texts; got index {index_a.shape[0]} vs "
            f"{index_b.shape[0]} rows and queries {queries_a.shape[0]} vs {queries_b.shape[0]}."
        )
    a = nearest_neighbours(index_a, queries_a, k)
    b = nearest_neighbours(index_b, queries_b, k)
    shared = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
    return float(shared.double().mean() / k)


@torch.no_grad()
def pooled_embeddings(model: nn.Module, batches: Sequence[Mapping[str, torch.Tensor]], causal: bool = False
                      ) -> torch.Tensor:
    """Mean-pooled final hidden states of every row of `batches`, (rows, C), in eval mode."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    extra = {"use_cache": False} if causal else {}
    if needs_hidden_flag(model):
        extra["output_hidden_states"] = True
    out = []
    for batch in batches:
        inputs = model_inputs(batch, device)
        out.append(masked_mean_pool(last_hidden(model(**inputs, **extra)).float(), inputs.get("attention_mask")))
    model.train(was)
    return torch.cat(out)


def heldout_neighbour_overlap(student: nn.Module, teacher: nn.Module, batches: Sequence[Mapping[str, torch.Tensor]],
                              causal: bool = False, k: int = 10) -> Optional[dict]:
    """How much of what the teacher's embeddings retrieve the student's still retrieve, on held-out batches.

    The held-out rows are split in two: the first half is the index, the second the queries; the result is the mean
    fraction of each query's k nearest index rows (cosine of mean-pooled states) that both models share. None when
    there are fewer than 4 held-out rows.
    """
    s, t = pooled_embeddings(student, batches, causal), pooled_embeddings(teacher, batches, causal)
    half = s.shape[0] // 2
    if half < 2:
        return None
    k = min(k, half)
    return {"k": k, "index": half, "queries": s.shape[0] - half,
            "overlap": neighbour_overlap(t[:half], t[half:], s[:half], s[half:], k=k)}
