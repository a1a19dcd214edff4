"""`TorchModelRunner`: the `ModelRunner` protocol (models/base.py) for the PyTorch Llama-family model.

Owns one growable KV cache per sequence id, turns the engine's lists of token ids into one flattened
ragged batch, and returns float32 logits only for the rows asked for. Validation happens before any
cache is touched, so a rejected call leaves every sequence as it was. `restrict_logits` narrows the LM
head to a subset of token ids (a frequency-ranked draft vocabulary, see `draft_vocab.py`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .base import check_logit_token_ids
from .llama import (
    KV_BLOCK_TOKENS,
    ROW_LIMITED,
    KVCache,
    LlamaModel,
    PackedWeight,
    SeqChunk,
    can_pack_weights,
)
from .model_config import ModelConfig
from .quant import QuantizedWeight, quantizable

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86 AVX512-BF16 or AMX, Arm BF16). Without
    them PyTorch's bf16 matmuls convert in software: on a 2-core AVX2 EPYC they ran at a flat 11.5
    GFLOP/s at every row count, against 55 GFLOP/s for oneDNN-packed float32 at 16 rows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype name or torch dtype -> torch dtype. "auto": bfloat16 on a GPU and on a CPU with native
    bf16 dot products, float32 on other CPUs (where bf16 is emulated and 2-5x slower from 4 rows up)."""
    if isinstance(dtype, str) and dtype.lower() == "auto":
        if torch.device(device).type != "cpu" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use bfloat16, float16 or float32")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto or one of {sorted(_DTYPES)}") from None


