"""A GGUF file's Q6_K weights multiplied as stored, for the few rows of decoding (CPU).

PyTorch has no kernel for Q6_K (6-bit codes, a scale per 16 values), so a target's Q6_K tensors (its
LM head, half its v / down projections) were streamed as bf16: 2 bytes a weight against Q6_K's 0.82.
`ggml_matmul.cpp` reads the blocks themselves with AVX512-BF16 dot products; it is compiled once per
machine on first use (torch's C++ extension builder, ~30 s, cached under ~/.cache/torch_extensions).
Where it cannot be built or does not check out (no compiler, a CPU without AVX512-BF16), the dense
path stays. The weights are exactly the file's; only the summation order differs from a dense matmul.
The same extension holds the Q4_K kernel (`q4k.py`); `ggml_extension` builds it for both.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .llama import PackedWeight

logger = logging.getLogger(__name__)

# Forwards over at most this many rows use the kernel (and never more than the loader's own limit).
Q6K_ROWS = 2
Q6K_BLOCK_VALUES = 256
Q6K_BLOCK_BYTES = 210
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
_kernels: ModuleType | None | bool = False  # False: not tried yet; None: unavailable
_extension: ModuleType | None | bool = False  # the same, for the build


@dataclass
class Q6KBlocks:
    """A weight [N, K] as its Q6_K blocks: `blocks` is uint8 [N, K / 256 * 210], row after row."""

    blocks: torch.Tensor
    shape: tuple[int, int]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def ggml_extension() -> ModuleType | None:
    """The compiled `ggml_matmul.cpp` (its Q6_K and Q4_K kernels), built on first call; None where it
    cannot be built here (the reason is logged once). Each kernel's own checks are its caller's."""
    global _extension
    if _extension is not False:
        return _extension  # type: ignore[return-value]
    _extension = None
    flags = _cpu_flags()
    if not all(f in flags for f in ("avx512f", "avx512bw")):
        logger.info("GGML kernels off: this CPU lacks AVX-512")
        return None
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).with_name("ggml_matmul.cpp")
        # -march=native: the build is for this CPU, so the cache is keyed by its flags too.
        tag = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]
        logger.info("loading the GGML kernels (built on first use on this machine, ~30 s)")
        _extension = load(
            name=f"specverify_ggml_{tag}",
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
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
    flags = _cpu_flags()
    if os.environ.get("SPECVERIFY_Q6K_KERNEL", "1") == "0":
        return None
    if not all(f in flags for f in _CPU_FLAGS):
        logger.info("Q6_K kernel off: this CPU lacks %s", ", ".join(f for f in _CPU_FLAGS if f not in flags))
        return None
    module = ggml_extension()
    if module is None or not module.has_q6k():
        return None
    try:
        _self_check(module)
    except Exception as e:  # noqa: BLE001 - any check failure keeps the dense path
        logger.warning("Q6_K kernel unavailable (%s: %s); its tensors stay bf16", type(e).__name__, e)
        return None
    _kernels = module
    return module


def _self_check(module: ModuleType) -> None:
    """The kernel against gguf's own dequantisation on random blocks."""
    import gguf.quants as gq

    rng = np.random.default_rng(0)
    n, k = 32, 512
    blocks = rng.integers(0, 256, size=(n * k // Q6K_BLOCK_VALUES, Q6K_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 208:210] = np.full((len(blocks), 1), 1e-3, dtype=np.float16).view(np.uint8)
    w = torch.from_numpy(gq.Q6_K.dequantize_blocks(blocks).reshape(n, k)).double()
    x = torch.from_numpy(rng.standard_normal((3, k), dtype=np.float32)).bfloat16()
    got = q6k_matmul(module, x, torch.from_numpy(blocks.reshape(-1)), n).double()
    want = x.double() @ w.T
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
        raise RuntimeError(f"self-check failed: max error {(got - want).abs().max().item():.3g}")


def q6k_matmul(module: ModuleType, x: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] (M <= 8) @ the Q6_K weight [n, K]^T -> float32 [M, n]."""
    m, k = x.shape
    xb = x.to(torch.bfloat16)
    # The kernel pairs bytes within 128-bit lanes: per 64 values, the first 8 of each 16 then the last 8.
    permuted = xb.view(m, k // 64, 4, 2, 8).transpose(2, 3).contiguous().view(m, k)
    sums = xb.float().view(m, k // 16, 16).sum(-1).mul_(160)  # the codes' +128 bias, less their -32
    return module.q6k_matmul(permuted, sums, blocks, n)


class Q6KWeight:
    """A weight [N, K] as its Q6_K blocks, next to its dense form `dense` (a `PackedWeight` or the plain
    tensor, kept for `rows > max_rows`, where the dense GEMM is faster)."""

    def __init__(
        self, codes: Q6KBlocks, dense: torch.Tensor | PackedWeight, max_rows: int, module: ModuleType
    ) -> None:
        self.shape = torch.Size(codes.shape)
        self.blocks = codes.blocks.contiguous()
        self.dense, self.max_rows, self._module = dense, max_rows, module

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = q6k_matmul(self._module, x, self.blocks, self.shape[0]).to(x.dtype)
        return out if bias is None else out + bias
