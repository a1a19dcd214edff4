"""The sampler's sparse rows (probe first, widen only where needed) against a float64 dense reference."""

import numpy as np
import pytest
import torch
from exact import reference_probs

from specverify import sampler
from specverify.sampling_params import SamplingParams
from specverify.sparse import SparseRows, residual


@pytest.mark.parametrize("vocab", [300, 20000])
def test_probabilities_match_a_dense_reference(vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    # Flat rows (scale 0.1) keep most of the vocabulary under top-p, so the probe must widen to the end.
    scales = torch.tensor([0.1, 1.0, 3.0, 5.0, 8.0, 0.5, 0.05, 2.0, 1.0, 0.3])
    logits = torch.randn(len(scales), vocab, generator=gen) * scales[:, None]
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.95),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.99),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=1.0),  # the whole vocabulary
        SamplingParams(temperature=1.3, top_p=0.999),
        SamplingParams(temperature=1.0, top_k=200, top_p=0.9),  # top-k wider than the probe
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.0, top_k=150, top_p=1.0),
    ]
    rows = sampler.probabilities(logits, params)
    dense = rows.to_dense().numpy()
    for row, p in enumerate(params):
        np.testing.assert_allclose(dense[row], reference_probs(logits[row], p), atol=1e-6)
    assert (rows.probs >= 0).all()
    counts = rows.counts()
    assert counts[4] == 1 and counts[5] == vocab and counts[0] > 64  # greedy, whole, widened


def test_sample_never_draws_a_zero_probability_token() -> None:
    rows = SparseRows.from_dense(torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]]))
    for u in (0.0, 0.25, 0.4999, 0.5, 0.9999999):
        tokens = sampler.sample(rows, torch.tensor([u, u]))
        assert tokens[0].item() in (1, 3) and tokens[1].item() == 2


def test_sample_follows_each_row_inverse_cdf() -> None:
    probs = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.0, 0.4]])
    rows = SparseRows.from_dense(probs)
    got = sampler.sample(rows.select(torch.tensor([0, 1, 0, 1])), torch.tensor([0.1, 0.59, 0.45, 0.61]))
    assert got.tolist() == [0, 0, 1, 2]


def test_rows_lookup_select_cat_and_residual() -> None:
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 7, generator=gen) * 2, -1)
    p[1, 2:] = 0.0
    p = p / p.sum(1, keepdim=True)
    q = torch.softmax(torch.randn(4, 7, generator=gen) * 2, -1)
    sp, sq = SparseRows.from_dense(p), SparseRows.from_dense(q)
    tokens = torch.tensor([0, 3, 6, 2])
    assert torch.allclose(sp.prob(torch.arange(4), tokens), p[torch.arange(4), tokens])
    order = torch.tensor([2, 0, 2])
    assert torch.allclose(sp.select(order).to_dense(), p[order].double(), atol=1e-7)
    both = SparseRows.cat([sp, sq], 7)
    assert torch.allclose(both.to_dense(), torch.cat([p, q]).double(), atol=1e-7)
    want = (p - q).clamp(min=0).double()
    assert torch.allclose(residual(sp, sq).to_dense(), want / want.sum(1, keepdim=True), atol=1e-6)
    # Where p and q agree there is no residual mass: p itself is returned.
    assert torch.allclose(residual(sp, sp).to_dense(), p.double(), atol=1e-6)
    sub = torch.tensor([1, 4, 5])
    mapped = SparseRows.from_dense(p[:, :3] / p[:, :3].sum(1, keepdim=True)).map_tokens(sub, 7)
    assert mapped.to_dense()[:, [0, 2, 3, 6]].abs().sum() == 0
