"""The suffix drafter: draft distributions from each request's own text (and earlier requests' outputs).

No model and no forward: per running request a `SuffixStream` reads the prompt and the output as they
grow; a finished request's output goes into the shared cache, when it has room for any. At each draft
slot the drafter gives, per request, the distribution of `suffix.suffix_distribution` after the request's
text plus the tokens drafted so far this step, or nothing where no context matches. Greedy requests draft
the most probable continuation (its distribution one-hot, as the draft model's greedy rows are).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specverify.engine.sequence import Request
from specverify.sparse import SparseRows
from specverify.suffix import LEVELS, SharedSuffixCache, SuffixStream, suffix_distribution

# Names the estimator's input in saved estimator states and traces.
SUFFIX_FEATURE_ID = "suffix:logit_qmax(witten-bell)"


@dataclass
class SuffixSlot:
    """One draft slot of the requests asked: which matched, and for those (in order) what they draft."""

    matched: np.ndarray  # [n] bool
    q: SparseRows  # one row per matched request
    drawn: list[int]  # the token drawn from each row of q
    features: np.ndarray  # [m] logit(q_max) of the smoothed distribution
    qmax: np.ndarray  # [m]
    trace: dict[str, np.ndarray]  # [m] per trace feature


class SuffixDrafter:
    """Per-request suffix streams plus an optional shared cache of `cache_tokens` output tokens."""

    def __init__(self, vocab_size: int, cache_tokens: int = 0) -> None:
        self.vocab_size = int(vocab_size)
        self.streams: dict[int, SuffixStream] = {}
        self.shared = SharedSuffixCache(cache_tokens) if cache_tokens else None

    def sync(self, requests: Sequence[Request]) -> None:
        """Read what the requests emitted since the last step (before drafting it)."""
        for r in requests:
            stream = self.streams.get(r.seq_id)
            if stream is None:
                stream = self.streams[r.seq_id] = SuffixStream()
            stream.sync(r.tokens)

    def draft_slot(
        self, requests: Sequence[Request], drafted: Sequence[Sequence[int]], greedy: Sequence[bool]
    ) -> SuffixSlot:
        """Each request's draft distribution after its text plus `drafted` (its drafts so far), and the
        token drawn from it: inverse CDF over the few kept tokens with one uniform from the request's
        generator (as `sparse.sample` would, without a tensor round trip per slot)."""
        sources_shared = [self.shared.counts] if self.shared is not None else []
        matched = np.zeros(len(requests), dtype=bool)
        tokens: list[int] = []
        probs: list[float] = []
        counts: list[int] = []
        drawn: list[int] = []
        features, qmax, lengths, totals = [], [], [], []
        for i, (r, extra, is_greedy) in enumerate(zip(requests, drafted, greedy, strict=True)):
            stream = self.streams[r.seq_id]
            context = stream.tokens[-LEVELS[-1] :] + list(extra) if extra else stream.tokens
            d = suffix_distribution(context, [stream.counts, *sources_shared])
            if not d.tokens:
                continue
            matched[i] = True
            u = float(torch.rand(1, generator=r.generator))  # greedy rows draw one too, as sampled ones
            if is_greedy:
                tokens.append(d.tokens[max(range(len(d.probs)), key=d.probs.__getitem__)])
                probs.append(1.0)
                counts.append(1)
                drawn.append(tokens[-1])
            else:
                tokens.extend(d.tokens)
                probs.extend(d.probs)
                counts.append(len(d.tokens))
                drawn.append(_inverse_cdf(d.tokens, d.probs, u))
            features.append(d.feature)
            qmax.append(d.qmax)
            lengths.append(d.match_length)
            totals.append(d.count_total)
        offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
        torch.cumsum(torch.tensor(counts, dtype=torch.long), 0, out=offsets[1:])
        q = SparseRows(
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(probs, dtype=torch.float32),
            offsets,
            self.vocab_size,
        )
        features_np = np.asarray(features, dtype=np.float64)
        return SuffixSlot(
            matched=matched,
            q=q,
            drawn=drawn,
            features=features_np,
            qmax=np.asarray(qmax, dtype=np.float64),
            trace={
                "logit_qmax": features_np,
                "match_length": np.asarray(lengths, dtype=np.float64),
                "count_total": np.asarray(totals, dtype=np.float64),
            },
        )

    def release(self, request: Request) -> None:
        """Forget the request's stream; its output joins the shared cache (if any)."""
        self.streams.pop(request.seq_id, None)
        if self.shared is not None:
            self.shared.add(request.output_token_ids)


def _inverse_cdf(tokens: Sequence[int], probs: Sequence[float], u: float) -> int:
    """The token whose cumulative probability first exceeds u * total (a zero-probability token never)."""
    target, acc = u * sum(probs), 0.0
    for token, p in zip(tokens, probs, strict=True):
        acc += p
        if acc > target:
            return token
    return next(t for t, p in zip(reversed(tokens), reversed(probs), strict=True) if p > 0)
