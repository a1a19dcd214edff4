"""Shared machinery for exact-distribution tests: run the engine on toy models, compare with the truth."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import torch
from conftest import TEST_DEVICE
from scipy import stats

from specverify.config import EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine
from specverify.models.toy import ToyRunner, ToyTokenizer, table_logits
from specverify.sampling_params import SamplingParams

VOCAB = 5
PROMPT = [0, 1]


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """Float64 restatement of temperature / top-k / top-p, written independently of the sampler."""
    x = logits.double().numpy()
    if params.temperature == 0:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out
    x = x / params.temperature
    if params.top_k:
        x = np.where(x >= np.sort(x)[-params.top_k], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < params.top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def exact_distribution(
    logits_fn, params: SamplingParams, length: int, prompt: list[int] = PROMPT
) -> dict[tuple[int, ...], float]:
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        context, total = tuple(prompt), 1.0
        for token in seq:
            total *= reference_probs(logits_fn(context), params)[token]
            context += (token,)
        probs[seq] = total
    return probs


def toy_pair(target_seed: int = 1, draft_seed: int = 2, draft_noise: float = 1.0):
    """A target and a draft that agrees with it only partly, so both acceptance and rejection happen."""
    target_fn = table_logits(VOCAB, target_seed, sharpness=1.5)
    noise_fn = table_logits(VOCAB, draft_seed, sharpness=1.5)

    def draft_fn(context):
        return target_fn(context) + draft_noise * noise_fn(context)

    return target_fn, draft_fn


def sample_engine(
    target_fn,
    draft_fn,
    params: SamplingParams,
    spec: SpeculativeConfig | None,
    n: int,
    length: int,
    seed: int = 0,
    prompt: list[int] = PROMPT,
    **engine_kwargs,
) -> tuple[Counter, LLMEngine]:
    """`n` samples of `length` tokens after `prompt`; `draft_fn` None: no draft model (a suffix spec)."""
    target = ToyRunner(VOCAB, target_fn, device=TEST_DEVICE)
    draft = (
        ToyRunner(VOCAB, draft_fn, device=TEST_DEVICE) if spec is not None and draft_fn is not None else None
    )
    config = EngineConfig(max_num_seqs=64, seed=seed, speculative=spec)
    engine = LLMEngine(target, ToyTokenizer(VOCAB), config, draft=draft, **engine_kwargs)
    run_params = SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=length,
        ignore_eos=True,
    )
    for _ in range(n):
        engine.add_request(prompt, run_params)
    counts: Counter = Counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert len(out.output_token_ids) == length
                counts[tuple(out.output_token_ids)] += 1
    # Every cache must be released once its request is done.
    assert not target.caches and (draft is None or not draft.caches)
    return counts, engine


def chi_square_pvalue(counts: Counter, expected: dict[tuple[int, ...], float]) -> float:
    """Pearson chi-square goodness of fit; sparse outcomes are pooled so every cell expects >= 5."""
    n = sum(counts.values())
    cells = sorted(expected, key=expected.get, reverse=True)
    observed, wanted, pool_o, pool_e = [], [], 0, 0.0
    for cell in cells:
        e = expected[cell] * n
        if e >= 5:
            observed.append(counts.get(cell, 0))
            wanted.append(e)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += e
    if pool_e > 0:
        observed.append(pool_o)
        wanted.append(pool_e)
    assert sum(observed) == n, "sampled a sequence of probability 0"
    return float(stats.chisquare(observed, np.array(wanted) * n / sum(wanted)).pvalue)
