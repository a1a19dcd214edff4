"""Adaptive-verification planner: decisions follow the costs, and admission is lossless (DESIGN §5)."""

from __future__ import annotations

import numpy as np
import pytest

from specverify.cost_model import CostModel
from specverify.planner import AdaptivePlanner, reached_acceptance, survival, top_b_prefix

K = 5
TOKENS = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256], dtype=float)
BATCH = np.array([1, 2, 4, 8, 16, 32], dtype=float)


def cheap_cost() -> CostModel:
    """Memory-bound target (extra tokens almost free) and a very cheap drafter."""
    return CostModel(TOKENS, 0.30 + 1e-5 * TOKENS, BATCH, 0.005 + 1e-5 * BATCH)


def expensive_cost() -> CostModel:
    """Compute-bound target (cost proportional to tokens) and a drafter at half a target token."""
    return CostModel(TOKENS, 0.02 * TOKENS, BATCH, np.maximum(0.18, 0.01 * BATCH))


def cpu_like_cost() -> CostModel:
    """The DESIGN §4 numbers: 356 ms at 1 token, ~382 at 6, compute-bound from ~32; draft ~183 ms."""
    return CostModel(TOKENS, np.maximum(0.35 + 0.005 * TOKENS, 0.011 * TOKENS), BATCH, 0.18 + 0.002 * BATCH)


def random_survival(rng: np.random.Generator, r: int, d: int, lo: float = 0.2) -> np.ndarray:
    return survival(rng.uniform(lo, 1.0, size=(r, d)))


def warm(planner: AdaptivePlanner, rng: np.random.Generator, r: int, steps: int = 4) -> None:
    for _ in range(steps):
        planner.choose_draft_depth(r, np.full(K, 0.7))
        s = random_survival(rng, r, K)
        planner.end_step(s, planner.admit(s))


# ---- survival and top-B ---------------------------------------------------------------------------------


def test_survival_is_cumulative_product_with_nan_as_zero() -> None:
    p = np.array([[0.5, 0.5, np.nan, 0.9], [1.0, 0.8, 0.5, 0.5]])
    s = survival(p)
    np.testing.assert_allclose(s[0], [0.5, 0.25, 0.0, 0.0])
    np.testing.assert_allclose(s[1], [1.0, 0.8, 0.4, 0.2])


def test_top_b_ties_broken_by_position() -> None:
    # s[0, 0] == s[0, 1] == s[1, 0]: the request-0 slot 1 must not outrank request 1's slot 0, and never
    # its own slot 0.
    s = np.array([[0.5, 0.5, 0.1], [0.5, 0.2, 0.1]])
    np.testing.assert_array_equal(top_b_prefix(s, 1), [1, 0])
    np.testing.assert_array_equal(top_b_prefix(s, 2), [1, 1])
    np.testing.assert_array_equal(top_b_prefix(s, 3), [2, 1])
    np.testing.assert_array_equal(top_b_prefix(s, 100), [3, 3])
    # Constant survival along a request (p = 1): still a prefix, in position order.
    np.testing.assert_array_equal(top_b_prefix(np.full((1, 4), 0.3), 2), [2])


def test_admission_ties_and_prefixes() -> None:
    planner = AdaptivePlanner(cheap_cost(), K)
    s = np.array([[0.6, 0.6, 0.6, 0.2, 0.2], [0.9, 0.3, 0.3, 0.3, 0.0]])
    np.testing.assert_array_equal(planner.admit(s, threshold=0.6), [3, 1])
    np.testing.assert_array_equal(planner.admit(s, threshold=0.3), [3, 4])
    # Not monotone (rounding, or a bad estimate): still a prefix, stopping at the first slot below tau.
    np.testing.assert_array_equal(planner.admit(np.array([[0.9, 0.1, 0.8]]), threshold=0.5), [1])


