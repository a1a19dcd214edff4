"""Adaptive verification stays lossless (DESIGN.md §5): chi-square against the exact target distribution.

The draft here is built so that its confidence at slot k + 1 depends strongly on the token it drew at
slot k. A planner that lets slot k's verification depend on slot k + 1 (a budget from this step's own
later survivals) then biases the output, and the negative control shows the test catches exactly that.
"""

import numpy as np
import pytest
import torch
from exact import VOCAB, chi_square_pvalue, exact_distribution, sample_engine, table_logits

from specverify.config import SpeculativeConfig
from specverify.cost_model import CostModel
from specverify.planner import AdaptivePlanner
from specverify.sampling_params import SamplingParams

N = 6000
LENGTH = 3
ALPHA = 1e-3


def telltale_pair():
    """After token 0 both models are sharp and agree (drafts sure and accepted); elsewhere the draft is
    unsure and often wrong. So the draft's confidence at slot k + 1 reveals whether it drew 0 at slot k."""
    table = table_logits(VOCAB, 1, sharpness=1.5)
    noise = table_logits(VOCAB, 2, sharpness=1.5)

    def target_fn(context):
        return table(context) * (3.0 if context[-1] == 0 else 1.0)

    def draft_fn(context):
        if context[-1] == 0:
            return target_fn(context)
        return 0.5 * (target_fn(context) + noise(context))

    return target_fn, draft_fn


def cost_model(per_token: float) -> CostModel:
    """Verification cost grows with the tokens verified, so the planner must trim (synthetic profile)."""
    tokens = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    batches = np.array([1, 2, 4, 8, 16, 32, 64])
    # Frozen (no online refinement): the toy models' real step times are meaningless here. Zero rates
    # alone no longer freeze it (levels start as running means over the profile's weight, and the
    # machine drift has a rate of its own), so the profile weighs as much as a billion observations.
    return CostModel(
        tokens,
        1.0 + per_token * tokens,
        batches,
        0.02 + 0.001 * batches,
        alpha_global=0.0,
        alpha_bucket=0.0,
        alpha_drift=0.0,
        profile_weight=1e9,
        fit_context=False,
    )


SPEC = SpeculativeConfig(num_speculative_tokens=3, enable_adaptive_verification=True)


class DraftAllPlanner(AdaptivePlanner):
    """The real admission rule with a threshold fixed in advance; every request drafts all K slots, so
    admission (not early stopping) is what trims."""

    def choose_draft_depth(self, num_requests, expected_p=None, context_tokens=0, **feeds):
        return self.k

    def should_continue(self, survival_so_far, depth_done, *args, **kwargs):
        return np.ones(np.size(survival_so_far), dtype=bool)

    def admit(self, survival, threshold=None):
        return super().admit(survival, threshold=0.35)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.85)]
)
def test_adaptive_verification_matches_target_distribution(params: SamplingParams) -> None:
    target_fn, draft_fn = telltale_pair()
    counts, engine = sample_engine(target_fn, draft_fn, params, SPEC, N, LENGTH, cost_model=cost_model(0.002))
    s = engine.stats
    assert 0 < s.accepted_tokens < s.verified_tokens <= s.drafted_tokens
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) > ALPHA


def test_admission_that_trims_drafts_matches_target_distribution(monkeypatch) -> None:
    import specverify.planner

    monkeypatch.setattr(specverify.planner, "AdaptivePlanner", DraftAllPlanner)
    params = SamplingParams(temperature=1.0)
    target_fn, draft_fn = telltale_pair()
    counts, engine = sample_engine(target_fn, draft_fn, params, SPEC, N, LENGTH, cost_model=cost_model(0.004))
    s = engine.stats
    # Admission must really trim: some drafts verified, some drafted but left unverified.
    assert 0 < s.accepted_tokens < s.verified_tokens < s.drafted_tokens
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) > ALPHA


def test_expensive_verification_turns_speculation_off_and_stays_exact() -> None:
    params = SamplingParams(temperature=1.0)
    target_fn, draft_fn = telltale_pair()
    counts, engine = sample_engine(
        target_fn, draft_fn, params, SPEC, 2000, LENGTH, cost_model=cost_model(5.0)
    )
    # Past the estimator's warm-up only rare probe steps draft at all.
    assert 0 < engine.stats.verified_tokens < 0.1 * engine.stats.output_tokens
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) > ALPHA


class PeekingPlanner(AdaptivePlanner):
    """Broken on purpose: verifies slot k only when slot k + 1 looks promising (depends on the token at k)."""

    def choose_draft_depth(self, num_requests, expected_p=None, context_tokens=0, **feeds):
        return self.k

    def should_continue(self, survival_so_far, depth_done, *args, **kwargs):
        return np.ones(np.size(survival_so_far), dtype=bool)

    def admit(self, survival, threshold=None):
        s = np.asarray(survival)
        conditional = s[:, 1:] / np.maximum(s[:, :-1], 1e-12)  # p at slot k + 1
        ok = conditional >= 0.6
        return np.cumprod(ok, axis=1).sum(axis=1)


def test_chi_square_catches_a_budget_that_peeks_at_later_drafts(monkeypatch) -> None:
    import specverify.planner

    monkeypatch.setattr(specverify.planner, "AdaptivePlanner", PeekingPlanner)
    params = SamplingParams(temperature=1.0)
    target_fn, draft_fn = telltale_pair()
    counts, engine = sample_engine(target_fn, draft_fn, params, SPEC, N, LENGTH, cost_model=cost_model(0.005))
    assert isinstance(engine.planner, PeekingPlanner)
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) < 1e-6


def test_draft_confidence_really_depends_on_the_previous_token() -> None:
    _, draft_fn = telltale_pair()
    after_0 = [float(torch.softmax(draft_fn((a, 0)), -1).max()) for a in range(VOCAB)]
    after_other = [float(torch.softmax(draft_fn((0, b)), -1).max()) for b in range(1, VOCAB)]
    assert sum(after_0) / len(after_0) > 0.7 > 0.45 > max(after_other)
