"""A GGUF file's Q6_K weights multiplied as stored, for the few rows of decoding (CPU).

PyTorch has no kernel for Q6_K (6-bit codes, a scale per 16 values), so a target's Q6_K tensors (its
LM head, half its v / down projections) were streamed as bf16: 2 bytes a weight against Q6_K's 0.82.
`ggml_matmul.cpp` reads the 6-bit codes themselves, with x rounded to int8 per 32 values as the Q4_K
kernel does, and byte dot products: with AVX512-VNNI from the codes re-laid once at load into 16-row
tiles (`q6k_pack`, the same bits), with AVX2 (maddubs / madd) from the blocks as stored. It is compiled
once per machine on first use (torch's C++ extension builder, ~30 s, cached under
~/.cache/torch_extensions). The weights are exactly the file's; x's rounding is the only change.
Where it cannot be built or does not check out (no compiler, no AVX2), the dense path stays.
The same extension holds the Q4_K kernel (`q4k.py`); `ggml_extension` builds it for both.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from .extension import build_extension, cpu_flags

if TYPE_CHECKING:
    from .llama import PackedWeight

logger = logging.getLogger(__name__)

# Forwards over at most this many rows use the kernel. AVX512-VNNI, 16-row tiles (a 2-core AVX512-BF16
# EPYC, whole default-target forward, scripts/q6k_forward_ab.py): 1.68x the dense bf16 path at 1 row,
# 1.72x at 2, 1.14x at 6, 1.20x at 16, 1.06x at 32 and 48, 0.98x at 64. AVX2, blocks as stored (2-core
# EPYC, float32 dense path, Q4_K kernel on): 1.71x at 1 row, 1.20x at 8, 1.05x at 16, 0.97x at 32.
Q6K_ROWS = {"VNNI": 48, "AVX2": 16}
Q6K_BLOCK_VALUES = 256
Q6K_BLOCK_BYTES = 210
# The extension's least CPU: its Q4_K kernel has an AVX2 version (`q4k.py`).
_BUILD_FLAGS = ("avx2", "fma", "f16c")
_kernels: ModuleType | None | bool = False  # False: not tried yet; None: unavailable
_extension: ModuleType | None | bool = False  # the same, for the build


@dataclass
class Q6KBlocks:
    """A weight [N, K] as its Q6_K blocks: `blocks` is uint8 [N, K / 256 * 210], row after row."""

    blocks: torch.Tensor
    shape: tuple[int, int]


def ggml_extension() -> ModuleType | None:
    """The compiled `ggml_matmul.cpp` (its Q6_K and Q4_K kernels), built on first call; None where it
    cannot be built here (the reason is logged once). Each kernel's own checks are its caller's."""
    global _extension
    if _extension is not False:
        return _extension  # type: ignore[return-value]
    _extension = None
    flags = cpu_flags()
    if not all(f in flags for f in _BUILD_FLAGS):
        logger.info(
            "GGML kernels off: this CPU lacks %s", ", ".join(f for f in _BUILD_FLAGS if f not in flags)
        )
        return None
    try:
        logger.info("loading the GGML kernels (built on first use on this machine, ~30 s)")
        _extension = build_extension("specverify_ggml", "ggml_matmul.cpp")
    except Exception as e:  # noqa: BLE001 - any build failure keeps the dense paths
        logger.warning("GGML kernels unavailable (%s: %s); their tensors stay dense", type(e).__name__, e)
    return _extension  # type: ignore[return-value]


def q6k_kernels() -> ModuleType | None:
    """The compiled kernel module, built on first call; None where this machine cannot run it (the
    reason is logged once). SPECVERIFY_Q6K_KERNEL=0 turns it off."""
    global _kernels
    if _kernels is not False:
        return _kernels  # type: ignore[return-value]
    _kernels = None
    if os.environ.get("SPECVERIFY_Q6K_KERNEL", "1") == "0":
        return None
    module = ggml_extension()
    if module is None or not module.has_q4k():
        return None
    try:
        _self_check(module)
    except Exception as e:  # noqa: BLE001 - any check failure keeps the dense path
        logger.warning("Q6_K kernel unavailable (%s: %s); its tensors stay dense", type(e).__name__, e)
        return None
    _kernels = module
    return module


def q6k_row_limit() -> int:
    """The most rows a forward may have for the Q6_K kernel to take it (this CPU's version's)."""
    from .q4k import q4k_instructions  # the kernels share their version: AVX512-VNNI or AVX2

    return Q6K_ROWS[q4k_instructions()]


def _self_check(module: ModuleType) -> None:
    """The kernel against gguf's own dequantisation on random blocks, times the kernel's own int8
    reading of x."""
    import gguf.quants as gq

    rng = np.random.default_rng(0)
    n, k = 40, 512  # a tile and a half of output rows
    blocks = rng.integers(0, 256, size=(n * k // Q6K_BLOCK_VALUES, Q6K_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 208:210] = np.full((len(blocks), 1), 1e-3, dtype=np.float16).view(np.uint8)
    w = torch.from_numpy(gq.Q6_K.dequantize_blocks(blocks).reshape(n, k)).double()
    x = torch.from_numpy(rng.standard_normal((3, k), dtype=np.float32)).bfloat16()
    codes = q6k_layout(module, torch.from_numpy(blocks.reshape(-1)), n, k)
    got = q6k_matmul(module, x, codes, n).double()
    want = q6k_reading_of_x(module, x) @ w.T
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
        raise RuntimeError(f"self-check failed: max error {(got - want).abs().max().item():.3g}")


def q6k_reading_of_x(module: ModuleType, x: torch.Tensor) -> torch.Tensor:
    """x as the Q6_K kernel multiplies it, in float64: int8 codes times their scale per 32 values."""
    codes, scales, _ = module.q4k_quantize(x.contiguous(), 32)
    return codes.double() * scales.double().repeat_interleave(32, dim=1)


def q6k_layout(module: ModuleType, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The Q6_K blocks of a weight [n, k] as `module`'s kernel reads them: 16-row tiles (AVX512-VNNI)
    or as stored (AVX2)."""
    return module.q6k_pack(blocks.contiguous().view(-1), n, k)


def q6k_matmul(module: ModuleType, x: torch.Tensor, codes: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] @ the Q6_K weight [n, K]^T (`codes` from `q6k_layout`) -> float32 [M, n]."""
    xi = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
    return module.q6k_matmul(xi.contiguous(), codes, n)


class Q6KWeight:
    """A weight [N, K] as its Q6_K blocks, next to its dense form `dense` (a `PackedWeight` or the plain
    tensor, kept for `rows > max_rows`, where the dense GEMM is faster)."""

    def __init__(
        self, codes: Q6KBlocks, dense: torch.Tensor | PackedWeight, max_rows: int, module: ModuleType
    ) -> None:
        self.shape = torch.Size(codes.shape)
        self.codes = q6k_layout(module, codes.blocks, *codes.shape)  # the blocks are not kept
        self.dense, self.max_rows, self._module = dense, max_rows, module

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = q6k_matmul(self._module, x, self.codes, self.shape[0]).to(x.dtype)
        return out if bias is None else out + bias
