"""Cost model (interpolation, online refinement, persistence) and start-up profiling."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from specverify.cost_model import CostModel
from specverify.profiling import RESERVED_SEQ_ID_BASE, load_or_profile, profile_runners

TOKENS = np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=float)


def true_target(n: np.ndarray | float) -> np.ndarray | float:
    return 0.1 + 0.002 * np.asarray(n, dtype=float)


def model(**kwargs) -> CostModel:
    batch = np.array([1, 2, 4, 8, 16, 32], dtype=float)
    return CostModel(TOKENS, true_target(TOKENS), batch, 0.05 + 0.001 * batch, **kwargs)


# ---- interpolation ----------------------------------------------------------------------------------------


def test_interpolation_and_extrapolation() -> None:
    cost = model()
    for n in TOKENS:
        assert cost.target_time(int(n)) == pytest.approx(true_target(n))
    assert cost.target_time(24) == pytest.approx(true_target(24))  # linear between anchors
    assert cost.target_time(512) == pytest.approx(true_target(512))  # linear beyond the last one
    assert cost.target_time(0) == 0.0 and cost.draft_time(0) == 0.0
    grid = np.arange(0, 300)
    np.testing.assert_allclose(cost.target_time(grid), [cost.target_time(int(n)) for n in grid])
    assert cost.draft_time(8) == pytest.approx(0.058)


def test_noisy_profile_is_made_monotone() -> None:
    seconds = np.array([0.10, 0.10, 0.13, 0.11, 0.12, 0.20, 0.19, 0.40])  # dips at 8 and 64
    cost = CostModel(TOKENS, seconds)
    pred = cost.target_time(np.arange(1, 200))
    assert np.all(np.diff(pred) >= 0)
    # Pooled, not lifted to the running maximum: the 4-token blip is averaged with its neighbours.
    assert cost.target_time(8) < 0.13


def test_no_draft_profile_means_free_drafting() -> None:
    cost = CostModel.from_profile({"target": {"tokens": [1, 8], "seconds": [0.1, 0.2]}, "draft": None})
    assert cost.draft_time(4) == 0.0
    np.testing.assert_array_equal(cost.draft_time(np.array([1, 2])), [0.0, 0.0])


def test_bad_profiles_are_refused() -> None:
    with pytest.raises(ValueError):
        CostModel([1, 2], [0.1, -0.2])
    with pytest.raises(ValueError):
        CostModel([], [])


# ---- online refinement ------------------------------------------------------------------------------------


def test_warmup_observations_are_ignored() -> None:
    cost = model(warmup=3)
    for _ in range(3):
        cost.observe_target(8, 10.0)
    assert cost.target_time(8) == pytest.approx(true_target(8))


def test_online_refinement_converges_to_changed_cost() -> None:
    cost = model()
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.choice([1, 4, 16, 48, 128]))
        cost.observe_target(n, 1.5 * true_target(n) * rng.lognormal(0, 0.03))
        b = int(rng.choice([1, 8, 32]))
        cost.observe_draft(b, 0.7 * (0.05 + 0.001 * b))
    for n in (1, 4, 16, 48, 128):
        assert cost.target_time(n) == pytest.approx(1.5 * true_target(n), rel=0.04)
    assert cost.draft_time(8) == pytest.approx(0.7 * 0.058, rel=0.04)


def test_single_outlier_barely_moves_the_prediction() -> None:
    cost = model()
    for _ in range(50):
        cost.observe_target(16, true_target(16))
    before = cost.target_time(16)
    cost.observe_target(16, 10 * true_target(16))
    assert cost.target_time(16) == pytest.approx(before, rel=0.03)
    cost.observe_target(16, 0.05 * true_target(16))  # and a freak fast one
    assert cost.target_time(16) == pytest.approx(before, rel=0.03)


@pytest.mark.parametrize("seen_before", [0, 500])
def test_a_profile_that_is_off_is_corrected_within_a_few_steps(seen_before) -> None:
    """The profile under-states one budget by 30 % (taken in a quiet moment, or a budget first used
    late, after hundreds of steps at another): the running-mean start corrects it within ten steps."""
    cost = model()
    for _ in range(seen_before):
        cost.observe_target(8, true_target(8))
    for _ in range(cost.target.warmup + 10):
        cost.observe_target(64, 1.3 * true_target(64))
        if seen_before:  # steps at the well-measured budget go on
            cost.observe_target(8, true_target(8))
    assert cost.target_time(64) == pytest.approx(1.3 * true_target(64), rel=0.06)
    assert cost.target_time(8) == pytest.approx(true_target(8), rel=0.06 if seen_before else 0.35)


def test_a_budget_first_measured_late_is_corrected_by_its_first_few_observations() -> None:
    """Speculation ran for hundreds of steps while plain steps at this size were never measured, and the
    plain curve there is 50 % too dear on paper: the engine's few forced plain steps (3) must correct
    most of it, though each observation is clipped around the prediction against outliers."""
    cost = model()
    for _ in range(300):  # plain steps elsewhere, verification everywhere: curves well measured
        cost.observe_plain(4, true_target(4))
        cost.observe_target(48, true_target(48))
    cost.plain.base[cost.plain.x == 16] *= 1.5  # the profile over-states plain steps at 16 tokens
    cost.plain.log_base = np.log(cost.plain.base)
    cost.plain._refresh()
    assert cost.plain_time(16) == pytest.approx(1.5 * true_target(16), rel=0.02)
    for _ in range(3):
        cost.observe_plain(16, true_target(16))
    assert cost.plain_time(16) == pytest.approx(true_target(16), rel=0.12)  # clip 0.15 alone: 1.27x
    assert cost.plain_time(4) == pytest.approx(true_target(4), rel=0.08)  # others move with the level only


def test_one_curve_far_from_its_profile_does_not_drag_the_others() -> None:
    """Plain steps at 32 requests take twice the profile's time (it spread 32 tokens over 8 sequences;
    the engine has 32, each with its own attention), for a few hundred steps with nothing else
    measured: the plain curve learns it, and the shared drift stays near zero, so predicted verification
    and drafting keep their measured levels (the drift once slid to -0.9: drafts and verification
    predicted at 0.4x, and speculation chosen where it lost 16 %)."""
    cost = model()
    for _ in range(300):
        cost.observe_plain(32, 2.0 * true_target(32))
    assert cost.plain_time(32) == pytest.approx(2.0 * true_target(32), rel=0.03)
    assert abs(cost.drift.value) < 0.15
    assert cost.target_time(32) == pytest.approx(true_target(32), rel=0.15)
    assert cost.draft_time(8) == pytest.approx(0.058, rel=0.15)


def test_a_prefill_beyond_the_profile_learns_its_own_anchor() -> None:
    """Prefills of 500 tokens take half the profile's linear extrapolation from 128 (long forwards use
    the cores better). They are learned at anchors of their own: decode steps, priced at the profiled
    anchors, stay where they were measured (when the last profiled anchor absorbed them, a 128-token
    step was predicted at 0.6x)."""
    cost = model()
    for _ in range(30):
        cost.observe_plain(500, 0.5 * true_target(500))
        for n in (16, 64, 128):
            cost.observe_plain(n, true_target(n))
    assert cost.plain_time(500) == pytest.approx(0.5 * true_target(500), rel=0.05)
    for n in (16, 64, 128):
        assert cost.plain_time(n) == pytest.approx(true_target(n), rel=0.05)


def test_never_observed_bucket_follows_global_drift() -> None:
    cost = model()
    for _ in range(200):
        cost.observe_target(8, 1.3 * true_target(8))
    assert cost.target_time(8) == pytest.approx(1.3 * true_target(8), rel=0.02)
    for n in (1, 64, 128, 300):  # never measured
        assert cost.target_time(n) == pytest.approx(1.3 * true_target(n), rel=0.05)


def test_a_slow_spell_seen_by_plain_steps_alone_slows_every_curve() -> None:
    cost = model()
    rng = np.random.default_rng(4)
    for _ in range(400):  # verification persistently 20 % dearer than a plain step of the same size
        n = int(rng.choice([8, 32]))
        cost.observe_target(n, 1.2 * true_target(n))
        cost.observe_plain(n, true_target(n))
    assert cost.target_time(32) == pytest.approx(1.2 * true_target(32), rel=0.03)
    assert cost.plain_time(32) == pytest.approx(true_target(32), rel=0.03)
    draft_before = cost.draft_time(8)
    for _ in range(60):  # the machine slows by half while speculation is off: plain steps only
        cost.observe_plain(32, 1.5 * true_target(32))
    assert cost.plain_time(32) == pytest.approx(1.5 * true_target(32), rel=0.03)
    # The unmeasured curves follow the machine (most of the slow-down is read as the machine's drift),
    # so speculation does not look cheaper than plain decoding merely because only plain decoding was
    # measured lately. Separate curves would leave target / plain at 1.2 / 1.5 = 0.8.
    assert cost.target_time(32) / cost.plain_time(32) >= 0.9
    assert cost.draft_time(8) / draft_before >= 1.15  # separate curves: 1.0


def test_a_lasting_change_seen_by_speculative_steps_alone_leaves_plain_decoding_as_measured() -> None:
    """Every curve measured at its profile, then 100 speculative steps (a verification and five draft
    forwards each) 20 % dearer than before, e.g. at a load whose anchors were never used: after that long
    the change belongs to the curves that measured it. Plain decoding, measured at its profile, stays
    there (without the drift's hand-over it followed to 1.13-1.20x: speculation looked better than it
    was at concurrency 4, greedy, and lost 8 % to plain decoding)."""
    rng = np.random.default_rng(0)
    cost = model()
    noise = lambda: float(np.exp(rng.normal(0.0, 0.1)))  # noqa: E731
    for _ in range(300):
        cost.observe_plain(4, true_target(4) * noise())
        cost.observe_target(24, true_target(24) * noise())
        cost.observe_draft(4, 0.054 * noise())
    for _ in range(100):
        cost.observe_target(24, 1.2 * true_target(24) * noise())
        for _ in range(5):
            cost.observe_draft(4, 1.2 * 0.054 * noise())
    assert cost.plain_time(4) == pytest.approx(true_target(4), rel=0.06)
    assert cost.target_time(24) == pytest.approx(1.2 * true_target(24), rel=0.08)
    assert cost.draft_time(4) == pytest.approx(1.2 * 0.054, rel=0.06)
    assert abs(cost.drift.value) < 0.06


def test_bucket_specific_deviation_is_learned_without_moving_the_rest_much() -> None:
    cost = model()
    rng = np.random.default_rng(1)
    for _ in range(1500):
        n = int(rng.choice([4, 16, 32, 64]))
        factor = 1.5 if n == 32 else 1.0
        cost.observe_target(n, factor * true_target(n))
    assert cost.target_time(32) == pytest.approx(1.5 * true_target(32), rel=0.05)
    assert cost.target_time(4) == pytest.approx(true_target(4), rel=0.05)
    # Measured at its profile, 64 stays there, below the dear 32: a measured dip is kept.
    assert cost.target_time(64) == pytest.approx(true_target(64), rel=0.05)


def test_a_measured_dip_is_kept_and_unmeasured_counts_stay_monotone() -> None:
    """On this CPU a target forward over 2 rows takes 0.20 s and over 5-6 rows 0.14 s. The profile (flat
    0.2 s up to 8 tokens after pooling) must learn the dip where it is measured; the monotone envelope
    priced every deep draft at the 2-row cost."""
    tokens = np.array([1, 2, 4, 8, 16, 32], dtype=float)
    cost = CostModel(tokens, [0.2, 0.2, 0.2, 0.2, 0.25, 0.35])
    for _ in range(60):
        cost.observe_target(2, 0.20)
        cost.observe_target(6, 0.14)
    assert cost.target_time(2) == pytest.approx(0.20, rel=0.05)
    assert cost.target_time(6) == pytest.approx(0.14, rel=0.05)
    # Never measured: 32 is priced from its profile, never below the measured 2-row cost.
    assert cost.target_time(32) >= cost.target_time(2)


def test_context_term_is_fitted_when_it_explains_variance() -> None:
    rng = np.random.default_rng(2)
    cost = model()
    coef = 2e-5
    for _ in range(400):
        n, ctx = int(rng.choice([4, 16, 64])), int(rng.integers(100, 4000))
        cost.observe_target(n, true_target(n) + coef * ctx, context_tokens=ctx)
    assert cost.context_coef == pytest.approx(coef, rel=0.25)
    for ctx in (200, 3500):
        assert cost.target_time(16, ctx) == pytest.approx(true_target(16) + coef * ctx, rel=0.05)
    # No dependence on context: the term stays off.
    flat = model()
    for _ in range(400):
        n, ctx = int(rng.choice([4, 16, 64])), int(rng.integers(100, 4000))
        flat.observe_target(n, true_target(n) * rng.lognormal(0, 0.02), context_tokens=ctx)
    assert abs(flat.context_coef) < 0.2 * coef


def test_serialization_round_trip() -> None:
    cost = model()
    rng = np.random.default_rng(3)
    for _ in range(40):
        n = int(rng.choice([2, 16, 100]))
        cost.observe_target(n, 1.2 * true_target(n), context_tokens=int(rng.integers(10, 500)))
        cost.observe_draft(4, 0.06)
    clone = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    grid = np.arange(0, 200)
    np.testing.assert_allclose(clone.target_time(grid), cost.target_time(grid))
    np.testing.assert_allclose(clone.target_time(grid, 300), cost.target_time(grid, 300))
    np.testing.assert_allclose(clone.draft_time(grid), cost.draft_time(grid))
    cost.observe_target(16, 0.3)
    clone.observe_target(16, 0.3)
    assert clone.target_time(16) == cost.target_time(16)


# ---- profiling --------------------------------------------------------------------------------------------


class SleepyRunner:
    """A runner whose forward sleeps `fixed + per_token * tokens`; counts calls, checks cache bookkeeping."""

    def __init__(self, fixed: float, per_token: float) -> None:
        self.vocab_size = 50
        self.max_model_len = 1024
        self.device = torch.device("cpu")
        self.fixed, self.per_token = fixed, per_token
        self.caches: dict[int, int] = {}
        self.calls = 0
        self.layouts: set[tuple[int, ...]] = set()  # tokens per sequence of each forward

    def forward(self, seq_ids, tokens, num_logits):
        self.calls += 1
        self.layouts.add(tuple(len(t) for t in tokens))
        n = sum(len(t) for t in tokens)
        for sid, t in zip(seq_ids, tokens, strict=True):
            assert sid <= RESERVED_SEQ_ID_BASE  # dummy ids never collide with the engine's
            self.caches[sid] = self.caches.get(sid, 0) + len(t)
        time.sleep(self.fixed + self.per_token * n)
        return torch.zeros(sum(num_logits), self.vocab_size)

    def cache_length(self, seq_id):
        return self.caches.get(seq_id, 0)

    def truncate(self, seq_id, length):
        assert length <= self.caches[seq_id]
        self.caches[seq_id] = length

    def release(self, seq_id):
        self.caches.pop(seq_id, None)


def test_profile_recovers_the_slope_and_cleans_up() -> None:
    target, draft = SleepyRunner(0.001, 0.0005), SleepyRunner(0.001, 0.0003)
    profile = profile_runners(
        target,
        draft,
        token_counts=(1, 4, 16, 32),
        batch_sizes=(1, 8, 32),
        repeats=3,
        context=16,
        progress=False,
    )
    assert target.caches == {} and draft.caches == {}  # dummy sequences released
    t = profile["target"]
    slope = np.polyfit(t["tokens"], t["seconds"], 1)[0]
    assert slope == pytest.approx(0.0005, rel=0.25)
    d = profile["draft"]
    assert d["tokens"] == [1, 8, 32, 64, 128, 256]  # decode batches, then catch-up forwards
    assert np.polyfit(d["tokens"], d["seconds"], 1)[0] == pytest.approx(0.0003, rel=0.25)
    cost = CostModel.from_profile(json.loads(json.dumps(profile)))
    assert cost.target_time(64) > cost.target_time(1)


def test_profile_lays_target_tokens_out_like_verification() -> None:
    """K + 1 tokens to a request: one request verifying 5 drafts is a 6-token forward over one sequence,
    and that is what the profile must time (not six one-token sequences)."""
    kwargs = dict(token_counts=(1, 6, 12, 48, 64), batch_sizes=(), repeats=1, context=3, progress=False)
    target = SleepyRunner(0.0, 0.0)
    profile = profile_runners(target, None, tokens_per_seq=6, max_seqs=8, **kwargs)
    assert profile["tokens_per_seq"] == 6 and profile["target"]["tokens"] == [1, 6, 12, 48, 64]
    timed = {layout for layout in target.layouts if 3 not in layout}  # not the untimed 3-token prefills
    assert timed == {(1,), (6,), (6, 6), (6,) * 8, (8,) * 8}  # past 8 x 6: 8 sequences
    plain = SleepyRunner(0.0, 0.0)
    profile_runners(plain, None, max_seqs=8, **kwargs)  # default: a token to a sequence, as decoding
    timed = {layout for layout in plain.layouts if 3 not in layout}
    assert timed == {(1,), (1,) * 6, (2,) * 4 + (1,) * 4, (6,) * 8, (8,) * 8}


def test_profile_cache_hit_does_not_reprofile(tmp_path) -> None:
    path = tmp_path / "profiles.json"
    kwargs = dict(token_counts=(1, 8), batch_sizes=(1, 4), repeats=1, context=4, progress=False)
    target, draft = SleepyRunner(0.0, 0.0), SleepyRunner(0.0, 0.0)
    first = load_or_profile(target, draft, path, "pair-a/bf16", **kwargs)
    assert target.calls > 0 and draft.calls > 0
    target.calls = draft.calls = 0
    again = load_or_profile(target, draft, path, "pair-a/bf16", **kwargs)
    assert target.calls == 0 and draft.calls == 0
    assert again["target"] == first["target"]
    # Another model pair on the same machine is profiled, and both stay cached.
    load_or_profile(target, draft, path, "pair-b/bf16", **kwargs)
    assert target.calls > 0
    assert len(json.loads(path.read_text())["profiles"]) == 2
    # A corrupt cache is rebuilt, not fatal.
    path.write_text("{not json")
    target.calls = 0
    load_or_profile(target, None, path, "pair-a/bf16", **kwargs)
    assert target.calls > 0
