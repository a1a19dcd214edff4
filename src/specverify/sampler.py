"""Sampling and lossless speculative verification, free of model code.

Distributions live on their kept support (`sparse.SparseRows`): a row after top-p keeps a handful of
tokens, a greedy row one, so no step builds dense [R, K + 1, V] probability tensors. Each request draws
its randomness from its own generator (one uniform per row); the arithmetic stays batched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specverify.sampling_params import SamplingParams
from specverify.sparse import SparseRows, residual, sample

__all__ = ["SparseRows", "apply_target_transforms", "probabilities", "sample", "verify"]

# Top-k / top-p first look for their kept set among this many best tokens per row, then 16x more each
# time, up to the whole vocabulary. Exact either way, and cheap for the peaked distributions of real models.
_PROBE = 64


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


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> SparseRows:
    """The distribution each row's request samples from: temperature, then top-k, then top-p, on its
    kept support. Greedy rows keep their argmax alone, so greedy verification is exact match under the
    same rejection rule as sampling. `logits` [N, V] is read, never written."""
    n, vocab = logits.shape
    # Supports are found where the logits are (a GPU's [N, V] never crosses over); the kept entries and
    # the rows' bookkeeping, small, live on the CPU.
    logits = logits.float()
    device = logits.device
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    cut = [i for i, p in enumerate(params) if p.temperature > 0 and _cuts(p, vocab)]
    whole = [i for i, p in enumerate(params) if p.temperature > 0 and not _cuts(p, vocab)]
    parts = []  # (rows, counts, tokens, probs): each row's entries one segment, tokens ascending
    if greedy:
        rows = torch.tensor(greedy)
        ones = torch.ones(len(greedy), dtype=torch.long)
        parts.append((rows, ones, logits[rows.to(device)].argmax(dim=1).cpu(), torch.ones(len(greedy))))
    if cut:
        parts.extend(_kept_support(logits, cut, [params[i] for i in cut]))
    if whole:
        rows = torch.tensor(whole)
        probs = torch.softmax(_scaled(logits, whole, [params[i] for i in whole]), dim=1).cpu()
        counts = torch.full((len(whole),), vocab)
        parts.append((rows, counts, torch.arange(vocab).repeat(len(whole)), probs.reshape(-1)))
    rows, counts, tokens, probs = (torch.cat(x) for x in zip(*parts, strict=True))
    return SparseRows.from_segments(rows, counts, tokens, probs, n, vocab)


def _cuts(p: SamplingParams, vocab: int) -> bool:
    return p.top_p < 1.0 or 0 < p.top_k < vocab


def _scaled(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits[rows] / T (no division where every T is 1)."""
    picked = logits[torch.tensor(rows, device=logits.device)] if len(rows) < logits.shape[0] else logits
    if all(p.temperature == 1 for p in params):
        return picked
    return picked / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]


def _kept_support(
    logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Top-k then top-p (on the renormalised top-k distribution), as vLLM and HF define them: keep the
    smallest prefix of the descending tokens whose mass reaches top_p, a token staying iff the mass
    strictly before it is below top_p. Only each row's head is sorted; a row widens only while its head
    holds less than top_p of the mass. Returns segments for `SparseRows.from_segments`."""
    vocab, device = logits.shape[1], logits.device
    z = _scaled(logits, rows, params)
    lse = torch.logsumexp(z, dim=1).double()
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    index = torch.tensor(rows, device=device)
    pending = torch.arange(len(rows), device=device)
    segments = []
    width = _PROBE
    while pending.numel():
        cut_k = top_k[pending][top_k[pending] < vocab]
        width = min(vocab, max(width, int(cut_k.max()) if cut_k.numel() else 0))
        rows_left = z if pending.numel() == z.shape[0] else z[pending]  # no [R, V] copy on the first pass
        values, tokens = torch.topk(rows_left, width, dim=1)
        p = torch.exp(values.double() - lse[pending, None])
        in_k = torch.arange(width, device=device)[None, :] < top_k[pending, None]
        p = p * in_k
        inclusive = torch.cumsum(p, dim=1)
        k_inside = top_k[pending] <= width
        mass_k = torch.where(k_inside, inclusive[:, -1], torch.ones_like(lse[pending]))
        threshold = top_p[pending] * mass_k
        keep = in_k & (inclusive - p < threshold[:, None]) & (p > 0)
        done = k_inside | (inclusive[:, -1] >= threshold) | (width == vocab)
        keep, tokens, p = keep[done], tokens[done], p[done]
        p = (p * keep) / (p * keep).sum(dim=1, keepdim=True)
        # Kept tokens in ascending id order: dropped ones get the id `vocab` and sort last.
        tokens, order = torch.sort(torch.where(keep, tokens, vocab), dim=1)
        counts = keep.sum(dim=1)
        first = torch.arange(width, device=device)[None, :] < counts[:, None]
        segment = (index[pending[done]], counts, tokens[first], p.gather(1, order)[first].float())
        segments.append(tuple(x.cpu() for x in segment))
        pending = pending[~done]
        width *= 16
    return segments


def verify(
    draft_tokens: torch.Tensor,
    draft: SparseRows,
    draft_row: torch.Tensor,
    target: SparseRows,
    target_row: torch.Tensor,
    num_verified: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative verification for a batch of requests.

    draft_tokens [R, D]; `draft` holds the distributions the drafts were drawn from, slot (r, k) in row
    draft_row[r, k]; `target` the target's, position j of request r (j = D: the bonus position) in row
    target_row[r, j] (any value where unverified); num_verified [R] slots verified per request (a
    prefix, n <= drafted); uniforms [R, D] and [R].
    Returns (num_accepted [R], final_token [R]): the request keeps drafts[:a] then final_token, drawn from
    the residual max(p - q, 0) at the first rejection, or from the target itself after n accepted drafts.
    """
    r_count, depth = draft_tokens.shape
    rows = torch.arange(r_count)
    if depth:
        slots = torch.arange(depth)[None, :]
        verified = slots < num_verified[:, None]
        p_tok = target.prob(torch.where(verified, target_row[:, :depth], 0), draft_tokens)
        q_tok = draft.prob(torch.where(verified, draft_row, 0), draft_tokens)
        # Accept with probability min(1, p/q); written as a product so q = 0 never divides.
        accepted = (accept_uniforms.double() * q_tok < p_tok) & verified
        num_accepted = torch.cumprod(accepted.int(), dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(r_count, dtype=torch.long)
    final_rows = target_row[rows, num_accepted]
    rejected = num_accepted < num_verified
    final = torch.empty(r_count, dtype=torch.long)
    plain = ~rejected
    if plain.any():
        final[plain] = sample(target.select(final_rows[plain]), final_uniforms[plain])
    if rejected.any():
        at = num_accepted[rejected]
        correction = residual(target.select(final_rows[rejected]), draft.select(draft_row[rejected, at]))
        final[rejected] = sample(correction, final_uniforms[rejected])
    return num_accepted, final
