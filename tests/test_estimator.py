"""The online K+1 acceptance estimator on synthetic streams drawn from its own model, censored as the engine does."""

import json

import numpy as np
import pytest
import torch

from specverify.calibration import ece
from specverify.estimator import AcceptanceEstimator, PerPositionEstimator


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _step(rng, r, slopes, intercepts, *, trim=True, x=None):
    """One engine step: features, then outcomes censored at the first rejection and the verify budget."""
    k = len(intercepts)
    if x is None:
        x = rng.normal(2.0, 3.0, size=(r, k))
    accept = rng.random((r, k)) < _sigmoid(slopes * x + intercepts)
    first_reject = np.where(~accept, np.arange(k), k).min(axis=1)
    verified = rng.integers(1, k + 1, size=r) if trim else np.full(r, k)
    return x, verified, np.minimum(first_reject, verified)


def _stream(est, rng, steps, r, slopes, intercepts_at, **kw):
    """Feed `steps` steps; return prequential (prediction, label) pairs of the labelled slots."""
    preds, labels = [], []
    for t in range(steps):
        b = intercepts_at(t)
        x, n, a = _step(rng, r, slopes, b, **kw)
        p = est.predict(x)
        slots = np.arange(len(b))[None, :]
        labelled = (slots < n[:, None]) & (slots <= a[:, None])
        preds.append(p[labelled])
        labels.append((slots < a[:, None])[labelled])
        est.observe(x, n, a)
    return np.concatenate(preds), np.concatenate(labels).astype(float)


TRUE_B = np.array([0.3, -0.4, -0.9, -0.2])


@pytest.mark.parametrize(
    "options, tol_w, tol_b",
    [
        ({"half_life": 1e9}, 0.05, 0.12),  # no forgetting: the full-data fit
        ({}, 0.08, 0.3),  # defaults (half-life 2000 labels)
        ({"scheme": "window", "window": 1000, "damping": 1000.0}, 0.1, 0.35),
    ],
)
def test_recovers_slope_and_intercepts_under_censoring(options, tol_w, tol_b):
    rng = np.random.default_rng(0)
    est = AcceptanceEstimator.from_config(4, options)
    _stream(est, rng, 500, 48, 0.8, lambda t: TRUE_B)
    w, b = est.coef_
    assert abs(w - 0.8) < tol_w
    np.testing.assert_allclose(b, TRUE_B, atol=tol_b)
    assert est.n_observed_ > 20000


def test_labelling_rejected_tail_as_zeros_would_be_caught():
    # Sanity of the test above: an estimator fed the uncensored "every slot after a rejection is 0" labels
    # lands far from the truth at deep positions, so a censoring bug cannot pass it.
    rng = np.random.default_rng(0)
    est = AcceptanceEstimator(4, half_life=1e9)
    for _ in range(250):
        x, n, a = _step(rng, 48, 0.8, TRUE_B, trim=False)
        slots = np.arange(4)[None, :]
        est.observe_labels(x.ravel(), np.broadcast_to(slots, x.shape).ravel(), (slots < a[:, None]).ravel())
    assert abs(est.coef_[1][3] - TRUE_B[3]) > 0.5


def test_per_position_variant_recovers_separate_slopes():
    rng = np.random.default_rng(1)
    slopes = np.array([0.4, 0.6, 0.8, 1.0])
    est = PerPositionEstimator(4, half_life=1e9)
    _stream(est, rng, 500, 48, slopes, lambda t: TRUE_B)
    w, b = est.coef_
    np.testing.assert_allclose(w, slopes, atol=0.1)
    np.testing.assert_allclose(b, TRUE_B, atol=0.3)


def test_follows_a_drift_in_the_intercepts():
    rng = np.random.default_rng(2)
    est = AcceptanceEstimator(4)
    shift = 1.2
    p, y = _stream(est, rng, 400, 48, 0.6, lambda t: TRUE_B + (shift if t >= 200 else 0.0))
    np.testing.assert_allclose(est.coef_[1], TRUE_B + shift, atol=0.35)
    assert abs(est.coef_[0] - 0.6) < 0.1
    tail = slice(int(0.85 * p.size), None)
    assert ece(p[tail], y[tail]) < 0.04
    # a frozen estimator (no forgetting) is still off after the change: the test can tell
    frozen = AcceptanceEstimator(4, half_life=1e9)
    _stream(frozen, np.random.default_rng(2), 400, 48, 0.6, lambda t: TRUE_B + (shift if t >= 200 else 0.0))
    assert np.abs(frozen.coef_[1] - (TRUE_B + shift)).max() > 0.4


