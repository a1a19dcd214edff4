"""Draft-distribution features against direct float64 computations."""

import numpy as np
import pytest
import torch

from specverify.features import FEATURE_NAMES, all_features, entropy, logit_qmax, margin_top2


def _logsumexp(a: np.ndarray) -> float:
    m = a.max()
    return float(m + np.log(np.exp(a - m).sum()))


def _ref_logit_qmax(row: np.ndarray, t: float = 1.0) -> float:
    z = row.astype(np.float64) / (t if t > 0 else 1.0)
    i = int(np.argmax(z))
    return float(z[i] - _logsumexp(np.delete(z, i)))


def _ref_truncated(row: np.ndarray, t: float, top_p: float, top_k: int, clamp: float) -> float:
    """Sort, cut to top-k, renormalise, keep the prefix whose preceding mass is < top_p, log-odds of the first."""
    z = row.astype(np.float64) / t
    p = np.exp(z - z.max())
    p = np.sort(p / p.sum())[::-1]
    if top_k > 0:
        p = p[:top_k] / p[:top_k].sum()
    before = np.cumsum(p) - p
    kept = p[before < top_p]
    if kept.size == 1:
        return clamp
    return float(np.clip(np.log(kept[0]) - np.log(kept[1:].sum()), -clamp, clamp))


def test_logit_qmax_matches_float64_reference_batched_numpy_and_torch():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(2, 3, 500))
    logits[0, 0, 7] += 12  # a confident row
    for t in (1.0, 0.7, 0.0):  # 0 = greedy drafting: temperature 1
        ref = np.array([[_ref_logit_qmax(r, t) for r in block] for block in logits])
        got = logit_qmax(logits, temperature=t)
        assert isinstance(got, np.ndarray) and got.shape == (2, 3) and got.dtype == np.float64
        np.testing.assert_allclose(got, ref, atol=1e-9)
        got32 = logit_qmax(torch.tensor(logits, dtype=torch.float32), temperature=t)
        assert isinstance(got32, torch.Tensor) and got32.dtype == torch.float32 and got32.shape == (2, 3)
        np.testing.assert_allclose(got32.numpy(), ref, atol=2e-4)


def test_per_row_temperature():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, size=(3, 50))
    temps = [0.5, 1.0, 0.0]
    ref = [_ref_logit_qmax(r, t) for r, t in zip(logits, temps, strict=True)]
    np.testing.assert_allclose(logit_qmax(logits, temperature=temps), ref, atol=1e-9)
    with pytest.raises(ValueError):
        logit_qmax(logits, temperature=[1.0, 2.0])


def test_near_one_where_naive_log_one_minus_q_fails():
    # q_max = 1 - 1.5e-8: float32 rounds the probability to 1, so log(q / (1 - q)) is inf; the stable
    # form still gives the exact log-odds.
    logits = torch.zeros(1, 10)
    logits[0, 3] = 20.0
    expected = 20.0 - np.log(9.0)
    q = torch.softmax(logits, dim=-1).max()
    naive = torch.log(q / (1 - q))
    assert not torch.isfinite(naive) or abs(float(naive) - expected) > 0.5
    got = logit_qmax(logits)
    assert abs(float(got[0]) - expected) < 1e-4
    # tiny but non-zero others in float32
    logits = torch.tensor([[0.0, -17.5, -18.0, -30.0]])
    expected = _ref_logit_qmax(logits[0].double().numpy())
    assert abs(float(logit_qmax(logits)[0]) - expected) < 1e-4


def test_clamp_and_ties_and_masked_vocabulary():
    assert float(logit_qmax(torch.tensor([[1e4, 0.0, 0.0]]))[0]) == 20.0
    assert float(logit_qmax(torch.tensor([[1e4, 0.0, 0.0]]), clamp=5.0)[0]) == 5.0
    # two tied maxima: log-odds of one of them against the rest (which includes the other)
    row = np.array([5.0, 5.0, 0.0])
    assert abs(float(logit_qmax(row[None])[0]) - _ref_logit_qmax(row)) < 1e-9
    assert float(margin_top2(row[None])[0]) == 0.0
    # -inf logits (banned tokens) carry no mass and do not make the entropy NaN
    row = np.array([2.0, 1.0, -np.inf, -np.inf])
    p = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    assert abs(float(entropy(row[None])[0]) - float(-(p * np.log(p)).sum())) < 1e-9
    assert abs(float(logit_qmax(row[None])[0]) - 1.0) < 1e-9
    with pytest.raises(ValueError):
        logit_qmax(row[None], clamp=0.0)


