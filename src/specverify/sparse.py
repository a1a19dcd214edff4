"""Probability rows held on their support only: what sampling and verification need, with no [N, V] tensor.

After top-p a real model's distribution keeps a handful of tokens and a greedy row keeps one, so a row is
stored as its kept tokens (ascending ids) and their probabilities, ragged like CSR: row i is
`tokens[offsets[i]:offsets[i + 1]]`. A row that keeps the whole vocabulary holds all V tokens: dense only
where the distribution really is. Because tokens ascend within a row, `row * V + token` ascends over the
whole structure, so looking a token up is one `searchsorted`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SparseRows:
    tokens: torch.Tensor  # [M] int64, ascending within each row
    probs: torch.Tensor  # [M] float32, non-negative, each row sums to 1 up to round-off
    offsets: torch.Tensor  # [N + 1] int64
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    def counts(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def row_ids(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.num_rows), self.counts())

    def prob(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Probability of `tokens[j]` in row `rows[j]` (0 where the row does not keep it)."""
        if self.tokens.numel() == 0:
            return torch.zeros(rows.shape, dtype=self.probs.dtype)
        keys = self.row_ids() * self.vocab_size + self.tokens
        wanted = rows * self.vocab_size + tokens
        at = torch.searchsorted(keys, wanted).clamp_(max=keys.numel() - 1)
        return torch.where(keys[at] == wanted, self.probs[at], torch.zeros((), dtype=self.probs.dtype))

    def select(self, rows: torch.Tensor) -> SparseRows:
        """The given rows, in the given order (repeats allowed)."""
        counts = self.counts()[rows]
        entries = _segment_entries(self.offsets[:-1][rows], counts)
        offsets = torch.zeros(rows.numel() + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=offsets[1:])
        return SparseRows(self.tokens[entries], self.probs[entries], offsets, self.vocab_size)

    def to_dense(self) -> torch.Tensor:
        """[N, V] float64 (tests and diagnostics only)."""
        out = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.float64)
        out[self.row_ids(), self.tokens] = self.probs.double()
        return out

    @classmethod
    def from_dense(cls, probs: torch.Tensor) -> SparseRows:
        """The nonzero entries of a [N, V] probability matrix (tests)."""
        rows, tokens = probs.nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=probs.shape[0])
        return cls.from_segments(
            torch.arange(probs.shape[0]), counts, tokens, probs[rows, tokens].float(), *probs.shape
        )

    @classmethod
    def from_segments(
        cls,
        rows: torch.Tensor,
        counts: torch.Tensor,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        num_rows: int,
        vocab_size: int,
    ) -> SparseRows:
        """From per-row segments laid one after the other in any row order: segment i holds `counts[i]`
        entries of row `rows[i]` (each row once, tokens ascending). Placed by offsets: no sort."""
        per_row = torch.zeros(num_rows, dtype=torch.long).index_put_((rows,), counts)
        offsets = torch.zeros(num_rows + 1, dtype=torch.long)
        torch.cumsum(per_row, 0, out=offsets[1:])
        dest = _segment_entries(offsets[:-1][rows], counts)
        out_tokens = torch.empty_like(tokens)
        out_probs = torch.empty_like(probs)
        out_tokens[dest] = tokens
        out_probs[dest] = probs
        return cls(out_tokens, out_probs, offsets, vocab_size)

    @classmethod
    def cat(cls, parts: Sequence[SparseRows], vocab_size: int) -> SparseRows:
        """Rows of several parts (none: no rows), one after the other."""
        offsets = [torch.zeros(1, dtype=torch.long)]
        for part in parts:
            offsets.append(part.offsets[1:] + offsets[-1][-1])
        return cls(
            torch.cat([p.tokens for p in parts] or [torch.zeros(0, dtype=torch.long)]),
            torch.cat([p.probs for p in parts] or [torch.zeros(0)]),
            torch.cat(offsets),
            vocab_size,
        )

    def map_tokens(self, token_ids: torch.Tensor, vocab_size: int) -> SparseRows:
        """Rows over a sub-vocabulary (token j means `token_ids[j]`, ascending) as rows over the full one."""
        return SparseRows(token_ids[self.tokens], self.probs, self.offsets, vocab_size)


def _segment_entries(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Indices start_i, start_i + 1, .., start_i + counts_i - 1 for every segment, one after the other."""
    begin = torch.cumsum(counts, 0) - counts
    return torch.repeat_interleave(starts - begin, counts) + torch.arange(int(counts.sum()))


def sample(rows: SparseRows, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform in [0, 1) per row, over one float64 cumulative sum of all rows;
    an entry of probability 0 is never drawn (`right=True` steps over it)."""
    cdf = torch.cumsum(rows.probs, 0, dtype=torch.float64)
    start, end = rows.offsets[:-1], rows.offsets[1:]
    base = torch.where(start > 0, cdf[(start - 1).clamp_(min=0)], torch.zeros((), dtype=cdf.dtype))
    mass = cdf[end - 1] - base
    at = torch.searchsorted(cdf, base + uniforms.double() * mass, right=True)
    return rows.tokens[torch.minimum(at, end - 1)]


def residual(p: SparseRows, q: SparseRows) -> SparseRows:
    """Row by row, max(p - q, 0) renormalised: the correction distribution after a rejection. Its support
    is within p's, so it is p's entries less q's mass there. Where round-off leaves no mass (p and q agree
    to float precision), p itself is exact to that precision."""
    rows = p.row_ids()
    diff = (p.probs - q.prob(rows, p.tokens)).clamp_(min=0.0)
    mass = torch.zeros(p.num_rows, dtype=torch.float64).index_add_(0, rows, diff.double())
    empty = mass <= 0
    if empty.any():
        diff = torch.where(empty[rows], p.probs, diff)
        mass = torch.where(empty, torch.ones_like(mass), mass)
    return SparseRows(p.tokens, (diff / mass[rows]).float(), p.offsets, p.vocab_size)
