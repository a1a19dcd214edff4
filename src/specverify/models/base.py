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

    # Optional, for the engine's KV budget (absent: no budget): `kv_bytes_per_token` (keys and values of
    # one cached token, all layers) and `kv_block_tokens` (a cache's capacity is its length rounded up
    # to a multiple of it); `reserve(seq_id, length)` makes room for a prompt before it is prefilled.

    def fork(self, source: int, seq_id: int, length: int) -> None:
        """Start sequence `seq_id` (not yet known) with a copy of the first `length` cached tokens of
        `source`: what several samples of one prompt share."""
        ...


def check_logit_token_ids(token_ids, vocab_size: int) -> torch.Tensor:
    """The ids a runner's `restrict_logits` narrows its logits to, as int64 on the CPU: a non-empty,
    strictly increasing (sorted, no repeats) 1-D sequence within the vocabulary, or ValueError."""
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"restrict_logits takes a non-empty 1-D sequence of integer token ids, got {ids.dtype} of "
            f"shape {tuple(ids.shape)}"
        )
    ids = ids.to(device="cpu", dtype=torch.long)
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(
            f"restrict_logits: token ids must lie in [0, {vocab_size}), got {ids.tolist()[:8]}..."
        )
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("restrict_logits: token ids must be strictly increasing (sorted, no repeats)")
    return ids
