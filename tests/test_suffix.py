"""The suffix drafter: its counts and distribution, its shared cache, exactness through the engine, configs."""

import math

import pytest
from exact import VOCAB, chi_square_pvalue, exact_distribution, sample_engine, toy_pair
from test_adaptive_exact import DraftAllPlanner, cost_model

from specverify.config import ConfigError, EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine
from specverify.models.toy import ToyRunner, ToyTokenizer
from specverify.sampling_params import SamplingParams
from specverify.suffix import (
    LEVELS,
    MAX_SUPPORT,
    SharedSuffixCache,
    SuffixCounts,
    SuffixStream,
    suffix_distribution,
)

N = 6000
LENGTH = 4
ALPHA = 1e-3
# After (0, 1) the prompt went on with 2 twice, 3 once, 4 once: drafts keep several tokens, and the
# output's own tokens keep changing the counts as it grows.
PROMPT = [0, 1, 2, 0, 1, 3, 0, 1, 2, 0, 1, 4, 0, 1]


def stream_of(tokens) -> SuffixStream:
    s = SuffixStream()
    s.extend(tokens)
    return s


# ---- counts and distribution ---------------------------------------------------------------------------


def test_distribution_counts_the_continuations_of_the_matching_contexts() -> None:
    s = stream_of(PROMPT)
    d = suffix_distribution(s.tokens, [s.counts])
    assert d.tokens == [2, 3, 4]
    assert d.probs[0] > d.probs[1] == pytest.approx(d.probs[2])  # 2 was seen twice after (.., 0, 1)
    assert sum(d.probs) == pytest.approx(1.0)
    assert d.match_length == 2  # (0, 1) recurs; (4, 0, 1) does not
    assert d.count_total == 4  # 2, 3, 2, 4 followed (0, 1)
    assert 0.0 < d.qmax < 1.0 and math.isfinite(d.feature)


def test_nothing_matches_where_the_last_token_never_recurred() -> None:
    s = stream_of([5, 6, 7, 8])
    d = suffix_distribution(s.tokens, [s.counts])
    assert d.tokens == [] and d.match_length == 0 and math.isnan(d.feature)


def test_confidence_grows_with_the_match_length_and_the_counts() -> None:
    motif = list(range(10, 50))
    short = stream_of([1, 2, 9, 1])  # "1" recurred once, followed by 2
    long_ = stream_of(motif + motif[:-1])  # a 39-token context recurred
    twice = stream_of(motif + motif + motif[:-1])
    features = [suffix_distribution(s.tokens, [s.counts]).feature for s in (short, long_, twice)]
    assert features[0] < features[1] < features[2]
    d = suffix_distribution(long_.tokens, [long_.counts])
    assert d.tokens == [motif[-1]] and d.probs == [1.0] and d.match_length == LEVELS[-1]


def test_the_stream_reads_only_what_it_is_given_and_drafts_leave_no_trace() -> None:
    s = stream_of(PROMPT)
    before = [dict((k, dict(v)) for k, v in t.items()) for t in s.counts.tables]
    # Drafting looks at the context plus drafted tokens without reading them.
    suffix_distribution(s.tokens + [2, 0, 1], [s.counts])
    assert [dict((k, dict(v)) for k, v in t.items()) for t in s.counts.tables] == before
    # The accepted tokens arrive with the request's tokens: the counts move to include them.
    s.sync(PROMPT + [3, 0, 1])
    assert s.tokens == PROMPT + [3, 0, 1]
    after_01 = s.counts.tables[LEVELS.index(2)][hash((0, 1))]
    assert after_01 == {2: 2, 3: 2, 4: 1}  # the accepted 3 now follows (0, 1) twice
    # Reading the same text afresh gives the same counts as reading it in pieces.
    assert s.counts.tables == stream_of(PROMPT + [3, 0, 1]).counts.tables


def test_the_drawn_distribution_keeps_the_heaviest_tokens_only() -> None:
    tokens = []
    for t in range(100, 100 + 3 * MAX_SUPPORT):
        tokens += [7, t]
    s = stream_of(tokens + [7])
    d = suffix_distribution(s.tokens, [s.counts])
    assert len(d.tokens) == MAX_SUPPORT and d.tokens == sorted(d.tokens)
    assert sum(d.probs) == pytest.approx(1.0)


def test_shared_counts_add_to_the_requests_own() -> None:
    own = stream_of([1, 2, 3, 1])
    shared = SharedSuffixCache(100)
    shared.add([1, 4, 1, 4])
    d = suffix_distribution(own.tokens, [own.counts, shared.counts])
    assert d.tokens == [2, 4]
    assert d.probs[1] > d.probs[0]  # 4 followed 1 twice in the cache, 2 once in the request
    alone = suffix_distribution([9, 1], [SuffixCounts(), shared.counts])
    assert alone.tokens == [4]


def test_the_shared_cache_evicts_oldest_streams_first_within_its_bound() -> None:
    cache = SharedSuffixCache(10)
    cache.add([1, 2, 3, 4])
    cache.add([5, 6, 7, 8])
    assert cache.num_tokens == 8
    cache.add([9, 10, 11])  # 11 tokens would not fit: the oldest stream goes
    assert cache.num_tokens == 7 and list(cache.streams) == [[5, 6, 7, 8], [9, 10, 11]]
    assert suffix_distribution([1], [cache.counts]).tokens == []  # its counts went with it
    assert suffix_distribution([5], [cache.counts]).tokens == [6]
    # Evicting everything leaves empty tables: uncounting is exact.
    cache.add(list(range(20, 40)))
    assert cache.num_tokens == 10 and list(cache.streams) == [list(range(30, 40))]
    fresh = SuffixCounts()
    fresh.add(list(range(30, 40)))
    assert cache.counts.tables == fresh.tables
    with pytest.raises(ValueError):
        SharedSuffixCache(-1)


