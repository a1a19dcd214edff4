"""Sampling and lossless speculative verification, free of model code.

Everything here works on float32 probability rows `[N, V]` and per-row uniforms, so each request can draw
its randomness from its own generator while the arithmetic stays batched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specverify.sampling_params import SamplingParams

# Top-p first looks at this many best tokens per row; rows whose mass there stays below top_p fall back
# to a full sort. Exact either way, and cheap for the peaked distributions of real models.
_TOP_P_PROBE = 256


def apply_target_transforms(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Logit bias and banned tokens: transforms of the target that the drafter never sees."""
    if not any(p.alters_target for p in params):
        return logits
    logits = logits.clone()
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            logits[row, token] += bias
        if p.banned_token_ids:
            logits[row, p.banned_token_ids] = float("-inf")
    return logits


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row's request samples from: temperature, then top-k, then top-p.

    Greedy rows (temperature 0) become one-hot on the argmax, so greedy verification is exact match
    under the same rejection rule as sampling.
    """
    logits = logits.float()
    n, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        scaled = _apply_top_k(scaled, top_k)
    probs = torch.softmax(scaled, dim=-1)
    top_p = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_p):
        probs = _apply_top_p(probs, top_p)
    if greedy.any():
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _apply_top_k(scaled: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    k_max = max(top_k)
    kth = torch.topk(scaled, k_max, dim=-1).values
    ks = torch.tensor([k if k else k_max for k in top_k], device=scaled.device)
    threshold = kth.gather(1, (ks - 1)[:, None])
    cut = torch.tensor([k > 0 for k in top_k], device=scaled.device)[:, None] & (scaled < threshold)
    return scaled.masked_fill(cut, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending probability) whose mass reaches top_p."""
    vocab = probs.shape[1]
    limit = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)
    out = probs.clone()
    pending = (limit < 1.0).nonzero().squeeze(1)
    # Look at the best few tokens first and widen only for the rows that need it: a full sort of a
    # 152k vocabulary costs ~50 ms a row, a top-256 a fraction of that, and real rows are peaked.
    for probe in (_TOP_P_PROBE, 16 * _TOP_P_PROBE, vocab):
        if pending.numel() == 0:
            break
        probe = min(probe, vocab)
        values, indices = torch.topk(probs[pending], probe, dim=-1)
        done = (values.sum(dim=-1) >= limit[pending]) | (probe == vocab)
        rows = pending[done]
        if rows.numel():
            v, i = values[done], indices[done]
            # A token stays if the mass strictly before it is below top_p.
            kept = torch.where(torch.cumsum(v, dim=-1) - v < limit[rows, None], v, torch.zeros_like(v))
            out[rows] = torch.zeros_like(out[rows]).scatter_(1, i, kept)
        pending = pending[~done]
    return out / out.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row; tokens of probability 0 are never drawn."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniforms.double().to(probs.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[1] - 1)


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_verified: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative verification for a batch of requests.

    draft_tokens [R, D]; draft_probs [R, D, V] (the distributions the drafts were drawn from);
    target_probs [R, D + 1, V] (row j is the target at the position of draft j, row n the bonus position);
    num_verified [R] slots verified per request (a prefix, n <= D); uniforms [R, D] and [R].
    Returns (num_accepted [R], final_token [R]): the request keeps drafts[:a] then final_token, drawn from
    the residual max(p - q, 0) at the first rejection, or from the target itself after n accepted drafts.
    """
    r_count, depth = draft_tokens.shape
    rows = torch.arange(r_count, device=draft_tokens.device)
    if depth:
        index = draft_tokens[:, :, None]
        p_tok = target_probs[:, :depth].gather(2, index).squeeze(2)
        q_tok = draft_probs.gather(2, index).squeeze(2)
        # Accept with probability min(1, p/q); written as a product so q = 0 never divides.
        accepted = accept_uniforms * q_tok < p_tok
        slots = torch.arange(depth, device=draft_tokens.device)[None, :]
        accepted &= slots < num_verified[:, None]
        num_accepted = torch.cumprod(accepted.int(), dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(r_count, dtype=torch.long, device=draft_tokens.device)
    p_final = target_probs[rows, num_accepted]
    rejected = num_accepted < num_verified
    if depth and rejected.any():
        q_at = draft_probs[rows, num_accepted.clamp(max=depth - 1)]
        residual = (p_final - q_at).clamp_(min=0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # Float round-off can leave no residual mass when p and q nearly agree; p itself is then exact
        # to that precision.
        residual = torch.where(mass > 0, residual, p_final)
        p_final = torch.where(rejected[:, None], residual, p_final)
    return num_accepted, sample(p_final, final_uniforms)
