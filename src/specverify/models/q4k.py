"""A GGUF file's Q4_K weights multiplied with int8 activations by AVX512-VNNI, or AVX2 without it (CPU).

A speculative verification forward has a few to a few dozen rows; there oneDNN's packed bf16 GEMM is
bound by its compute and by reading 2 bytes a weight, and PyTorch's int4 kernel (the Q4_K codes at one
to four rows) by its own unpacking. `ggml_matmul.cpp`'s Q4_K kernel quantizes each row of x to int8
(one scale per `Q4K_ACT_GROUP` = 32 values; llama.cpp's Q8_K takes one per 256) and takes the file's 4-bit
codes, re-laid once at load into 16-row tiles (`q4k_pack`, the same bits: 0.58 bytes a weight), with
u8 x s8 dot products: 64 multiply-adds per instruction, twice bf16's. The weights are exactly the
file's; the activations are rounded to 8 bits (llama.cpp's own Q4_K path does the same). It shares the
extension (and its build) with the Q6_K kernel (`ggml.py`). A CPU without AVX512-VNNI runs the same
layout in AVX2 (maddubs / madd for each VNNI dot product, 8 output rows per pass): a whole default-target
forward on a 2-core AVX2 EPYC (float32 there) ran 1.58x its int4 / float32 paths at 1 row, 1.99x at 6,
1.36x at 32. SPECVERIFY_Q4K_KERNEL=0 turns it off; a CPU without AVX2, a failed build or self-check keep
the int4 / dense paths.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from .extension import cpu_flags
from .ggml import ggml_extension

if TYPE_CHECKING:
    from .llama import PackedWeight

logger = logging.getLogger(__name__)

# Forwards over at most this many rows use the kernel; above it the dense (packed bf16) path. A whole
# 1.5B target forward (2-core Zen 4, 300-token context) ran 1.25-1.38x faster than the int4 / bf16 paths
# at 1-4 rows, 1.3-1.6x at 6-24, 1.19x still at 128 and 256 (the most measured).
Q4K_ROWS = 256
# Values of x per int8 scale. 256 is llama.cpp's Q8_K, but one outlier then flattens its 255 neighbours:
# on real text the next-token KL to the dense forward was 1.2e-2 mean per 256 (4.0 at one early
# position) against 1.2e-3 per 32 (PyTorch's int4 path: 6.9e-4), and 32 costs the kernel nothing more.
Q4K_ACT_GROUP = 32
Q4K_BLOCK_VALUES = 256
Q4K_BLOCK_BYTES = 144
_checked: ModuleType | None | bool = False  # False: not tried yet; None: unavailable


@dataclass
class Q4KBlocks:
    """A weight [N, K] as its Q4_K blocks: `blocks` is uint8 [N, K / 256 * 144], row after row."""

    blocks: torch.Tensor
    shape: tuple[int, int]

    @staticmethod
    def cat(parts: list[Q4KBlocks]) -> Q4KBlocks:
        """Row-wise concatenation (the fused q/k/v and gate/up weights): rows are independent blocks."""
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1:
            raise ValueError(f"cannot stack Q4_K weights of different widths {sorted(cols)}")
        blocks = torch.cat([p.blocks.reshape(p.shape[0], -1) for p in parts])
        return Q4KBlocks(blocks, (sum(p.shape[0] for p in parts), cols.pop()))


def q4k_kernels() -> ModuleType | None:
    """The compiled kernel module where this machine runs the Q4_K kernel and it checks out, else None
    (the reason is logged once). SPECVERIFY_Q4K_KERNEL=0 turns it off (read at every call)."""
    global _checked
    if os.environ.get("SPECVERIFY_Q4K_KERNEL", "1") == "0":
        return None
    if _checked is not False:
        return _checked  # type: ignore[return-value]
    _checked = None
    module = ggml_extension()  # AVX512-VNNI where the CPU has it, else AVX2
    if module is None or not module.has_q4k():
        return None
    try:
        _self_check(module)
    except Exception as e:  # noqa: BLE001 - any check failure keeps the other paths
        logger.warning("Q4_K kernel unavailable (%s: %s); the int4 / bf16 paths stay", type(e).__name__, e)
        return None
    _checked = module
    return module


def q4k_instructions() -> str:
    """Which version of the kernel this CPU runs (the extension is built for it: -march=native)."""
    return "VNNI" if "avx512_vnni" in cpu_flags() else "AVX2"


def _self_check(module: ModuleType) -> None:
    """The kernel against gguf's own dequantisation times the kernel's own int8 reading of x."""
    import gguf.quants as gq

    rng = np.random.default_rng(0)
    n, k = 40, 512  # a tile and a half of output rows
    blocks = rng.integers(0, 256, size=(n * k // Q4K_BLOCK_VALUES, Q4K_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:4] = np.full((len(blocks), 2), 1e-3, dtype=np.float16).view(np.uint8)
    w = torch.from_numpy(gq.Q4_K.dequantize_blocks(blocks).reshape(n, k)).double()
    x = torch.from_numpy(rng.standard_normal((3, k), dtype=np.float32)).bfloat16()
    packed = module.q4k_pack(torch.from_numpy(blocks.reshape(-1)), n, k)
    got = module.q4k_matmul(x, packed, n, Q4K_ACT_GROUP).double()
    codes, scales, _ = module.q4k_quantize(x, Q4K_ACT_GROUP)
    want = (codes.double() * scales.double().repeat_interleave(32, dim=1)) @ w.T
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
        raise RuntimeError(f"self-check failed: max error {(got - want).abs().max().item():.3g}")


def q4k_matmul(
    module: ModuleType, x: torch.Tensor, packed: torch.Tensor, n: int, group: int = Q4K_ACT_GROUP
) -> torch.Tensor:
    """x [M, K] (bf16 or float32, any M) @ the packed Q4_K weight [n, K]^T -> float32 [M, n]."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return module.q4k_matmul(x.contiguous(), packed, n, group)


class Q4KWeight:
    """A weight [N, K] as its Q4_K blocks in the kernel's layout, next to its dense form `dense` (a
    `PackedWeight` or the plain tensor, kept for `rows > max_rows`)."""

    def __init__(
        self, codes: Q4KBlocks, dense: torch.Tensor | PackedWeight, max_rows: int, module: ModuleType
    ) -> None:
        self.shape = torch.Size(codes.shape)
        n, k = codes.shape
        self.packed = module.q4k_pack(codes.blocks.contiguous().view(-1), n, k)  # the blocks are not kept
        self.dense, self.max_rows, self._module = dense, max_rows, module
        self.group = Q4K_ACT_GROUP  # values of x per int8 scale

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = q4k_matmul(self._module, x, self.packed, self.shape[0], self.group).to(x.dtype)
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        """Bytes of the packed copy (on top of `dense`)."""
        return self.packed.numel()
