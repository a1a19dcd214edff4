"""Toy models with known next-token distributions, for exact tests of the whole engine path."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import check_logit_token_ids

LogitsFn = Callable[[tuple[int, ...]], torch.Tensor]


class ToyRunner:
    """A `ModelRunner` whose logits are a pure function of the context; the "KV cache" is the token list."""

    kv_block_tokens = 1

    def __init__(
        self,
        vocab_size: int,
        logits_fn: LogitsFn,
        max_model_len: int = 4096,
        kv_bytes_per_token: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        """`kv_bytes_per_token`: what the engine's KV budget counts per cached token (0: no budget).
        `device`: where `forward`'s logits live, as a real runner's on that device would (`logits_fn`'s
        rows are moved there); `logit_token_ids` stays on the CPU, as a real runner's does."""
        self.kv_bytes_per_token = kv_bytes_per_token
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.logits_fn = logits_fn
        self.caches: dict[int, list[int]] = {}
        self.tokens_processed = 0
        self.logit_token_ids: torch.Tensor | None = None  # see restrict_logits

    @property
    def num_logit_columns(self) -> int:
        return self.vocab_size if self.logit_token_ids is None else len(self.logit_token_ids)

    def restrict_logits(self, token_ids: torch.Tensor | Sequence[int] | None) -> None:
        """As `TorchModelRunner.restrict_logits`: `forward` returns the columns of `token_ids` only
        (strictly increasing, within the vocabulary); None restores the whole vocabulary."""
        if token_ids is None:
            self.logit_token_ids = None
            return
        self.logit_token_ids = check_logit_token_ids(token_ids, self.vocab_size)

    def forward(
        self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], num_logits: Sequence[int]
    ) -> torch.Tensor:
        rows = []
        for seq_id, new, n in zip(seq_ids, tokens, num_logits, strict=True):
            cache = self.caches.setdefault(seq_id, [])
            if len(cache) + len(new) > self.max_model_len:
                raise ValueError(f"sequence {seq_id} exceeds max_model_len {self.max_model_len}")
            if any(not 0 <= t < self.vocab_size for t in new):
                raise ValueError("token id out of the vocabulary")
            cache.extend(new)
            self.tokens_processed += len(new)
            for end in range(len(cache) - n + 1, len(cache) + 1):
                rows.append(self.logits_fn(tuple(cache[:end])).float())
        if not rows:
            return torch.empty(0, self.num_logit_columns, device=self.device)
        out = torch.stack(rows).to(self.device)
        return out if self.logit_token_ids is None else out[:, self.logit_token_ids.to(self.device)]

    def cache_length(self, seq_id: int) -> int:
        return len(self.caches.get(seq_id, ()))

    def truncate(self, seq_id: int, length: int) -> None:
        cache = self.caches[seq_id]
        if not 0 <= length <= len(cache):
            raise ValueError(f"cannot truncate a cache of {len(cache)} tokens to {length}")
        del cache[length:]

    def release(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)

    def fork(self, source: int, seq_id: int, length: int) -> None:
        if seq_id in self.caches or not 0 <= length <= self.cache_length(source):
            raise ValueError(f"cannot fork {length} tokens of sequence {source} into {seq_id}")
        self.caches[seq_id] = list(self.caches[source][:length])


def table_logits(vocab_size: int, seed: int, sharpness: float = 2.0, order: int = 2) -> LogitsFn:
    """A random n-gram model: logits depend on the last `order` tokens through a fixed random table."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab_size**order, vocab_size, generator=gen) * sharpness

    def fn(context: tuple[int, ...]) -> torch.Tensor:
        key = 0
        for t in context[-order:]:
            key = key * vocab_size + t
        return table[key % table.shape[0]]

    return fn


class ToyTokenizer:
    """Just enough tokenizer for the engine: ids render as space-separated letters."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{i}" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(w[1:]) for w in text.split()]
