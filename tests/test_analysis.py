"""hf_primal.tools.analysis: known spectra, primal kernels against a dense SVD, the per-layer API and the plot."""

import pytest
import torch
import torch.nn.functional as F
from transformers import BertModel, GPT2Model

from hf_primal.tools.analysis import (
    attention_spectrum,
    cumulative_from_singular_values,
    cumulative_spectrum,
    plot_attention_spectrum,
)
from tests.conftest import bert_config, gpt2_config
from tests.reference import _slot_rows, reference_gammas


def test_rank_one_matrix_explains_everything_with_its_first_singular_value():
    u, v = torch.randn(7, 1, dtype=torch.float64), torch.randn(1, 7, dtype=torch.float64)
    curve = cumulative_spectrum(u @ v)
    assert curve.shape == (7,)
    assert curve[0] == pytest.approx(1.0, abs=1e-12)
    assert torch.allclose(curve, torch.ones(7, dtype=torch.float64))


def test_identity_gives_a_linear_curve_and_sigma_squared_option():
    n = 6
    assert torch.allclose(cumulative_spectrum(torch.eye(n)), torch.arange(1, n + 1, dtype=torch.float64) / n)
    diag = torch.diag(torch.tensor([3.0, 1.0]))
    assert cumulative_spectrum(diag)[0].item() == pytest.approx(0.75)
    assert cumulative_spectrum(diag, use_sigma_squared=True)[0].item() == pytest.approx(0.9)
    # beyond the matrix size the curve is padded with 1 (no singular values left to explain)
    padded = cumulative_from_singular_values(torch.tensor([2.0, 2.0]), length=4)
    assert padded.tolist() == [0.5, 1.0, 1.0, 1.0]


def _bert(**kw):
    config = bert_config(num_hidden_layers=3, primal_attention={"layers": [-1], "low_rank": 4, "rank_multi": 2}, **kw)
    return BertModel(config)


def _batch():
    ids = torch.randint(1, 120, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_one_curve_per_layer_and_model_state_restored():
    model = _bert().train()
    assert model.config._attn_implementation == "sdpa"
    spectra = attention_spectrum(model, _batch())
    assert [s.layer for s in spectra] == [0, 1, 2]
    assert [s.kind for s in spectra] == ["softmax", "softmax", "primal"]
    for s in spectra:
        assert s.curves.shape == (2 * 4, 12)  # (sequences x heads, padded length)
        assert s.mean.shape == (12,) and s.std.shape == (12,)
        assert torch.all(s.curves[:, 1:] >= s.curves[:, :-1] - 1e-12)  # cumulative: non-decreasing
        assert torch.allclose(s.curves[:, -1], torch.ones(8, dtype=torch.float64))
        # sequence 1 has 8 valid tokens: its 8 x 8 matrices have no singular value beyond index 7
        assert torch.allclose(s.curves[4:, 7:], torch.ones(4, 5, dtype=torch.float64))
    assert model.config._attn_implementation == "sdpa" and model.training


def test_uniform_softmax_attention_is_rank_one():
    model = _bert()
    with torch.no_grad():  # zero queries and keys: every softmax row is uniform over the valid keys
        for name in ("query", "key"):
            getattr(model.encoder.layer[0].attention.self, name).weight.zero_()
            getattr(model.encoder.layer[0].attention.self, name).bias.zero_()
    spectra = attention_spectrum(model, _batch())
    assert torch.allclose(spectra[0].curves[:, 0], torch.ones(8, dtype=torch.float64), atol=1e-9)
    assert spectra[1].curves[:, 0].min() < 1 - 1e-6  # an ordinary layer is not exactly rank one


def _capture_input(module):
    store = {}
    handle = module.register_forward_hook(lambda mod, args, kwargs, out: store.update(x=args[0]), with_kwargs=True)
    return store, handle


@pytest.mark.parametrize("kernel", ["sampled", "identity"])
def test_primal_layer_matches_dense_svd_of_the_implied_kernel(kernel):
    model = _bert().eval()
    batch = _batch()
    attn = model.encoder.layer[2].attention.self
    store, handle = _capture_input(attn)
    with torch.no_grad():
        model(**batch)
    handle.remove()
    spectra = attention_spectrum(model, batch, primal_kernel=kernel)
    x = store["x"].double()
    heads, dim = 4, 8
    q = (x @ attn.query.weight.double().T + attn.query.bias.double()).view(2, 12, heads, dim)
    k = (x @ attn.key.weight.double().T + attn.key.bias.double()).view(2, 12, heads, dim)
    valid = batch["attention_mask"].bool()
    expected = []
    for b in range(2):
        length = int(valid[b].sum())
        # The slot rows by the loop-by-loop reference rule (tests/reference.py) of the layer, among the valid positions.
        positions = valid[b].nonzero().flatten().tolist()
        sampled = _slot_rows(x[b], positions, attn.primal.num_samples, attn.primal.sampling).view(-1, heads, dim)
        for h in range(heads):
            q_hat = F.normalize(q[b, :length, h], dim=-1)
            k_hat = F.normalize(k[b, :length, h], dim=-1)
            f = sampled[:, h] if kernel == "sampled" else torch.eye(dim, dtype=torch.float64)
            expected.append(cumulative_spectrum(q_hat @ f.T @ f @ k_hat.T, length=12))
    assert (spectra[2].curves - torch.stack(expected)).abs().max() < 1e-6
    # rank <= d
    assert torch.allclose(spectra[2].curves[:, dim - 1 :], torch.ones(8, 12 - dim + 1, dtype=torch.float64))


@pytest.mark.parametrize("mixing", ["prefix_mean", "decay"])
def test_causal_primal_layer_uses_normalised_prefix_means(mixing):
    model = GPT2Model(gpt2_config(primal_attention={"layers": [-1], "low_rank": 4, "causal_mixing": mixing})).eval()
    ids = torch.randint(1, 120, (1, 10))
    attn = model.h[1].attn
    store, handle = _capture_input(attn)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    spectra = attention_spectrum(model, {"input_ids": ids})
    assert [s.kind for s in spectra] == ["softmax", "primal-causal"]
    qk = store["x"].double() @ attn.c_attn.weight.double() + attn.c_attn.bias.double()
    q, k = qk[0, :, :32].view(10, 4, 8), qk[0, :, 32:64].view(10, 4, 8)
    # Token j's weight in position i's mean: 1 (prefix mean), or gamma_h^(i - j) with docs/method.md's gamma_h.
    gammas = torch.tensor(reference_gammas(4), dtype=torch.float64)
    age = (torch.arange(10)[:, None] - torch.arange(10)[None, :]).clamp(min=0).double()
    causal = torch.tril(torch.ones(10, 10, dtype=torch.float64))
    weights = causal[None].expand(4, 10, 10) if mixing == "prefix_mean" else causal * gammas[:, None, None] ** age
    q_hat = F.normalize(torch.einsum("hij,jhd->ihd", weights, q), dim=-1)
    k_hat = F.normalize(torch.einsum("hij,jhd->ihd", weights, k), dim=-1)
    expected = torch.stack([cumulative_spectrum(q_hat[:, h] @ k_hat[:, h].T) for h in range(4)])
    assert (spectra[1].curves - expected).abs().max() < 1e-6


def test_plot_writes_a_png(tmp_path):
    model = _bert()
    spectra = attention_spectrum(model, _batch())
    path = plot_attention_spectrum({"primal+": spectra, "same again": spectra}, tmp_path / "spectrum.png", title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