class TorchModelRunner:
    """Runs a `LlamaModel` over ragged batches with a per-sequence KV cache (see `ModelRunner`)."""

    def __init__(
        self,
        model: LlamaModel,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: str | torch.dtype = torch.bfloat16,
        max_model_len: int | None = None,
        pack_weights: bool | None = None,
    ) -> None:
        """`pack_weights`: reorder CPU weights for oneDNN (faster matmuls); None = when available,
        unless the environment sets SPECVERIFY_PACK_WEIGHTS=0."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.vocab_size = config.vocab_size
        limit = config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}; "
                f"pass max_model_len <= {limit}"
            )
        self.max_model_len = max_model_len

        if model.is_packed and (self.dtype != model.embed.dtype or self.device.type != "cpu"):
            raise ValueError(
                f"this model's weights were packed for {model.embed.dtype} on the CPU by another runner; "
                "load the model again to run it in another dtype or on another device"
            )
        inv_freq = model.inv_freq.float()  # RoPE angles stay float32 whatever the weights' dtype
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.inv_freq = inv_freq.to(self.device)
        if pack_weights is None:
            pack_weights = os.environ.get("SPECVERIFY_PACK_WEIGHTS", "1") != "0"
        # The model is modified in place (irreversibly): the runner owns it from here on.
        self.packed_weights = model.is_packed or (
            bool(pack_weights) and can_pack_weights(self.dtype, self.device)
        )
        if self.packed_weights:
            self.model.pack_weights()
        self._caches: dict[int, KVCache] = {}
        # `restrict_logits`: the token id of each logit column (None: all) and the LM head holding only
        # those rows (None: the model's own).
        self.logit_token_ids: torch.Tensor | None = None
        self._head: torch.Tensor | PackedWeight | QuantizedWeight | None = None

    # KV-cache accounting (the engine's budget): a cache's capacity is its length rounded up to a block.
    kv_block_tokens = KV_BLOCK_TOKENS

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one cached token takes, all layers."""
        c = self.config
        return (
            2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty(0, dtype=self.dtype).element_size()
        )

    def reserve(self, seq_id: int, length: int) -> None:
        """Make room for `length` tokens of the sequence at once (a prompt about to be prefilled in
        chunks: one allocation instead of one per chunk); an unknown id starts an empty cache."""
        cache = self._caches.get(seq_id)
        if cache is None:
            cache = self._caches[seq_id] = KVCache(self.config, self.dtype, self.device)
        cache.reserve(min(length, self.max_model_len), self.max_model_len)

    @property
    def num_logit_columns(self) -> int:
        """Width of `forward`'s logits: the vocabulary, or the subset given to `restrict_logits`."""
        return self.vocab_size if self.logit_token_ids is None else len(self.logit_token_ids)

    def restrict_logits(self, token_ids: torch.Tensor | Sequence[int] | None) -> None:
        """From now on `forward` returns logits for `token_ids` only (strictly increasing, within the
        vocabulary): column j is token `token_ids[j]`, shape [rows, len(token_ids)]; None restores the
        whole vocabulary. The head's rows are copied once into a smaller matrix (oneDNN-packed when the
        model is); the full head and the embedding table stay as they were, so token lookups, other
        runners sharing the model and a later `restrict_logits(None)` are unaffected. Input token ids
        are still validated against the whole vocabulary."""
        if token_ids is None:
            self.logit_token_ids, self._head = None, None
            return
        ids = check_logit_token_ids(token_ids, self.vocab_size)
        full = self.model.embed if self.model.lm_head is None else self.model.lm_head
        quantized = full if isinstance(full, QuantizedWeight) else None
        dense = full.dense if isinstance(full, ROW_LIMITED) else full  # a Q6_K head's subset: dense
        plain = dense.packed.to_dense() if isinstance(dense, PackedWeight) else dense.detach()
        rows = plain.index_select(0, ids.to(plain.device)).contiguous()
        head = PackedWeight(rows) if isinstance(dense, PackedWeight) else rows
        if quantized is not None and quantizable(rows.shape, quantized.bits, quantized.group_size):
            # The subset's head is as quantized as the whole one.
            head = QuantizedWeight(rows, head, quantized.bits, quantized.group_size, quantized.max_rows)
        self.logit_token_ids, self._head = ids.cpu(), head  # the ids index sampled rows, kept on the CPU

    # ------------------------------------------------------------------ protocol
    def forward(
        self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], num_logits: Sequence[int]
    ) -> torch.Tensor:
        if not len(seq_ids) == len(tokens) == len(num_logits):
            raise ValueError(
                f"seq_ids, tokens and num_logits must have the same length, got "
                f"{len(seq_ids)}, {len(tokens)} and {len(num_logits)}"
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence id appears more than once in one forward: {list(seq_ids)}")

        flat: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        spans: list[tuple[int, int, int]] = []  # (seq_id, start, end)
        for sid, toks, n_logits in zip(seq_ids, tokens, num_logits, strict=True):
            n = len(toks)
            past = self.cache_length(sid)
            if n_logits < 0 or n_logits > n:
                raise ValueError(
                    f"sequence {sid}: num_logits={n_logits} must be between 0 and {n} (its new tokens)"
                )
            if past + n > self.max_model_len:
                raise ValueError(
                    f"sequence {sid} would hold {past + n} tokens ({past} cached + {n} new), more than "
                    f"max_model_len={self.max_model_len}; finish or truncate the sequence earlier"
                )
            start = len(flat)
            flat.extend(toks)
            positions.extend(range(past, past + n))
            logit_rows.extend(range(start + n - n_logits, start + n))
            spans.append((sid, start, start + n))
        if flat:
            lo, hi = min(flat), max(flat)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is out of range for a vocabulary of {self.vocab_size}")

        if not flat:
            return torch.empty(0, self.num_logit_columns, dtype=torch.float32, device=self.device)
        chunks = []
        for sid, start, end in spans:
            if start == end:
                continue  # nothing to append; its cache stays as is
            cache = self._caches.get(sid)
            if cache is None:
                cache = self._caches[sid] = KVCache(self.config, self.dtype, self.device)
            cache.reserve(cache.length + end - start, self.max_model_len)
            chunks.append(SeqChunk(start, end, cache))

        with torch.inference_mode():
            input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            rows = None
            if len(logit_rows) < len(flat):  # skip the gather when every row's logits are wanted
                rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            out = self.model(input_ids, pos, chunks, rows, head=self._head).float()
        for chunk in chunks:
            chunk.cache.length += chunk.end - chunk.start
        return out

    def cache_length(self, seq_id: int) -> int:
        cache = self._caches.get(seq_id)
        return 0 if cache is None else cache.length

    def truncate(self, seq_id: int, length: int) -> None:
        current = self.cache_length(seq_id)
        if not isinstance(length, int) or length < 0 or length > current:
            raise ValueError(
                f"cannot truncate sequence {seq_id} to {length!r} tokens: it holds {current}; "
                f"the length must be an integer between 0 and {current}"
            )
        if seq_id in self._caches:
            self._caches[seq_id].length = length

    def release(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)

    def fork(self, source: int, seq_id: int, length: int) -> None:
        if seq_id in self._caches:
            raise ValueError(f"cannot fork into sequence {seq_id}: it already has a cache")
        if not 0 <= length <= self.cache_length(source):
            raise ValueError(
                f"cannot fork {length} tokens of sequence {source}: it holds {self.cache_length(source)}"
            )
        self._caches[seq_id] = self._caches[source].copy(length, self.max_model_len)

    # ------------------------------------------------------------------ extras
    @property
    def num_sequences(self) -> int:
        return len(self._caches)

    def cache_bytes(self) -> int:
        """Memory held by all KV caches (capacity, not just the valid part)."""
        return sum(c.nbytes() for c in self._caches.values())