# ---- the losslessness rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_admission_of_slot_k_ignores_later_slots_of_same_request(seed: int) -> None:
    """Slot k's verification may read s[r, <=k] and other requests, never s[r, >k] (DESIGN §5)."""
    rng = np.random.default_rng(seed)
    r = int(rng.integers(1, 5)) if seed % 2 else int(rng.integers(1, 33))  # few requests: one row weighs
    planner = AdaptivePlanner(cpu_like_cost(), K)
    warm(planner, rng, r)
    planner.choose_draft_depth(r, np.full(K, 0.7))  # fixes this step's threshold before the drafts
    tau = planner.threshold
    s = random_survival(rng, r, K)
    base = planner.admit(s)
    assert planner.threshold == tau  # admitting never moves the threshold it uses
    for _ in range(30):
        row, k = int(rng.integers(r)), int(rng.integers(K - 1))
        # The later slots of that request, as a different token at k could make them: any survival in
        # [0, s[row, k]] (including both extremes).
        for later in ("max", "zero", "random"):
            changed = s.copy()
            if later == "max":
                changed[row, k + 1 :] = s[row, k]
            elif later == "zero":
                changed[row, k + 1 :] = 0.0
            else:
                changed[row, k + 1 :] = s[row, k] * survival(rng.uniform(0, 1, size=(1, K - k - 1)))[0]
            n = planner.admit(changed)
            assert (n[row] > np.arange(k + 1)).tolist() == (base[row] > np.arange(k + 1)).tolist()
            # Other requests: unchanged admission.
            others = np.arange(r) != row
            np.testing.assert_array_equal(n[others], base[others])
            # The budgeted (top-B) rule with B fixed before the step is lossless too, thanks to the
            # tie-break by position.
            b = int(rng.integers(0, r * K + 1))
            assert (top_b_prefix(changed, b)[row] > np.arange(k + 1)).tolist() == (
                top_b_prefix(s, b)[row] > np.arange(k + 1)
            ).tolist()


def test_threshold_of_a_step_does_not_depend_on_its_own_survivals() -> None:
    rng = np.random.default_rng(1)
    a, b = AdaptivePlanner(cpu_like_cost(), K), AdaptivePlanner(cpu_like_cost(), K)
    warm(a, np.random.default_rng(2), 8)
    warm(b, np.random.default_rng(2), 8)
    a.choose_draft_depth(8, np.full(K, 0.7))
    b.choose_draft_depth(8, np.full(K, 0.7))
    assert a.threshold == b.threshold
    # Different drafts this step: same admission rule; only end_step (used next step) may differ.
    s1, s2 = random_survival(rng, 8, K), random_survival(rng, 8, K, lo=0.9)
    assert a.threshold == b.threshold
    a.admit(s1)
    b.admit(s2)
    assert a.threshold == b.threshold


# ---- decisions follow the costs -------------------------------------------------------------------------


def test_cheap_verification_verifies_everything_drafted() -> None:
    rng = np.random.default_rng(0)
    planner = AdaptivePlanner(cheap_cost(), K)
    warm(planner, rng, 16)
    depth = planner.choose_draft_depth(16, np.full(K, 0.7))
    assert depth == K
    s = random_survival(rng, 16, K)
    np.testing.assert_array_equal(planner.admit(s), np.full(16, K))


def test_expensive_verification_turns_speculation_off_at_high_load() -> None:
    rng = np.random.default_rng(0)
    planner = AdaptivePlanner(expensive_cost(), K)
    assert planner.choose_draft_depth(32, np.full(K, 0.7)) == 0
    assert planner.expected_rate == pytest.approx(32 / expensive_cost().target_time(32))
    # Verification proportional to tokens, drafting nearly free: a drafted slot only pays if it is
    # surely accepted, so (almost) nothing is verified even with drafts in hand.
    steep = AdaptivePlanner(CostModel(TOKENS, 0.02 * TOKENS, BATCH, 1e-4 * BATCH), K)
    assert steep.choose_draft_depth(32, np.full(K, 0.7)) == 0
    steep.end_step(random_survival(rng, 32, K), np.zeros(32, dtype=int))
    n = steep.admit(random_survival(rng, 32, K))
    assert n.sum() <= 0.05 * 32 * K
    # The same planner keeps speculation on at low load where the target is not compute bound.
    low = AdaptivePlanner(cpu_like_cost(), K)
    assert low.choose_draft_depth(1, np.full(K, 0.9)) > 0
    assert low.choose_draft_depth(32, np.full(K, 0.6)) == 0


