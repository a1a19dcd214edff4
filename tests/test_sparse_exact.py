"""The sparse sampling path stays exact on a vocabulary wider than its probe, in mixed batches.

A 160-token toy pair, so top-p rows keep more tokens than the sampler's first probe (64) and must widen;
one engine serves, in the same batches, requests with top-p 0.95, no cut at all (the whole vocabulary),
top-k wider than the probe, and greedy ones. Each sampled group's three-token outputs, binned by token id,
are tested by chi-square against the exact target distribution computed independently in float64.
"""

from collections import Counter

import numpy as np
import pytest
from exact import chi_square_pvalue, reference_probs
from test_adaptive_exact import DraftAllPlanner, cost_model

from specverify.config import EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine
from specverify.models.toy import ToyRunner, ToyTokenizer, table_logits
from specverify.sampling_params import SamplingParams

VOCAB = 160
PROMPT = [3, 7]
LENGTH = 3
BIN = 40  # tokens 0-39 are bin 0, ...: 4 x 4 x 4 cells for three tokens
N = 3000
ALPHA = 1e-3

GROUPS = {
    "top-p-0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "whole-vocabulary": SamplingParams(temperature=0.9),
    "top-k-100-top-p-0.9": SamplingParams(temperature=1.0, top_k=100, top_p=0.9),
}


class TrimmingPlanner(DraftAllPlanner):
    """Drafts all K slots and admits by a fixed threshold that trims at this pair's acceptance."""

    def admit(self, survival, threshold=None):
        return super(DraftAllPlanner, self).admit(survival, threshold=0.6)


def wide_pair():
    target_fn = table_logits(VOCAB, 11, sharpness=1.0)
    noise_fn = table_logits(VOCAB, 12, sharpness=1.0)
    return target_fn, lambda context: target_fn(context) + 0.7 * noise_fn(context)


def binned_truth(target_fn, params: SamplingParams) -> dict[tuple[int, ...], float]:
    bins = VOCAB // BIN
    out = np.zeros((bins, bins, bins))
    first = reference_probs(target_fn(tuple(PROMPT)), params)
    for t1 in np.flatnonzero(first):
        second = reference_probs(target_fn((*PROMPT, int(t1))), params)
        for t2 in np.flatnonzero(second):
            third = reference_probs(target_fn((*PROMPT, int(t1), int(t2))), params)
            out[t1 // BIN, t2 // BIN] += first[t1] * second[t2] * third.reshape(bins, BIN).sum(axis=1)
    return {cell: float(out[cell]) for cell in np.ndindex(out.shape)}


@pytest.mark.parametrize("adaptive", [False, True])
def test_mixed_wide_batches_match_the_target(adaptive: bool, monkeypatch, device) -> None:
    target_fn, draft_fn = wide_pair()
    spec = SpeculativeConfig(num_speculative_tokens=2, enable_adaptive_verification=adaptive)
    extra = {}
    if adaptive:
        import specverify.planner

        monkeypatch.setattr(specverify.planner, "AdaptivePlanner", TrimmingPlanner)
        extra["cost_model"] = cost_model(0.004)
    engine = LLMEngine(
        ToyRunner(VOCAB, target_fn, device=device),
        ToyTokenizer(VOCAB),
        EngineConfig(max_num_seqs=64, seed=5, speculative=spec),
        draft=ToyRunner(VOCAB, draft_fn, device=device),
        **extra,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True)
    names = [*GROUPS, "greedy"]
    owner = {}
    for i in range(N):
        for name in names:
            p = GROUPS.get(name)
            params = (
                greedy
                if p is None
                else SamplingParams(
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    max_tokens=LENGTH,
                    ignore_eos=True,
                )
            )
            if name == "greedy" and i >= 50:
                continue
            owner[engine.add_request(PROMPT, params)] = name
    counts = {name: Counter() for name in [*names, "greedy-tokens", "all"]}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = tuple(out.output_token_ids)
                counts[owner[out.request_id]][tuple(t // BIN for t in tokens)] += 1
                counts["greedy-tokens" if owner[out.request_id] == "greedy" else "all"][tokens] += 1
    s = engine.stats
    assert 0 < s.accepted_tokens < s.verified_tokens
    if adaptive:
        assert s.verified_tokens < s.drafted_tokens  # admission really trimmed
    for name, params in GROUPS.items():
        assert chi_square_pvalue(counts[name], binned_truth(target_fn, params)) > ALPHA, name
    # Greedy rows in the same batches: always the argmax continuation.
    context = list(PROMPT)
    for _ in range(LENGTH):
        context.append(int(target_fn(tuple(context)).argmax()))
    assert set(counts["greedy-tokens"]) == {tuple(context[len(PROMPT) :])}


def test_the_wide_rows_really_widen() -> None:
    from specverify import sampler

    target_fn, _ = wide_pair()
    rows = sampler.probabilities(target_fn(tuple(PROMPT))[None, :], [GROUPS["top-p-0.95"]])
    assert rows.counts()[0] > 64
