"""The KV budget, chunked prefill and preemption: memory stays bounded and outputs do not change."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import TEST_DEVICE, TINY_VOCAB
from exact import PROMPT, VOCAB, chi_square_pvalue, exact_distribution, toy_pair

from specverify.config import EngineConfig, SpeculativeConfig
from specverify.engine.kv_budget import GIB
from specverify.engine.llm_engine import LLMEngine, PromptError
from specverify.models.loader import load_runner
from specverify.models.toy import ToyRunner, ToyTokenizer, table_logits
from specverify.sampling_params import SamplingParams

PER_TOKEN = 1024  # bytes the toy runners say a cached token takes


class FeedLog(ToyRunner):
    """A toy runner that records how many tokens each sequence was fed per forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.feeds: list[list[int]] = []

    def forward(self, seq_ids, tokens, num_logits):
        self.feeds.append([len(t) for t in tokens])
        return super().forward(seq_ids, tokens, num_logits)


def make_engine(budget_tokens=None, k=3, vocab=VOCAB, max_prefill_tokens=512, adaptive=False, seed=0):
    target_fn, draft_fn = toy_pair() if vocab == VOCAB else (table_logits(vocab, 1), table_logits(vocab, 2))
    per_token = PER_TOKEN if budget_tokens is not None else 0
    target = FeedLog(vocab, target_fn, kv_bytes_per_token=per_token, device=TEST_DEVICE)
    draft = ToyRunner(vocab, draft_fn, kv_bytes_per_token=per_token, device=TEST_DEVICE) if k else None
    spec = SpeculativeConfig(num_speculative_tokens=k, enable_adaptive_verification=adaptive) if k else None
    memory = None if budget_tokens is None else budget_tokens * 2 * PER_TOKEN / GIB  # both models count
    config = EngineConfig(
        max_num_seqs=16,
        speculative=spec,
        kv_cache_memory=memory,
        max_prefill_tokens=max_prefill_tokens,
        seed=seed,
    )
    return LLMEngine(target, ToyTokenizer(vocab), config, draft=draft), target, draft


def run(engine, prompts, params, check=None):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if check is not None:
            check(engine)
    return [done[i] for i in ids]


def within_budget(engine) -> None:
    assert engine.stats.kv_cache_tokens <= engine.kv.budget_tokens
    held = sum(engine.target.cache_length(r.seq_id) for r in engine.scheduler.running)
    assert held <= engine.kv.budget_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_keeps_memory_bounded_and_outputs_unchanged(temperature) -> None:
    prompts = [[i % VOCAB, (i + 1) % VOCAB] * 6 for i in range(6)]
    params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=4)
    free, _, _ = make_engine(None)
    want = [o.output_token_ids for o in run(free, prompts, params)]
    engine, target, draft = make_engine(budget_tokens=120)
    got = run(engine, prompts, params, check=within_budget)
    assert engine.stats.preemptions > 0
    assert [o.output_token_ids for o in got] == want
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == 40 for o in got)
    assert not target.caches and not draft.caches


def test_a_request_that_cannot_fit_now_waits() -> None:
    engine, _, _ = make_engine(budget_tokens=60)
    for _ in range(3):
        engine.add_request(PROMPT * 10, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1  # 2 x (20 + 4) fit in 60, three do not
    run(engine, [], SamplingParams())
    assert engine.stats.output_tokens == 24


def test_a_prompt_that_can_never_fit_is_refused() -> None:
    engine, _, _ = make_engine(budget_tokens=60)
    with pytest.raises(PromptError, match="KV cache budget"):
        engine.add_request(PROMPT * 30, SamplingParams())
    assert not engine.has_unfinished_requests()


def test_a_request_alone_over_budget_ends_with_length() -> None:
    engine, target, _ = make_engine(budget_tokens=40)
    (out,) = run(engine, [PROMPT * 5], SamplingParams(max_tokens=100, ignore_eos=True), check=within_budget)
    assert out.finish_reason == "length" and 0 < len(out.output_token_ids) < 100
    assert not target.caches


@pytest.mark.parametrize("adaptive", [False, True])
def test_samples_stay_exact_under_forced_preemption(adaptive) -> None:
    target_fn, _ = toy_pair()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)
    engine, _, _ = make_engine(budget_tokens=24, adaptive=adaptive, seed=3)
    counts: Counter = Counter()
    for _ in range(40):
        for out in run(engine, [PROMPT] * 64, params, check=within_budget):
            counts[tuple(out.output_token_ids)] += 1
    assert engine.stats.preemptions > 30
    p = chi_square_pvalue(counts, exact_distribution(target_fn, params, 3))
    assert p > 1e-3, p


