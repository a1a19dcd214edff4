"""The sampler's top-p path (probe first, widen only where needed) against a plain full-sort reference."""

import pytest
import torch

from specverify import sampler
from specverify.sampling_params import SamplingParams


@pytest.mark.parametrize("vocab", [300, 20000])
def test_top_p_matches_a_full_sort(vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.1, 1.0, 3.0, 5.0, 8.0, 0.5])
    logits = torch.randn(6, vocab, generator=gen) * scales[:, None]
    params = [SamplingParams(temperature=1.0, top_p=tp) for tp in (0.9, 0.95, 0.5, 0.99, 0.7, 1.0)]
    probs = sampler.probabilities(logits, params)
    full = torch.softmax(logits, -1)
    for row, p in enumerate(params):
        values, order = torch.sort(full[row], descending=True)
        keep = order[(torch.cumsum(values, 0) - values) < p.top_p]
        expected = torch.zeros(vocab)
        expected[keep] = full[row][keep]
        assert torch.allclose(probs[row], expected / expected.sum(), atol=1e-6)


def test_sample_never_draws_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    for u in (0.0, 0.25, 0.4999, 0.5, 0.9999999):
        tokens = sampler.sample(probs, torch.tensor([u, u]))
        assert tokens[0].item() in (1, 3) and tokens[1].item() == 2