def test_truncated_variant_matches_sorted_reference():
    rng = np.random.default_rng(2)
    v = 4096
    rows = [
        rng.normal(0, 3, v),  # peaked enough for the top-64 head
        rng.normal(0, 0.05, v),  # nearly flat: top-p needs ~1200 tokens (second tier)
        rng.normal(0, 0.01, v),  # flat: top-p 0.95 needs ~3900 tokens (estimated, < 2.5e-4 off)
        np.r_[30.0, np.zeros(v - 1)],  # one-hot after truncation: the clamp
    ]
    logits = np.stack(rows)
    for top_p, top_k, t in [
        (0.95, 0, 1.0),
        (0.3, 0, 1.0),
        (0.9, 100, 0.8),
        (1.0, 20, 1.0),
        (0.95, 3000, 1.0),
    ]:
        ref = [_ref_truncated(r, t, top_p, top_k, 10.0) for r in logits]
        got = logit_qmax(logits, t, truncated=True, top_p=top_p, top_k=top_k)
        exact = [0, 1, 3] if top_p < 0.5 or top_k else [0, 3]  # a cut beyond the top 2048 is estimated
        np.testing.assert_allclose(got[exact], np.array(ref)[exact], atol=1e-6, err_msg=f"{top_p} {top_k}")
        np.testing.assert_allclose(got, ref, atol=2.5e-4)
        got32 = logit_qmax(
            torch.tensor(logits, dtype=torch.float32), t, truncated=True, top_p=top_p, top_k=top_k
        )
        np.testing.assert_allclose(got32.numpy(), ref, atol=2e-3)
    # no truncation at all: equal to the untruncated feature (within its clamp)
    np.testing.assert_allclose(
        logit_qmax(logits[:3], truncated=True), np.clip(logit_qmax(logits[:3]), -10, 10), atol=1e-12
    )
    # per-row top_p / top_k
    got = logit_qmax(logits, truncated=True, top_p=[0.95, 0.3, 1.0, 0.5], top_k=[0, 0, 20, -1])
    ref = [
        _ref_truncated(logits[0], 1.0, 0.95, 0, 10.0),
        _ref_truncated(logits[1], 1.0, 0.3, 0, 10.0),
        _ref_truncated(logits[2], 1.0, 1.0, 20, 10.0),
        10.0,
    ]
    np.testing.assert_allclose(got, ref, atol=1e-6)


def test_all_features_agree_with_direct_computation():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2.5, size=(4, 2, 300))
    logits[1, 0, 5] += 15
    feats = all_features(logits, temperature=0.9, top_p=0.95, top_k=0)
    assert set(feats) == set(FEATURE_NAMES)
    z = logits / 0.9
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ps = np.sort(p, -1)
    np.testing.assert_allclose(feats["qmax"], p.max(-1), atol=1e-12)
    np.testing.assert_allclose(feats["entropy"], -(p * np.log(p)).sum(-1), atol=1e-9)
    np.testing.assert_allclose(feats["margin_top2"], np.log(ps[..., -1] / ps[..., -2]), atol=1e-9)
    np.testing.assert_allclose(feats["logit_qmax"], logit_qmax(logits, 0.9), atol=1e-12)
    trunc = logit_qmax(logits, 0.9, truncated=True, top_p=0.95)
    np.testing.assert_allclose(feats["logit_qmax_trunc"], trunc, atol=1e-12)
    t = all_features(torch.tensor(logits, dtype=torch.bfloat16), 0.9, 0.95, 0)
    assert all(
        isinstance(v, torch.Tensor) and v.shape == (4, 2) and v.dtype == torch.float32 for v in t.values()
    )


def test_scratch_reuses_the_buffer_and_gives_the_same_answer():
    logits = torch.randn(3, 1000) * 4
    kept = logits.clone()
    expected = logit_qmax(logits)
    assert torch.equal(logits, kept)  # without scratch the input is left alone
    buf = logits.clone()
    got = logit_qmax(buf, scratch=True)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.equal(buf, logits)  # it was used as working memory


def test_keeps_one_token_matches_the_sampling_distribution_and_the_top_p_rule():
    from specverify import sampler
    from specverify.features import SINGLE_TOKEN_BONUS, acceptance_feature, keeps_one_token
    from specverify.sampling_params import SamplingParams

    rng = np.random.default_rng(11)
    logits = torch.tensor(rng.normal(0, 3.0, size=(40, 50)), dtype=torch.float32)
    logits[::3, 7] += 12  # peaked rows: top-p keeps their top token alone
    for top_p, top_k, t in [(0.95, 0, 1.0), (0.8, 0, 0.7), (1.0, 1, 1.0), (0.9, 5, 1.0), (0.95, 0, 0.0)]:
        params = [SamplingParams(temperature=t, top_p=top_p, top_k=top_k)] * logits.shape[0]
        sparse = sampler.probabilities(logits, params)
        q = sparse.to_dense()
        one = keeps_one_token(sparse).numpy()
        assert np.array_equal(one, keeps_one_token(q).numpy())
        assert np.array_equal(one, (q > 0).sum(dim=1).numpy() == 1)
        if t == 0.0 or top_k == 1:
            assert one.all()  # greedy drafts and top-k 1 are one-hot
        elif top_k == 0:
            # Without top-k: the runner-up survives top-p iff q_max < top_p (float64 from the logits).
            z = logits.double().numpy() / t
            p = np.exp(z - z.max(1, keepdims=True))
            qmax = 1.0 / p.sum(1)
            assert np.array_equal(one, qmax >= top_p)
            assert one.any() and not one.all()
    x = np.array([[1.5, -0.5], [3.0, np.nan]])
    got = acceptance_feature(x, np.array([[True, False], [True, False]]))
    np.testing.assert_array_equal(got[0], [1.5 + SINGLE_TOKEN_BONUS, -0.5])
    assert got[1, 0] == 3.0 + SINGLE_TOKEN_BONUS and np.isnan(got[1, 1])
    np.testing.assert_array_equal(acceptance_feature(x[0], [1, 1], bonus=0.0), x[0])
