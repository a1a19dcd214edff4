"""Per-token log-probabilities from the target's logits, free of model code.

Which distribution (`logprobs_mode`, named as vLLM names it):
- "raw_logprobs" (the default, as vLLM's): log-softmax of the target's raw logits at that position, before
  logit bias, banned tokens, temperature, top-k and top-p;
- "processed_logprobs": the distribution the token was sampled from: after logit bias and banned tokens,
  temperature, top-k and top-p (tokens cut away get -inf). Greedy rows take no temperature and no cut
  (their sampling distribution is a one-hot on the argmax, which says nothing about the alternatives).

A token's log-probabilities come from the target forward that emitted it, so they are the same whether it
was decoded plainly, accepted as a draft or drawn as a correction (up to the forward's round-off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specverify.sampling_params import SamplingParams

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class Logprob:
    """One token's entry at one position, as vLLM gives it: its log-probability, its rank in that
    position's distribution (1: the most likely; ties share the better rank) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: the chosen token's entry first, then the top alternatives by rank (the chosen token is
# among them when it ranks high enough; a dict keeps one entry per token).
PositionLogprobs = dict[int, Logprob]


def token_logprobs(
    logits: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    token_ids: Sequence[int],
    top_n: Sequence[int],
    mode: str = "raw_logprobs",
    decode=None,
) -> list[PositionLogprobs]:
    """Entries for row `rows[i]` of the target's raw `logits` [M, V]: the chosen `token_ids[i]` and its
    `top_n[i]` best alternatives, in `mode`, for a request with `params[i]`. `decode(id) -> str` fills
    `decoded_token` (None: left empty). Rows go a few at a time: each block's passes over the vocabulary
    stay in cache (three times faster than whole-batch passes at 151,936 tokens)."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    out: list[PositionLogprobs] = []
    for begin in range(0, len(rows), _BLOCK):
        block = slice(begin, begin + _BLOCK)
        x = logits[list(rows[block])].float().cpu()
        scores, norms = _log_distributions(x, params[block], mode)
        out += _entries(scores, norms, token_ids[block], top_n[block], decode)
    return out


# Rows per block in `token_logprobs` (4 x 151,936 float32: 2.4 MB).
_BLOCK = 4


def _log_distributions(
    logits: torch.Tensor, params: Sequence[SamplingParams], mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, norms): log-probabilities are `scores - norms[:, None]`. Raw mode: the logits and their
    log-sum-exp (no new [N, V] tensor); processed mode: the distributions sampled from (see above)."""
    if mode == "raw_logprobs":
        return logits, torch.logsumexp(logits, dim=1)
    from specverify import sampler

    transformed = sampler.apply_target_transforms(logits, params)
    out = torch.log_softmax(transformed, dim=1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        index = torch.tensor(rows)
        kept = sampler.probabilities(transformed[index], [params[i] for i in rows])
        dense = torch.full((len(rows), out.shape[1]), float("-inf"))
        dense[kept.row_ids(), kept.tokens] = torch.log(kept.probs.double()).float()
        out[index] = dense
    return out, torch.zeros(out.shape[0])


def _entries(
    scores: torch.Tensor, norms: torch.Tensor, token_ids: Sequence[int], top_n: Sequence[int], decode
) -> list[PositionLogprobs]:
    n = scores.shape[0]
    chosen = torch.tensor(list(token_ids), dtype=torch.long)
    chosen_score = scores[torch.arange(n), chosen]
    # Rank as vLLM counts it: 1 + how many tokens are strictly more likely.
    ranks = ((scores > chosen_score[:, None]).sum(dim=1, dtype=torch.int32) + 1).tolist()
    chosen_lp = (chosen_score - norms).tolist()
    width = min(max(top_n, default=0), scores.shape[1])
    if width:
        top_scores, top_ids = torch.topk(scores, width, dim=1)
        top_lp, top_ids = (top_scores - norms[:, None]).tolist(), top_ids.tolist()
    out = []
    for i in range(n):
        token = int(chosen[i])
        entries = {token: Logprob(chosen_lp[i], ranks[i], _text(decode, token))}
        for j in range(min(top_n[i], width)):
            alt = top_ids[i][j]
            if alt not in entries:
                entries[alt] = Logprob(top_lp[i][j], j + 1, _text(decode, alt))
        out.append(entries)
    return out


def _text(decode, token: int) -> str | None:
    return None if decode is None else decode(token)