def test_low_load_high_acceptance_drafts_deep() -> None:
    cost = CostModel(TOKENS, 0.35 + 0.001 * TOKENS, BATCH, 0.03 + 0.001 * BATCH)
    planner = AdaptivePlanner(cost, K)
    assert planner.choose_draft_depth(1, np.full(K, 0.95)) == K
    # Low acceptance with the same costs: shallower.
    assert planner.choose_draft_depth(1, np.full(K, 0.3)) < K


def test_depth_decreases_with_load_on_cpu_like_costs() -> None:
    planner = AdaptivePlanner(cpu_like_cost(), K)
    depths = [planner.choose_draft_depth(r, np.full(K, 0.8)) for r in (1, 2, 4, 8, 16, 32)]
    assert depths == sorted(depths, reverse=True)
    assert depths[0] >= 2 and depths[-1] <= 1


def test_threshold_tracks_verification_cost() -> None:
    rng = np.random.default_rng(3)
    s = random_survival(rng, 16, K)
    cheap, dear = AdaptivePlanner(cheap_cost(), K), AdaptivePlanner(expensive_cost(), K)
    for planner in (cheap, dear):
        planner.end_step(s, np.full(16, K))
    assert cheap.threshold < s.min() + 1e-12  # verify all
    assert dear.threshold > cheap.threshold


def test_should_continue_stops_hopeless_requests_and_at_k() -> None:
    planner = AdaptivePlanner(cpu_like_cost(), K)
    planner.choose_draft_depth(4, np.full(K, 0.8))
    s = np.array([0.95, 0.9, 0.01, 0.0])
    go = planner.should_continue(s, 2)
    assert go.dtype == bool and go.shape == (4,)
    assert not go[2] and not go[3]
    # A request continues only if every request with more survival continues (largest gains first).
    for i in range(4):
        if go[i]:
            assert go[s > s[i]].all()
    assert not planner.should_continue(np.ones(4), K).any()
    assert not planner.should_continue(np.ones(4), 2, max_depth=2).any()
    # At high load on a compute-bound target, drafting one more slot does not pay.
    dear = AdaptivePlanner(expensive_cost(), K)
    dear.choose_draft_depth(32, np.full(K, 0.7))
    assert not dear.should_continue(np.full(32, 0.5), 1).any()
    # Cheap drafting and verification: everyone with a chance continues.
    cheap = AdaptivePlanner(cheap_cost(), K)
    cheap.choose_draft_depth(8, np.full(K, 0.7))
    assert cheap.should_continue(np.full(8, 0.5), 1).all()


def test_should_continue_looks_past_a_bump_in_the_cost_curve() -> None:
    # The CPU's shape at one request: the int4 kernel up to 6 verified tokens, then one dear step to bf16
    # (7 ms) and ~1 ms per token after. Slot 6's own gain (0.9 ** 6 = 0.53 tokens) is below what 7 ms
    # buy at the plan's rate (~0.8 tokens), but the ten slots after it are cheap: drafting goes on. With
    # every token as dear as the bump, it stops.
    tokens = np.array([1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32], dtype=float)
    bumpy = np.array([34, 38, 42, 46, 50, 54, 61, 62, 66, 70, 80, 90], dtype=float) / 1e3
    steep = np.concatenate([bumpy[:6], 0.054 + 0.007 * (tokens[6:] - 6)])
    k, p = 16, np.full(16, 0.9)
    for times, goes_on in ((bumpy, True), (steep, False)):
        planner = AdaptivePlanner(CostModel(tokens, times), k)  # no draft curve: a drafter that costs nothing
        planner.choose_draft_depth(1, p)
        one_slot_cost = planner.cost.target_time(7) - planner.cost.target_time(6)
        assert 0.9**6 < planner.value_of_time * one_slot_cost  # a one-slot rule would stop here
        assert planner.should_continue(np.array([0.9**5]), 5).tolist() == [goes_on]


