"""Log-probabilities and several samples per prompt, on toy models whose distributions are known exactly."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE
from exact import PROMPT, VOCAB, chi_square_pvalue, exact_distribution, reference_probs, toy_pair

from specverify.config import ConfigError, EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine
from specverify.logprobs import token_logprobs
from specverify.models.toy import ToyRunner, ToyTokenizer, table_logits
from specverify.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams

SPECS = {
    "plain": None,
    "fixed": SpeculativeConfig(num_speculative_tokens=3),
    "adaptive": SpeculativeConfig(num_speculative_tokens=3, enable_adaptive_verification=True),
    "suffix": SpeculativeConfig(method="suffix", num_speculative_tokens=4),
}


def make_engine(spec, mode="raw_logprobs", vocab=VOCAB, max_num_seqs=16, seed=0):
    target_fn, draft_fn = toy_pair() if vocab == VOCAB else (table_logits(vocab, 1), table_logits(vocab, 2))
    target = ToyRunner(vocab, target_fn, device=TEST_DEVICE)
    draft = (
        ToyRunner(vocab, draft_fn, device=TEST_DEVICE)
        if spec is not None and spec.method == "draft_model"
        else None
    )
    config = EngineConfig(max_num_seqs=max_num_seqs, speculative=spec, logprobs_mode=mode, seed=seed)
    return LLMEngine(target, ToyTokenizer(vocab), config, draft=draft), target, draft


def run(engine, prompt, params, request_id=None):
    rid = engine.add_request(prompt, params, request_id)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished and o.group_id == rid]
    return sorted(outs, key=lambda o: o.index)


def truth(target_fn, context, params=None) -> np.ndarray:
    """The target's log-distribution at `context`: raw (params None) or the one sampled from."""
    logits = target_fn(tuple(context))
    if params is None:
        return torch.log_softmax(logits.double(), 0).numpy()
    if params.temperature == 0:
        return torch.log_softmax(logits.double(), 0).numpy()
    with np.errstate(divide="ignore"):
        return np.log(reference_probs(logits, params))


def check_entries(entries, tokens, contexts, target_fn, top_n, params=None):
    assert len(entries) == len(tokens) == len(contexts)
    for entry, token, context in zip(entries, tokens, contexts, strict=True):
        want = truth(target_fn, context, params)
        assert next(iter(entry)) == token  # the chosen token comes first
        assert entry[token].logprob == pytest.approx(want[token], abs=1e-5)
        assert entry[token].rank == 1 + int((want > want[token] + 1e-9).sum())
        best = np.argsort(-want, kind="stable")[:top_n]
        alternatives = [t for t, e in entry.items() if e.rank <= top_n]
        assert sorted(alternatives) == sorted(best.tolist())
        for t in best:
            assert entry[int(t)].logprob == pytest.approx(want[t], abs=1e-5)
            assert entry[int(t)].decoded_token == f"t{t}"


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_output_logprobs_are_the_targets_whatever_the_step(name, temperature) -> None:
    engine, target, _ = make_engine(SPECS[name])
    target_fn = target.logits_fn
    params = SamplingParams(temperature=temperature, max_tokens=24, logprobs=2, ignore_eos=True, seed=3)
    (out,) = run(engine, PROMPT * 3, params)
    context = PROMPT * 3 + out.output_token_ids
    contexts = [context[: len(PROMPT) * 3 + j] for j in range(len(out.output_token_ids))]
    check_entries(out.logprobs, out.output_token_ids, contexts, target_fn, 2)
    if name != "plain":
        assert out.metrics.accepted > 0  # some tokens really came from accepted drafts


def test_processed_logprobs_are_the_sampled_distribution() -> None:
    engine, target, _ = make_engine(SPECS["fixed"], mode="processed_logprobs")
    params = SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, logprobs=3, ignore_eos=True)
    (out,) = run(engine, PROMPT, params)
    context = PROMPT + out.output_token_ids
    contexts = [context[: len(PROMPT) + j] for j in range(len(out.output_token_ids))]
    for entry, token, ctx in zip(out.logprobs, out.output_token_ids, contexts, strict=True):
        want = truth(target.logits_fn, ctx, params)
        assert entry[token].logprob == pytest.approx(want[token], abs=1e-5)
        for t, e in entry.items():
            assert e.logprob == pytest.approx(want[t], abs=1e-5) or (e.logprob == -math.inf == want[t])
    # Top-p cut tokens: -inf; at least one position cut something.
    assert any(e.logprob == -math.inf for entry in out.logprobs for e in entry.values())