def test_long_prompts_are_prefilled_in_chunks_while_others_decode() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1)
    long_prompt = [i % 16 for i in range(100)]
    whole, _, _ = make_engine(vocab=16, max_prefill_tokens=None)
    want = [o.output_token_ids for o in run(whole, [[1, 2], long_prompt], params)]
    engine, target, _ = make_engine(vocab=16, max_prefill_tokens=16)
    first = engine.add_request([1, 2], params)
    engine.step()  # the short request runs
    second = engine.add_request(long_prompt, params)
    grown = []
    while engine.has_unfinished_requests() and target.cache_length(engine.scheduler.running[-1].seq_id) < 99:
        engine.step()
        grown.append(len(engine.scheduler.running[0].output_token_ids))
    assert len(grown) >= 6  # 99 tokens in chunks of at most 16
    assert grown == sorted(grown) and grown[-1] > grown[0]  # the short request decoded all along
    assert max(max(f) for f in target.feeds) <= 16 + 4  # a chunk, or a decode step's K + 1
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[first].output_token_ids, done[second].output_token_ids] == want
    assert engine.stats.profile.bookkeeping >= 0  # steps of prefill chunks alone count their time too


def test_prompt_logprobs_of_a_long_prompt_come_in_bounded_chunks() -> None:
    engine, target, _ = make_engine(vocab=16, max_prefill_tokens=32)
    prompt = [i % 16 for i in range(200)]
    (out,) = run(engine, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert len(out.prompt_logprobs) == 200 and max(max(f) for f in target.feeds) <= 32
    want, _, _ = make_engine(vocab=16, max_prefill_tokens=None)
    (ref,) = run(want, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert [e and next(iter(e.values())).logprob for e in out.prompt_logprobs] == pytest.approx(
        [e and next(iter(e.values())).logprob for e in ref.prompt_logprobs]
    )


def test_chunked_prefill_logits_equal_one_shot(tiny_hf, device) -> None:
    """fp32: the same logits up to the matmuls' blocking (1e-5), chunked or at once."""
    directory, _ = tiny_hf("qwen2")
    runner, _ = load_runner(directory, dtype="float32", device=device, max_model_len=256, progress=False)
    ids = torch.randint(0, TINY_VOCAB, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = runner.forward([0], [ids], [1])
    runner.reserve(1, 200)
    for begin in range(0, 199, 48):
        runner.forward([1], [ids[begin : min(begin + 48, 199)]], [0])
    chunked = runner.forward([1], [ids[199:]], [1])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-4)


def test_real_runner_caches_never_exceed_what_the_budget_counts(tiny_hf, monkeypatch, device) -> None:
    from specverify.models import llama

    monkeypatch.setattr(llama, "KV_BLOCK_TOKENS", 32)  # blocks small enough for the tiny model's 256
    directory, _ = tiny_hf("qwen2")
    target, _ = load_runner(directory, dtype="float32", device=device, max_model_len=256, progress=False)
    target.kv_block_tokens = 32
    per_token = target.kv_bytes_per_token
    assert per_token == 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head_dim 16, float32
    budget_tokens = 400
    config = EngineConfig(max_num_seqs=8, kv_cache_memory=budget_tokens * per_token / GIB)
    engine = LLMEngine(target, ToyTokenizer(TINY_VOCAB), config)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_VOCAB, (100,), generator=gen).tolist() for _ in range(5)]

    def check(engine) -> None:
        within_budget(engine)
        assert target.cache_bytes() <= engine.kv.budget_bytes

    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    outs = run(engine, prompts, params, check)
    assert engine.stats.preemptions > 0 and all(len(o.output_token_ids) == 100 for o in outs)
    assert target.num_sequences == 0
    free = LLMEngine(target, ToyTokenizer(TINY_VOCAB), EngineConfig(max_num_seqs=8, kv_cache_memory=1.0))
    assert [o.output_token_ids for o in run(free, prompts, params)] == [o.output_token_ids for o in outs]