def test_should_continue_extrapolates_each_requests_own_acceptance() -> None:
    # A long suffix match keeps being accepted (~0.95 a slot) while the mean acceptance per position is
    # poor (0.5): with each request's last acceptance carried forward, the matched request drafts on and
    # the one that just drafted a doubtful slot stops; with the mean alone, both stop.
    tokens = np.array([1, 2, 4, 8, 16, 32], dtype=float)
    k = 16
    planner = AdaptivePlanner(CostModel(tokens, 0.034 + 0.01 * (tokens - 1)), k)
    planner.choose_draft_depth(2, np.full(k, 0.5))
    s = np.array([0.95**4, 0.95**3 * 0.3])
    assert planner.should_continue(s, 4).tolist() == [False, False]
    assert planner.should_continue(s, 4, last_acceptance=np.array([0.95, 0.3])).tolist() == [True, False]


# ---- edge cases -------------------------------------------------------------------------------------------


def test_empty_batch_all_nan_and_depth_zero() -> None:
    planner = AdaptivePlanner(cpu_like_cost(), K)
    assert planner.choose_draft_depth(0, np.full(K, 0.9)) == 0
    assert planner.admit(np.zeros((0, K))).shape == (0,)
    assert planner.should_continue(np.zeros(0), 1).shape == (0,)
    planner.end_step(np.zeros((0, K)), np.zeros(0, dtype=int))
    np.testing.assert_array_equal(planner.admit(np.full((3, K), np.nan), threshold=0.0), [0, 0, 0])
    np.testing.assert_array_equal(planner.admit(np.zeros((3, 0))), [0, 0, 0])
    planner.end_step(np.zeros((3, 0)), np.zeros(3, dtype=int))
    planner.end_step(np.full((3, K), np.nan), np.zeros(3, dtype=int))
    assert np.isfinite(planner.threshold)
    # NaN / short expected acceptance is tolerated.
    assert 0 <= planner.choose_draft_depth(4, np.array([0.9, np.nan])) <= K
    assert 0 <= planner.choose_draft_depth(4, np.full(K, np.nan)) <= K