def test_processed_greedy_rows_take_no_temperature_and_no_cut() -> None:
    engine, target, _ = make_engine(None, mode="processed_logprobs")
    params = SamplingParams(temperature=0.0, top_p=0.5, max_tokens=4, logprobs=VOCAB, ignore_eos=True)
    (out,) = run(engine, PROMPT, params)
    want = truth(target.logits_fn, PROMPT)
    assert all(math.isfinite(e.logprob) for e in out.logprobs[0].values())
    assert [out.logprobs[0][t].logprob for t in range(VOCAB)] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("spec", ["plain", "fixed"])
def test_prompt_logprobs_score_every_prompt_token_across_chunks(spec) -> None:
    engine, target, draft = make_engine(SPECS[spec], vocab=16)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 16, size=600)]  # three scoring chunks
    params = SamplingParams(temperature=1.0, max_tokens=3, prompt_logprobs=4, logprobs=1, ignore_eos=True)
    (out,) = run(engine, prompt, params)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    contexts = [prompt[:j] for j in range(1, len(prompt))]
    check_entries(out.prompt_logprobs[1:], prompt[1:], contexts, target.logits_fn, 4)
    assert len(out.output_token_ids) == 3 and not target.caches and (draft is None or not draft.caches)


def test_max_tokens_zero_only_scores_the_prompt() -> None:
    engine, target, _ = make_engine(SPECS["fixed"])
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    (out,) = run(engine, PROMPT * 2, params)
    assert out.finished and out.finish_reason == "length" and out.output_token_ids == []
    assert len(out.prompt_logprobs) == 4 and all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert target.tokens_processed == 3  # the prompt but its last token, nothing decoded
    assert not target.caches


def test_logprobs_off_computes_none() -> None:
    engine, _, _ = make_engine(SPECS["fixed"])
    (out,) = run(engine, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    assert out.logprobs is None and out.prompt_logprobs is None


@pytest.mark.parametrize("name", ["plain", "fixed", "suffix"])
def test_n_samples_share_one_prefill(name) -> None:
    engine, target, draft = make_engine(SPECS[name], vocab=16)
    prompt = list(range(16)) * 16
    params = SamplingParams(temperature=1.0, max_tokens=6, n=5, ignore_eos=True, seed=11, prompt_logprobs=1)
    outs = run(engine, prompt, params, request_id="req")
    assert [o.index for o in outs] == list(range(5))
    assert [o.request_id for o in outs] == [f"req-{i}" for i in range(5)]
    assert {o.group_id for o in outs} == {"req"}
    assert all(len(o.output_token_ids) == 6 and o.finish_reason == "length" for o in outs)
    assert len({tuple(o.output_token_ids) for o in outs}) > 1  # independent samples
    assert all(o.prompt_logprobs is outs[0].prompt_logprobs for o in outs)  # scored once
    # The prompt but its last token is fed once; each sample then feeds its last prompt token onwards
    # (plainly: 6 tokens each; with drafts at most 6 (K + 1), far less than a prompt).
    fed_once = len(prompt) - 1
    if name == "plain":
        assert target.tokens_processed == fed_once + 5 * 6
    else:
        assert fed_once + 5 * 6 <= target.tokens_processed < 2 * fed_once
    assert not target.caches and (draft is None or not draft.caches)


def test_sample_zero_draws_as_a_single_request() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=5)
    one = run(make_engine(SPECS["fixed"])[0], PROMPT, params)[0]
    many = run(make_engine(SPECS["fixed"])[0], PROMPT, SamplingParams(**{**params.__dict__, "n": 3}))
    assert many[0].output_token_ids == one.output_token_ids