@pytest.mark.parametrize("scheme", ["forget", "window"])
def test_degenerate_streams_stay_finite_and_sane(scheme):
    rng = np.random.default_rng(3)
    opts = {"scheme": scheme, "window": 200}
    x = rng.normal(2.0, 3.0, size=(32, 5))
    full, zero = np.full(32, 5), np.zeros(32, dtype=int)

    def check(est):
        w, b = est.coef_
        assert np.isfinite(w) and w >= 0 and np.all(np.isfinite(b))
        assert np.all(np.abs(b) <= est.max_intercept) and w <= est.max_slope
        assert np.all(np.isfinite(est.predict(x)))

    accepted = AcceptanceEstimator.from_config(5, opts)
    for _ in range(200):
        accepted.observe(x, full, full)
        check(accepted)
    assert accepted.predict(x).mean() > 0.9 and accepted.predict(x).min() > 0.75

    rejected = AcceptanceEstimator.from_config(5, opts)
    for _ in range(200):
        rejected.observe(x, full, zero)
        check(rejected)
    assert rejected.predict(x)[:, 0].max() < 0.1

    constant = AcceptanceEstimator.from_config(5, opts)
    xc = np.full((32, 5), 3.0)
    for _ in range(200):
        _, n, a = _step(rng, 32, 0.0, np.zeros(5), trim=False, x=xc)
        constant.observe(xc, n, a)
        check(constant)
    assert abs(constant.predict(xc)[:, 0].mean() - 0.5) < 0.1
    assert constant.coef_[0] < 2.0  # the unidentified slope stays near the prior

    inverse = AcceptanceEstimator.from_config(5, opts)  # acceptance falls with the feature
    for _ in range(200):
        x2, n, a = _step(rng, 32, -0.8, np.zeros(5), trim=False)
        inverse.observe(x2, n, a)
        check(inverse)
    assert 0.0 <= inverse.coef_[0] < 0.01

    nothing = AcceptanceEstimator.from_config(5, opts)
    assert nothing.observe(x, zero, zero) == 0  # nothing verified: no labels
    assert nothing.observe(np.full((4, 5), np.nan), np.full(4, 5), np.full(4, 2)) == 0
    assert nothing.observe(np.zeros((0, 5)), np.zeros(0, int), np.zeros(0, int)) == 0
    w, b = nothing.coef_
    assert w == 0.6 and np.all(b == -0.5) and nothing.n_observed_ == 0
    check(nothing)


def test_nothing_verified_carries_no_label():
    est = AcceptanceEstimator(3)
    assert est.observe(np.ones((2, 3)), np.zeros(2, int), np.zeros(2, int)) == 0
    # verified 3, accepted 1: slot 0 accepted, slot 1 rejected, slot 2 censored
    assert est.observe(np.ones((1, 3)), [3], [1]) == 2
    # verified 2, all accepted: slots 0 and 1 accepted, slot 2 not verified
    assert est.observe(np.ones((1, 3)), [2], [2]) == 2
    assert est.n_observed_ == 4


def test_predict_shapes_inputs_and_nan():
    est = AcceptanceEstimator(5)
    x = np.array([[1.0, 2.0, np.nan], [0.0, np.nan, np.nan]])
    p = est.predict(x)
    assert p.shape == (2, 3) and p.dtype == np.float64
    assert np.isnan(p[0, 2]) and np.isnan(p[1, 1])
    np.testing.assert_allclose(p[0, 0], _sigmoid(0.6 * 1.0 - 0.5))
    np.testing.assert_allclose(est.predict(torch.tensor(x, dtype=torch.float32)), p, atol=1e-7)
    np.testing.assert_allclose(est.predict_at([1.0, 0.0], [0, 4]), _sigmoid(np.array([0.1, -0.5])))
    assert np.all(np.isfinite(est.predict(np.array([[np.inf, -np.inf]]))))
    with pytest.raises(ValueError):
        est.predict(np.zeros((2, 6)))
    with pytest.raises(ValueError):
        est.observe(np.zeros((2, 3)), [3, 1], [2, 2])  # accepted > verified
    with pytest.raises(ValueError):
        est.observe(np.zeros((2, 3)), [4, 1], [0, 0])  # verified more slots than features


def test_state_round_trip_through_json():
    rng = np.random.default_rng(4)
    est = AcceptanceEstimator(4, half_life=3000.0)
    _stream(est, rng, 200, 8, 0.7, lambda t: TRUE_B)
    state = json.loads(json.dumps(est.state_dict()))
    clone = AcceptanceEstimator(4, half_life=3000.0)
    clone.load_state_dict(state)
    assert clone.coef_[0] == est.coef_[0] and np.array_equal(clone.coef_[1], est.coef_[1])
    assert clone.n_observed_ == est.n_observed_
    x, n, a = _step(rng, 8, 0.7, TRUE_B)
    est.observe(x, n, a)
    clone.observe(x, n, a)
    assert clone.coef_[0] == est.coef_[0] and np.array_equal(clone.coef_[1], est.coef_[1])
    # warm start into a deeper drafter: shared positions copied, the new one from the prior
    deeper = AcceptanceEstimator(6)
    deeper.load_state_dict(state)
    assert np.allclose(deeper.coef_[1][:4], state["intercepts"])
    assert np.allclose(deeper.coef_[1][4:], -0.5)
    with pytest.raises(ValueError):
        PerPositionEstimator(4).load_state_dict(state)
    with pytest.raises(ValueError):
        clone.load_state_dict({**state, "slopes": -1.0})
    per = PerPositionEstimator(4)
    _stream(per, rng, 50, 8, 0.7, lambda t: TRUE_B)
    per2 = PerPositionEstimator(4)
    per2.load_state_dict(json.loads(json.dumps(per.state_dict())))
    assert np.array_equal(per2.coef_[0], per.coef_[0])


def test_options_from_json_and_clear_errors():
    est = AcceptanceEstimator(
        5, **json.loads('{"half_life": 500, "ridge": 2, "prior_intercept": [0, 0, 0, 0, 0]}')
    )
    assert est.half_life == 500.0 and np.all(est.coef_[1] == 0.0)
    bad = [
        {"half_life": -1},
        {"half_life": "fast"},
        {"ridge": 0},
        {"window": 0},
        {"window": 2.5},
        {"scheme": "sgd"},
        {"prior_slope": -0.1},
        {"prior_intercept": [0.0, 1.0]},
        {"max_slope": True},
        {"damping": float("nan")},
    ]
    for options in bad:
        with pytest.raises(ValueError):
            AcceptanceEstimator(5, **options)
    with pytest.raises(ValueError, match="known options"):
        AcceptanceEstimator.from_config(5, {"learning_rate": 0.1})
    with pytest.raises(ValueError):
        AcceptanceEstimator(0)