# ---- exactness through the whole engine ------------------------------------------------------------------


def _spec(adaptive: bool, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=k,
        enable_adaptive_verification=adaptive,
        suffix_cache_tokens=64,
    )


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.85)],
    ids=["T1", "top-p"],
)
def test_suffix_drafts_keep_the_target_distribution(adaptive: bool, params, monkeypatch) -> None:
    target_fn, _ = toy_pair()
    extra = {}
    if adaptive:
        import specverify.planner

        # The real admission rule with a threshold that trims at this pair's acceptance.
        monkeypatch.setattr(specverify.planner, "AdaptivePlanner", DraftAllPlanner)
        extra["cost_model"] = cost_model(0.004)
    counts, engine = sample_engine(
        target_fn, None, params, _spec(adaptive), N, LENGTH, seed=3, prompt=PROMPT, **extra
    )
    stats = engine.stats
    assert stats.drafted_tokens > N  # the drafter really drafted
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    if adaptive:
        assert stats.verified_tokens < stats.drafted_tokens  # and the planner really trimmed
    p = chi_square_pvalue(counts, exact_distribution(target_fn, params, LENGTH, prompt=PROMPT))
    assert p > ALPHA, f"suffix drafts changed the output distribution (p = {p:.2e})"


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_suffix_speculation_is_the_greedy_continuation(adaptive: bool) -> None:
    target_fn, _ = toy_pair()
    greedy = SamplingParams(temperature=0.0)
    plain, _ = sample_engine(target_fn, None, greedy, None, 4, 12, prompt=PROMPT)
    extra = {"cost_model": cost_model(0.004)} if adaptive else {}
    spec = _spec(adaptive, k=16)
    fast, engine = sample_engine(target_fn, None, greedy, spec, 4, 12, prompt=PROMPT, **extra)
    assert fast == plain
    assert engine.stats.accepted_tokens > 0


def test_the_suffix_drafter_costs_no_draft_model_and_names_its_estimator(tmp_path, device) -> None:
    target_fn, _ = toy_pair()
    counts, engine = sample_engine(
        target_fn, None, SamplingParams(temperature=1.0), _spec(False), 40, LENGTH, prompt=PROMPT
    )
    assert engine.draft is None and engine.drafter == "suffix"
    assert not engine.suffix.streams  # every finished request's stream is gone ...
    assert 0 < engine.suffix.shared.num_tokens <= 64  # ... its output in the bounded shared cache
    state = engine.estimator_state()
    assert state["drafter"] == "suffix" and state["feature"].startswith("suffix")
    assert engine.estimator.n_observed_ > 0
    # A draft model's estimator state cannot warm a suffix engine, nor the other way round.
    draft_engine = LLMEngine(
        ToyRunner(VOCAB, target_fn, device=device),
        ToyTokenizer(VOCAB),
        draft=ToyRunner(VOCAB, target_fn, device=device),
        config=EngineConfig(speculative=SpeculativeConfig(num_speculative_tokens=3)),
    )
    with pytest.raises(ConfigError, match="each drafter needs its own"):
        draft_engine.load_estimator_dict(state)
    with pytest.raises(ConfigError, match="each drafter needs its own"):
        engine.load_estimator_dict(draft_engine.estimator_state())


def test_requests_without_any_match_decode_plainly_and_still_finish() -> None:
    target_fn, _ = toy_pair()
    # A prompt whose tokens never recur: the first slots find nothing to draft.
    counts, engine = sample_engine(
        target_fn,
        None,
        SamplingParams(temperature=1.0),
        _spec(True),
        8,
        6,
        prompt=[0, 1, 2, 3, 4],
        cost_model=cost_model(0.004),
    )
    assert sum(counts.values()) == 8


# ---- configuration ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, error",
    [
        ({"method": "suffix", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "suffix", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "suffix", "suffix_cache_tokens": -5}, "suffix_cache_tokens"),
        ({"method": "suffix", "suffix_cache_tokens": "lots"}, "suffix_cache_tokens"),
        ({"method": "suffix", "model": "draft.gguf"}, "apply to method 'draft_model' only"),
        ({"method": "suffix", "draft_vocab_size": 4096}, "apply to method 'draft_model' only"),
        ({"method": "draft_model", "suffix_cache_tokens": 10}, "apply to method 'suffix' only"),
        ({"method": "suffix", "max_match": 8}, "unknown speculative config keys"),
        ({"method": "ngram"}, "not supported"),
    ],
)
def test_bad_suffix_configs_are_refused(config, error) -> None:
    with pytest.raises(ConfigError, match=error):
        SpeculativeConfig.from_any(config)


def test_deep_suffix_drafts_are_accepted() -> None:
    spec = SpeculativeConfig.from_any({"method": "suffix", "num_speculative_tokens": 16})
    assert spec.num_speculative_tokens == 16 and spec.method == "suffix"
