"""Attention over each sequence's KV cache for the decode rows of a ragged batch (CPU).

`LlamaModel` attends per sequence (each has its own cache), and in Python each sequence and layer cost
~10 tensor ops: ~60 us on a 2-core CPU whatever the sizes, 66 ms of the attention loop of a 32-request
target forward. `attention.cpp` does every one-row chunk in one call per layer (its key and value
written into its cache, then attention over the cache, in float32), spread over torch's threads: that
loop took 48 ms instead, and the whole default-target forward at 32 / 16 / 1 requests ran 1.06x / 1.03x /
1.01x (a 2-core Xeon with AVX512, 300-token contexts). Longer chunks keep PyTorch's SDPA: at 6 rows
(a K = 5 verification) the kernel took 2x SDPA's time, which multiplies them as a GEMM. Built once per
machine on first use (~30 s, cached), checked against SDPA when it loads; where it cannot be built, on
a GPU, or with SPECVERIFY_ATTENTION_KERNEL=0, SDPA serves every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .extension import KERNEL_DTYPES, checked_extension

if TYPE_CHECKING:
    from .llama import SeqChunk

# Chunks of at most this many rows take the kernel (it handles any causal chunk, but lost to SDPA at 6).
KERNEL_ROWS = 1
_module: ModuleType | None | bool = False  # False: not tried yet; None: unavailable


def attention_kernel() -> ModuleType | None:
    """The compiled `attention.cpp`, built and checked on first call; None where it is unavailable
    (the reason is logged once)."""
    global _module
    if _module is False:
        _module = checked_extension(
            "specverify_attention", "attention.cpp", "SPECVERIFY_ATTENTION_KERNEL", "attention kernel", "SDPA",
            _self_check,
        )  # fmt: skip
    return _module  # type: ignore[return-value]


class ChunkAttention:
    """The kernel's share of one forward's chunks (those of at most `KERNEL_ROWS` rows, on the CPU in
    bf16 / float32), set up once per forward and run per layer."""

    def __init__(self, module: ModuleType, chunks: Sequence[SeqChunk]) -> None:
        self._module = module
        self._keys = [c.cache.k for c in chunks]
        self._values = [c.cache.v for c in chunks]
        self._past = torch.tensor([c.cache.length for c in chunks], dtype=torch.int64)
        self._starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
        self._ends = torch.tensor([c.end for c in chunks], dtype=torch.int64)

    @staticmethod
    def split(
        chunks: Sequence[SeqChunk], dtype: torch.dtype, device: torch.device
    ) -> tuple[ChunkAttention | None, list[SeqChunk]]:
        """The kernel's chunks (None if it takes none) and the rest, for SDPA."""
        module = attention_kernel() if device.type == "cpu" and dtype in KERNEL_DTYPES else None
        if module is None:
            return None, list(chunks)
        short = [c for c in chunks if c.end - c.start <= KERNEL_ROWS]
        rest = [c for c in chunks if c.end - c.start > KERNEL_ROWS]
        return (ChunkAttention(module, short) if short else None), rest

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> None:
        """q [N, heads, d], k / v [N, kv_heads, d]: writes the chunks' keys and values into their
        caches at their lengths and their attention into out [N, heads * d]."""
        self._module.chunk_attention(
            q, k, v, self._keys, self._values, self._starts, self._ends, self._past, layer, out
        )


def _self_check(module: ModuleType) -> None:
    """Two sequences (a verification chunk and a decode row, GQA, a context past one key block)
    against SDPA in float64, in float32 and bf16."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, layers, capacity = 4, 2, 16, 2, 96
    chunks = [(0, 5, 70), (5, 6, 9)]  # start, end, past
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        n = chunks[-1][1]
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        k = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        caches = [torch.randn(2, layers, kv_heads, capacity, d, generator=g).to(dtype) for _ in chunks]
        want = torch.empty(n, heads * d, dtype=torch.float64)
        for (s, e, past), cache in zip(chunks, caches, strict=True):
            keys = torch.cat((cache[0, 1, :, :past], k[s:e].transpose(0, 1)), 1).double()
            values = torch.cat((cache[1, 1, :, :past], v[s:e].transpose(0, 1)), 1).double()
            groups = heads // kv_heads
            keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
            mask = torch.ones(e - s, past + e - s, dtype=torch.bool).tril(past)
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).double(), keys, values, attn_mask=mask)
            want[s:e] = o.transpose(0, 1).reshape(e - s, -1)
        out = torch.empty(n, heads * d, dtype=dtype)
        module.chunk_attention(
            q, k, v,
            [c[0].contiguous() for c in caches], [c[1].contiguous() for c in caches],
            torch.tensor([c[0] for c in chunks]), torch.tensor([c[1] for c in chunks]),
            torch.tensor([c[2] for c in chunks]), 1, out,
        )  # fmt: skip
        error = (out.double() - want).abs().max().item()
        if error > tol:
            raise RuntimeError(f"self-check failed in {dtype}: max error {error:.3g}")