def test_undrafted_zero_slots_are_not_verified() -> None:
    planner = AdaptivePlanner(cheap_cost(), K)
    s = np.array([[0.9, 0.8, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(planner.admit(s, threshold=0.0), [2])


# (Planner overhead is a performance figure: the benchmark measures it as a share of step time.)


def test_a_shared_prefill_does_not_buy_drafts_that_pay_worse_than_plain_decoding() -> None:
    # 32 requests entering together: the step is dominated by the target's prefill, so this step's
    # tokens/second rises with any extra token; but the drafts (and the draft's own prefill) buy them
    # at a worse rate than plain decoding gives in the following steps.
    planner = AdaptivePlanner(cpu_like_cost(), K)
    assert planner.choose_draft_depth(32, np.full(K, 0.8)) == 0  # steady state: plain wins
    prefill = dict(target_feed_tokens=32 * 110, draft_feed_tokens=32 * 110)
    assert planner.choose_draft_depth(32, np.full(K, 0.8), **prefill) == 0
    # The old criterion (this step's rate alone) would have drafted: the test can tell them apart.
    rate, *_ = planner._plan(
        32, np.arange(K + 1), np.cumprod(np.full(K, 0.8))[None, :], 0, target_feed=3520, draft_feed=3520
    )
    assert rate[1:].max() > rate[0]
    # One request: speculation pays even counting the draft's prefill of its prompt.
    one = dict(target_feed_tokens=110, draft_feed_tokens=110, remaining_tokens=128)
    assert planner.choose_draft_depth(1, np.full(K, 0.9), **one) > 0


def test_draft_catch_up_is_priced() -> None:
    # A load where speculation wins a little in the steady state, but not enough to feed the draft
    # hundreds of missed tokens.
    planner = AdaptivePlanner(cpu_like_cost(), K)
    r, p = 4, np.full(K, 0.8)
    assert planner.choose_draft_depth(r, p) > 0
    # Requests about to finish: the catch-up could not pay back.
    assert planner.choose_draft_depth(r, p, draft_feed_tokens=r * 200, remaining_tokens=4) == 0
    # With no word of what the requests still have, it is charged to this step alone.
    assert planner.choose_draft_depth(r, p, draft_feed_tokens=r * 200) == 0
    # Amortised over the steps long requests still have, it is worth paying.
    assert planner.choose_draft_depth(r, p, draft_feed_tokens=r * 200, remaining_tokens=10_000) > 0


def test_a_new_prompt_is_caught_up_where_speculation_pays_a_little() -> None:
    """One request where drafting beats plain decoding only modestly. Its draft has not read its prompt
    (150 tokens): paid once, the catch-up comes back over the 120 tokens the request still has, while
    every plain step would add one more token to catch up. A cap of 16 steps on the amortisation kept
    whole requests plain in the benchmark at one request (speculation ran 1.19x plain there)."""
    planner = AdaptivePlanner(cpu_like_cost(), K)
    p = np.full(K, 0.6)
    assert planner.choose_draft_depth(1, p) > 0
    assert planner.choose_draft_depth(1, p, draft_feed_tokens=150, remaining_tokens=120) > 0
    assert planner.choose_draft_depth(1, p, draft_feed_tokens=150, remaining_tokens=4) == 0


def test_what_every_speculative_step_leaves_the_draft_is_priced_every_step() -> None:
    """After a speculative step the draft has one or two tokens per request to read (the correction,
    or its last draft and the bonus), so its first forward reads up to 2R rows every step: at four
    requests 8 rows, past where the CPU's int4 kernel is used (a step in the draft's cost). That forward
    is priced at its size, not amortised like a catch-up the following steps would reuse."""
    cost = CostModel(TOKENS, 0.05 + 0.004 * TOKENS, BATCH, np.where(BATCH <= 4, 0.018, 0.03))
    planner = AdaptivePlanner(cost, K)
    p, r = np.full(K, 0.8), 4
    assert planner.choose_draft_depth(r, p, draft_feed_tokens=r, remaining_tokens=128) > 0
    caught_up = planner.expected_seconds
    assert planner.choose_draft_depth(r, p, draft_feed_tokens=2 * r, remaining_tokens=128) > 0
    assert planner.expected_seconds == pytest.approx(caught_up + 0.03 - 0.018, rel=1e-6)


def test_a_catch_up_that_no_later_step_would_reuse_is_charged_whole() -> None:
    """Four requests of a burst of 32 have joined (their prompts already prefilled, the draft still
    to read them): at 4 speculation pays and the draft's catch-up would be amortised over later steps;
    but once the burst has joined, plain decoding wins, so the catch-up would be wasted."""
    planner = AdaptivePlanner(cpu_like_cost(), K)
    r, p = 4, np.full(K, 0.8)
    burst = dict(target_feed_tokens=r, draft_feed_tokens=256, remaining_tokens=128)
    assert planner.choose_draft_depth(r, p) > 0  # steady state at 4: speculation
    assert planner.choose_draft_depth(32, p) == 0  # steady state at 32: plain
    assert planner.choose_draft_depth(r, p, **burst) > 0  # alone, the catch-up is worth amortising
    assert planner.choose_draft_depth(r, p, **burst, steady_requests=4) > 0
    assert planner.choose_draft_depth(r, p, **burst, steady_requests=32) == 0
    # Charged whole only where the steady state says plain: without a catch-up nothing changes.
    assert planner.choose_draft_depth(r, p, steady_requests=32) > 0


def test_the_steady_state_of_a_burst_must_pay_its_own_catch_up() -> None:
    """At 16 requests drafting beats plain decoding by 7 % once every draft has caught up, but not if
    each of the 16 must first feed its 64-token prompt to the draft (amortised over 16 steps: 0.91x).
    So the first 4 requests of a 16-request burst decode plainly: otherwise their catch-up is spent,
    and the catch-up of the other 12 then keeps speculation off (seen in the benchmark at 8 and 16)."""
    planner = AdaptivePlanner(cpu_like_cost(), K)
    r, p = 4, np.full(K, 0.8)
    assert planner.choose_draft_depth(16, p) > 0  # steady state at 16, drafts caught up: speculation
    burst = dict(target_feed_tokens=r, draft_feed_tokens=r * 64, remaining_tokens=128)
    assert planner.choose_draft_depth(r, p, **burst, steady_requests=4) > 0
    assert planner.choose_draft_depth(r, p, **burst, steady_requests=16) == 0


def test_could_pay_only_where_better_drafts_could_win() -> None:
    planner = AdaptivePlanner(expensive_cost(), K)
    planner.choose_draft_depth(32, np.full(K, 0.7))
    assert not planner.could_pay(32)  # compute-bound verification: no acceptance rate makes it pay
    low = AdaptivePlanner(cpu_like_cost(), K)
    low.choose_draft_depth(1, np.full(K, 0.3))  # a pessimistic estimate turned speculation off...
    assert low.depth == 0
    assert low.could_pay(1)  # ...but at one request better drafts would pay: worth a probe
    assert not low.could_pay(0)


def test_plain_steps_revise_a_pessimistic_history() -> None:
    """One step where no request had anything to draft (a suffix drafter without a match) turns
    speculation off; plain steps bring no survivals, yet they must let the expected acceptance speak
    again, or that one step would keep every later step plain."""
    r, p = 4, np.full(K, 0.9)
    planner = AdaptivePlanner(cheap_cost(), K)
    assert planner.choose_draft_depth(r, p) > 0
    nothing = np.ones((r, K), dtype=bool)
    planner.end_step(np.zeros((r, K)), np.zeros(r, dtype=np.int64), nothing_to_draft=nothing)
    assert planner.choose_draft_depth(r, p) == 0
    assert planner.choose_draft_depth(r, p) == 0  # deciding again learns nothing
    planner.end_plain_step(r)
    assert planner.choose_draft_depth(r, p) > 0


def test_realised_gain_below_plan_turns_speculation_off_and_decays_back() -> None:
    """Steps that yield a third of the planned draft gain: the factor follows the measured tokens and
    speculation stops at a load where it paid only on paper; after plain steps it is tried again."""
    r, p = 4, np.full(K, 0.8)
    planner = AdaptivePlanner(cpu_like_cost(), K)
    assert planner.choose_draft_depth(r, p) > 0
    speculative_steps = 0
    drafts = np.tile(np.cumprod(p), (r, 1))  # every request drafts K with these survivals

    def admitted_gain(planner: AdaptivePlanner) -> float:  # summed survivals of the admitted drafts
        return sum(drafts[i, :n].sum() for i, n in enumerate(planner.admit(drafts)))

    while planner.choose_draft_depth(r, p) > 0 and speculative_steps < 100:
        speculative_steps += 1
        planner.observe_tokens(r + admitted_gain(planner) / 3.0)
    assert 1 <= speculative_steps < 20
    assert planner.gain_factor < 0.8
    # No dead spot: without speculative steps the sums decay and the prior brings it back.
    steps_off = 0
    while planner.choose_draft_depth(r, p) == 0 and steps_off < 1000:
        steps_off += 1
    assert 1 <= steps_off < 1000
    # Steps that yield what was planned keep the factor at 1; a plain step is never counted.
    fresh = AdaptivePlanner(cpu_like_cost(), K)
    for _ in range(20):
        fresh.choose_draft_depth(r, p)
        fresh.observe_tokens(r + admitted_gain(fresh))
    assert fresh.gain_factor == pytest.approx(1.0, abs=0.05)
    fresh.choose_draft_depth(32, np.full(K, 0.3))  # depth 0
    fresh.observe_tokens(0)
    assert fresh.gain_factor == pytest.approx(1.0, abs=0.05)


def test_metrics_attributes() -> None:
    planner = AdaptivePlanner(cpu_like_cost(), K)
    d = planner.choose_draft_depth(2, np.full(K, 0.8))
    state = planner.state()
    assert state["depth"] == d and state["expected_rate"] > 0 and state["expected_tokens"] >= 2


def test_drafts_verified_beside_a_prefill_cost_what_they_add_to_that_forward() -> None:
    """On a curve that gets dearer per token past 64 tokens (compute-bound), the same drafts admitted in
    a decode step are priced higher in a step that also prefills 96 prompt tokens, so fewer pay."""
    tokens = np.array([1, 4, 16, 64, 256, 1024])
    seconds = np.array([0.08, 0.09, 0.12, 0.3, 1.5, 7.0])  # 2.7 ms per token up to 64, then 6 ms
    cost = CostModel(
        tokens,
        seconds,
        tokens,
        0.001 * np.ones(6),
        alpha_global=0.0,
        alpha_bucket=0.0,
        alpha_drift=0.0,
        profile_weight=1e9,
        fit_context=False,
    )
    p = np.full(K, 0.9)
    decode, prefill = AdaptivePlanner(cost, K), AdaptivePlanner(cost, K)
    decode.choose_draft_depth(4, p)
    prefill.choose_draft_depth(4, p, target_feed_tokens=4 + 96)
    assert 0 < prefill.planned_budget < decode.planned_budget


@pytest.mark.parametrize("seed", range(3))
def test_without_a_catch_up_the_horizon_and_the_joining_batch_change_nothing(seed: int) -> None:
    """The horizon only spreads a draft catch-up; where the draft reads no more than what every
    speculative step leaves it (2R), the plan is the same whatever the remaining tokens and the batch
    the waiting requests would make (the planner then skips the plans that price them)."""
    rng = np.random.default_rng(seed)
    planner = AdaptivePlanner(cpu_like_cost(), K)
    warm(planner, rng, 4)
    for r in (1, 4, 16):
        p = rng.uniform(0.5, 0.95, size=K)
        for feed in (None, r, 2 * r):
            plain = planner.choose_draft_depth(r, p, draft_feed_tokens=feed)
            plan = (plain, planner.threshold, planner.expected_seconds, planner.expected_tokens)
            planner.choose_draft_depth(r, p, draft_feed_tokens=feed, remaining_tokens=64, steady_requests=32)
            after = (planner.depth, planner.threshold, planner.expected_seconds, planner.expected_tokens)
            assert after == plan


def test_reached_acceptance_matches_the_realised_rate_among_reached_slots() -> None:
    """Calibrated drafts whose rows differ in difficulty: deep slots are reached mostly by easy rows, so
    the acceptance among reached slots is above the plain mean prediction; the reach-weighted mean finds it."""
    rng = np.random.default_rng(7)
    n, k = 40_000, 4
    ease = rng.uniform(0.0, 1.0, size=(n, 1))
    p = np.clip(0.3 + 0.65 * ease + rng.normal(0.0, 0.03, size=(n, k)), 0.01, 0.99)
    accepted = rng.uniform(size=(n, k)) < p
    reached = np.concatenate([np.ones((n, 1), bool), np.cumprod(accepted, axis=1)[:, :-1].astype(bool)], 1)
    p[rng.uniform(size=n) < 0.2, 2:] = np.nan  # some rows stopped drafting after two slots
    drafted = np.isfinite(p)
    estimate = reached_acceptance(p)
    for j in range(k):
        on = reached[:, j] & drafted[:, j]
        rate = accepted[on, j].mean()
        se = np.sqrt(rate * (1 - rate) / on.sum())
        assert abs(estimate[j] - rate) < 4 * se, (j, estimate[j], rate)
    assert np.nanmean(p[:, 3]) < accepted[reached[:, 3] & drafted[:, 3], 3].mean() - 0.05  # the naive mean
    assert np.isnan(reached_acceptance(np.full((3, 2), np.nan))).all()
