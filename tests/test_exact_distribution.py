"""Speculative sampling must reproduce the target's distribution exactly (DESIGN.md §5).

Toy models with a 5-token vocabulary; every 3-token continuation is a cell of a chi-square test against
the exact target distribution computed independently in float64. A negative control shows the test has
the power to catch a biased verifier.
"""

import pytest
from exact import chi_square_pvalue, exact_distribution, sample_engine, toy_pair

from specverify import sampler
from specverify.config import SpeculativeConfig
from specverify.sampling_params import SamplingParams

N = 6000
LENGTH = 3
ALPHA = 1e-3

CASES = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.7-top-p-0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "temperature-1.3-top-k-3-top-p-0.9": SamplingParams(temperature=1.3, top_k=3, top_p=0.9),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("k", [2, 4])
def test_fixed_k_matches_target_distribution(name: str, k: int) -> None:
    params = CASES[name]
    target_fn, draft_fn = toy_pair()
    counts, engine = sample_engine(
        target_fn, draft_fn, params, SpeculativeConfig(num_speculative_tokens=k), N, LENGTH
    )
    stats = engine.stats
    # The drafts must really be put to the test: some accepted, some rejected.
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) > ALPHA


def test_no_speculation_matches_target_distribution() -> None:
    params = CASES["temperature-0.7-top-p-0.8"]
    target_fn, draft_fn = toy_pair()
    counts, _ = sample_engine(target_fn, draft_fn, params, None, N, LENGTH)
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) > ALPHA


def test_greedy_speculation_is_the_greedy_continuation() -> None:
    params = SamplingParams(temperature=0.0)
    target_fn, draft_fn = toy_pair()
    counts, engine = sample_engine(
        target_fn, draft_fn, params, SpeculativeConfig(num_speculative_tokens=3), 50, 6
    )
    plain, _ = sample_engine(target_fn, draft_fn, params, None, 5, 6)
    assert len(counts) == 1 and set(counts) == set(plain)
    assert engine.stats.verified_tokens > engine.stats.accepted_tokens > 0


def test_chi_square_catches_a_biased_verifier(monkeypatch) -> None:
    """Negative control: a verifier that accepts every draft samples the draft, and the test must say so."""
    params = CASES["temperature-1"]
    target_fn, draft_fn = toy_pair()
    real_verify = sampler.verify

    def accept_all(draft_tokens, draft, draft_row, target, target_row, num_verified, accept_u, final_u):
        return real_verify(
            draft_tokens, draft, draft_row, target, target_row, num_verified, accept_u * 0.0, final_u
        )

    monkeypatch.setattr(sampler, "verify", accept_all)
    counts, _ = sample_engine(
        target_fn, draft_fn, params, SpeculativeConfig(num_speculative_tokens=2), N, LENGTH
    )
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) < 1e-6


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_draft_restricted_to_part_of_the_vocabulary_stays_exact(adaptive: bool, monkeypatch) -> None:
    """A draft LM head over a token subset (draft_vocab_size) proposes only those tokens; the target's
    tokens outside it come from corrections and bonus tokens, and the output is still the target's."""
    import exact

    from specverify.models.toy import ToyRunner

    params = CASES["temperature-0.7-top-p-0.8"]
    target_fn, draft_fn = toy_pair()

    class RestrictedDraft(ToyRunner):
        def __init__(self, vocab_size, logits_fn, **kwargs):
            super().__init__(vocab_size, logits_fn, **kwargs)
            if logits_fn is draft_fn:
                self.restrict_logits([0, 2, 3])

    monkeypatch.setattr(exact, "ToyRunner", RestrictedDraft)
    spec = SpeculativeConfig(num_speculative_tokens=3, enable_adaptive_verification=adaptive)
    counts, engine = sample_engine(target_fn, draft_fn, params, spec, N, LENGTH)
    assert engine.draft.logit_token_ids.tolist() == [0, 2, 3]
    assert 0 < engine.stats.accepted_tokens < engine.stats.verified_tokens
    assert {1, 4} & {t for seq in counts for t in seq}  # tokens the draft cannot propose still come
    assert chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH)) > ALPHA
