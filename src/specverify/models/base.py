"""The one interface the engine uses to reach a model: a runner over a flattened ragged batch.

A runner owns one KV cache per sequence id. Each call appends new tokens to some sequences and returns
logits only where asked. The engine never sees layers or caches, so tests can plug in toy models with
known distributions (see `models/toy.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelRunner(Protocol):
    vocab_size: int
    max_model_len: int
    device: torch.device

    def forward(
        self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], num_logits: Sequence[int]
    ) -> torch.Tensor:
        """Append `tokens[i]` to sequence `seq_ids[i]` (a new id starts an empty cache) and return the
        float32 logits of the last `num_logits[i]` appended tokens of each sequence, concatenated in
        order: shape `[sum(num_logits), vocab_size]`. Cost follows `sum(len(t) for t in tokens)`."""
        ...

    def cache_length(self, seq_id: int) -> int:
        """Number of tokens held in the sequence's KV cache (0 for an unknown id)."""
        ...

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll the sequence's KV cache back to its first `length` tokens."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget the sequence and free its cache (unknown ids are ignored)."""
        ...
