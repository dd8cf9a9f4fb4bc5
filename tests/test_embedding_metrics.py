"""k-NN label accuracy and neighbour overlap of frozen embeddings, against brute-force loops."""

import math

import pytest
import torch

from hf_primal.tools.embedding_metrics import knn_accuracy, nearest_neighbours, neighbour_overlap


def _cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def _brute_neighbours(index, query, k):
    """Sort every index row by cosine (descending), ties by position: plain Python on lists."""
    sims = [(-_cosine(row, query), i) for i, row in enumerate(index)]
    return [i for _, i in sorted(sims)[:k]]


def _brute_knn(index, labels, queries, query_labels, k):
    correct = 0
    for query, truth in zip(queries, query_labels):
        votes = [labels[i] for i in _brute_neighbours(index, query, k)]
        counts = {label: votes.count(label) for label in votes}
        best = max(counts.values())
        # Tie: the label that appears first among the nearest neighbours.
        predicted = next(label for label in votes if counts[label] == best)
        correct += predicted == truth
    return correct / len(queries)


def _brute_overlap(index_a, queries_a, index_b, queries_b, k):
    shares = [len(set(_brute_neighbours(index_a, qa, k)) & set(_brute_neighbours(index_b, qb, k))) / k
              for qa, qb in zip(queries_a, queries_b)]
    return sum(shares) / len(shares)


def _data(seed, n_index=60, n_query=25, dim=6, labels=4):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(labels, dim, generator=g)
    index_labels = torch.randint(0, labels, (n_index,), generator=g)
    query_labels = torch.randint(0, labels, (n_query,), generator=g)
    index = centres[index_labels] + 0.9 * torch.randn(n_index, dim, generator=g)
    queries = centres[query_labels] + 0.9 * torch.randn(n_query, dim, generator=g)
    return index, index_labels, queries, query_labels


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 4, 10])
def test_knn_accuracy_equals_brute_force(seed, k):
    index, index_labels, queries, query_labels = _data(seed)
    expected = _brute_knn(index.tolist(), index_labels.tolist(), queries.tolist(), query_labels.tolist(), k)
    assert knn_accuracy(index, index_labels.tolist(), queries, query_labels, k=k) == pytest.approx(expected, abs=1e-12)
    assert 0.0 < expected < 1.0  # a case that can tell a right vote from a wrong one


def test_knn_ties_go_to_the_nearest_label():
    # Two neighbours, one vote each: the nearer one's label wins (and the farther one's would be wrong).
    index = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    query = torch.tensor([[1.0, 0.8]])  # nearest: row 0 (label 3), then row 1 (label 1)
    assert knn_accuracy(index, [3, 1, 0], query, [3], k=2) == 1.0
    assert knn_accuracy(index, [3, 1, 0], query, [1], k=2) == 0.0


@pytest.mark.parametrize("seed", [0, 3])
def test_neighbour_overlap_equals_brute_force(seed):
    index_a, _, queries_a, _ = _data(seed)
    g = torch.Generator().manual_seed(seed + 100)
    index_b = index_a + 0.5 * torch.randn(index_a.shape, generator=g)
    queries_b = queries_a + 0.5 * torch.randn(queries_a.shape, generator=g)
    expected = _brute_overlap(index_a.tolist(), queries_a.tolist(), index_b.tolist(), queries_b.tolist(), 10)
    assert neighbour_overlap(index_a, queries_a, index_b, queries_b, k=10) == pytest.approx(expected, abs=1e-12)
    assert 0.0 < expected < 1.0
    # The same model on both sides retrieves the same neighbours; scaling a vector does not change cosine ranks.
    assert neighbour_overlap(index_a, queries_a, 3.0 * index_a, queries_a, k=10) == 1.0


def test_nearest_neighbours_are_ordered_by_cosine():
    index, _, queries, _ = _data(5)
    got = nearest_neighbours(index, queries, k=7).tolist()
    assert got == [_brute_neighbours(index.tolist(), q, 7) for q in queries.tolist()]


def test_bad_inputs_are_named():
    index, labels, queries, query_labels = _data(0)
    with pytest.raises(ValueError, match=r"k=0 is not allowed.*1 \.\. 60"):
        knn_accuracy(index, labels, queries, query_labels, k=0)
    with pytest.raises(ValueError, match="k=61"):
        neighbour_overlap(index, queries, index, queries, k=61)
    with pytest.raises(ValueError, match="same width"):
        nearest_neighbours(index, queries[:, :3])
    with pytest.raises(ValueError, match="as many labels"):
        knn_accuracy(index, labels[:-1], queries, query_labels)
    with pytest.raises(ValueError, match="same texts"):
        neighbour_overlap(index, queries, index[:-1], queries)
    bad = queries.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        knn_accuracy(index, labels, bad, query_labels)
