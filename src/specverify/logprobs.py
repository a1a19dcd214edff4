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
from specverify.sparse import SparseRows

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


def log_distributions(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    mode: str,
    transformed: torch.Tensor | None = None,
    sampled: SparseRows | None = None,
) -> torch.Tensor:
    """[N, V] float32 log-probabilities of the rows of `logits` (raw, [N, V]) in `mode`. Processed mode
    needs the rows after logit bias / banned tokens (`transformed`, default: `logits`) and the sampling
    distributions they were drawn from (`sampled`, one row each)."""
    raw = torch.log_softmax(logits.float().cpu(), dim=1)
    if mode == "raw_logprobs":
        return raw
    if mode != "processed_logprobs":
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    base = raw if transformed is None or transformed is logits else None
    if base is None:
        base = torch.log_softmax(transformed.float().cpu(), dim=1)
    out = base.clone()
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        index = torch.tensor(rows)
        kept = sampled.select(index)
        dense = torch.full((len(rows), out.shape[1]), float("-inf"))
        dense[kept.row_ids(), kept.tokens] = torch.log(kept.probs.double()).float()
        out[index] = dense
    return out


def position_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], top_n: Sequence[int], decode=None
) -> list[PositionLogprobs]:
    """Entries for each row of `logprobs` [N, V]: the chosen `token_ids[i]` and its `top_n[i]` best
    alternatives. `decode(id) -> str` fills `decoded_token` (None: left empty)."""
    n = logprobs.shape[0]
    if n == 0:
        return []
    chosen = torch.tensor(list(token_ids), dtype=torch.long)
    chosen_lp = logprobs[torch.arange(n), chosen]
    # Rank as vLLM counts it: 1 + how many tokens are strictly more likely.
    ranks = (logprobs > chosen_lp[:, None]).sum(dim=1) + 1
    width = min(max(top_n, default=0), logprobs.shape[1])
    top_lp, top_ids = torch.topk(logprobs, width, dim=1) if width else (None, None)
    out = []
    for i in range(n):
        token = int(chosen[i])
        entries = {token: Logprob(float(chosen_lp[i]), int(ranks[i]), _text(decode, token))}
        for j in range(min(top_n[i], width)):
            alt = int(top_ids[i, j])
            if alt not in entries:
                entries[alt] = Logprob(float(top_lp[i, j]), j + 1, _text(decode, alt))
        out.append(entries)
    return out


def _text(decode, token: int) -> str | None:
    return None if decode is None else decode(token)