def test_n_with_fewer_slots_than_samples() -> None:
    engine, target, _ = make_engine(SPECS["fixed"], max_num_seqs=2)
    outs = run(engine, PROMPT, SamplingParams(temperature=1.0, max_tokens=5, n=5, ignore_eos=True))
    assert len(outs) == 5 and all(len(o.output_token_ids) == 5 for o in outs)
    assert not target.caches  # the shared prompt cache too


def test_abort_ends_every_sample_and_frees_the_shared_prompt() -> None:
    engine, target, draft = make_engine(SPECS["fixed"], max_num_seqs=2)
    engine.add_request(PROMPT * 4, SamplingParams(max_tokens=50, n=4, ignore_eos=True), "x")
    engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    assert not target.caches and not draft.caches


@pytest.mark.parametrize("name", ["fixed", "adaptive"])
def test_samples_of_one_prompt_follow_the_target_distribution(name) -> None:
    """Forked caches and per-sample generators: the n samples are exact, independent draws."""
    target_fn, _ = toy_pair()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True, n=MAX_N)
    engine, _, _ = make_engine(SPECS[name], max_num_seqs=64, seed=7)
    counts: Counter = Counter()
    for i in range(150):
        for out in run(engine, PROMPT, params, request_id=f"r{i}"):
            counts[tuple(out.output_token_ids)] += 1
    p = chi_square_pvalue(counts, exact_distribution(target_fn, params, 3))
    assert p > 1e-3, p


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logprobs": -1},
        {"logprobs": MAX_LOGPROBS + 1},
        {"logprobs": 1.5},
        {"prompt_logprobs": MAX_LOGPROBS + 1},
        {"n": 0},
        {"n": MAX_N + 1},
        {"n": True},
        {"max_tokens": -1},
    ],
)
def test_bad_logprob_and_n_values_are_refused(kwargs) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"^{name} must"):
        SamplingParams(**kwargs)


def test_bad_logprobs_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="logprobs_mode"):
        EngineConfig(logprobs_mode="logits")


def test_position_logprobs_rank_and_order() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    want = torch.log_softmax(logits, dim=1)[0]
    (entry,) = token_logprobs(logits, [0], [SamplingParams()], [2], [2], decode=str)
    assert list(entry) == [2, 1, 3]
    assert entry[2].rank == 3 and entry[2].decoded_token == "2"
    assert entry[2].logprob == pytest.approx(float(want[2])) and entry[1].logprob == pytest.approx(
        float(want[1])
    )
    (entry,) = token_logprobs(logits, [0], [SamplingParams()], [1], [3])
    assert list(entry) == [1, 3, 2] and entry[1].rank == 1 and entry[1].decoded_token is None
    with pytest.raises(ValueError, match="logprobs_mode"):
        token_logprobs(logits, [0], [SamplingParams()], [1], [1], mode="logits")


def test_llm_generate_gives_every_sample_and_its_logprobs(device) -> None:
    from specverify.llm import LLM, LoadedModels

    target_fn, draft_fn = toy_pair()
    models = LoadedModels(
        ToyRunner(VOCAB, target_fn, device=device),
        ToyTokenizer(VOCAB),
        ToyRunner(VOCAB, draft_fn, device=device),
        "t",
        "d",
    )
    llm = LLM(speculative_config={"num_speculative_tokens": 3}, models=models)
    params = SamplingParams(
        temperature=1.0, max_tokens=5, n=3, logprobs=1, prompt_logprobs=0, ignore_eos=True
    )
    first, second = llm.generate([PROMPT, PROMPT * 2], params, use_tqdm=False)
    for out, prompt in ((first, PROMPT), (second, PROMPT * 2)):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert out.request_id == out.group_id and out.prompt_token_ids == prompt
        assert out.output_token_ids == out.outputs[0].output_token_ids  # sample 0 stands for the request
        assert all(len(o.logprobs) == 5 for o in out.outputs)
        assert len(out.prompt_logprobs) == len(prompt)
    (single,) = llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(single.outputs) == 1 and single.outputs[0].text == single.text
