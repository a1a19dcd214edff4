"""Int4 weights with a scale and a low end per 32 values (`quant.Int4Groups`), multiplied by AVX512-VNNI
byte dot products (or AVX2's maddubs / madd without VNNI) at the few rows of drafting and verification
(CPU).

PyTorch's `_weight_int4pack_mm_for_cpu` streamed these weights at ~14 GB/s at one row (14.3 ms of a 20 ms
draft forward) where this machine reads ~40. `int4_matmul.cpp` quantizes the activations to int8 per 32
values and multiplies them with the 4-bit codes in integer arithmetic, each group scaled in float32. It is
compiled once per machine on first use (torch's C++ extension builder, ~30 s, cached under
~/.cache/torch_extensions). Where it cannot be built or does not check out (no compiler, a CPU without
AVX2), or with SPECVERIFY_INT4_KERNEL=0, `QuantizedWeight` keeps PyTorch's kernel. The weights are
the same codes, scales and low ends (rounded to bf16, as PyTorch's path rounds them); the activations'
rounding to 8 bits per group is the only change, ~0.3 % of a matmul's output (rms); one scale per row
instead was ~8x further from PyTorch's int4 path in the draft's next-token distribution (mean KL) and no
faster. The packed copy is 0.625 bytes a weight, as PyTorch's int4 copy it replaces.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from .extension import checked_extension, cpu_flags

logger = logging.getLogger(__name__)

INT4_GROUP = 32
_CPU_FLAGS = ("avx2", "fma", "f16c")  # AVX512-VNNI where the CPU has it, else the AVX2 version
_kernels: ModuleType | None | bool = False  # False: not tried yet; None: unavailable


def int4_kernels() -> ModuleType | None:
    """The compiled kernel module, built on first call; None where this machine cannot run it (the
    reason is logged once). SPECVERIFY_INT4_KERNEL=0 turns it off."""
    global _kernels
    if _kernels is not False:
        return _kernels  # type: ignore[return-value]
    _kernels = None
    flags = cpu_flags()
    if not all(f in flags for f in _CPU_FLAGS):
        logger.info("int4 kernel off: this CPU lacks %s", ", ".join(f for f in _CPU_FLAGS if f not in flags))
        return None
    _kernels = checked_extension(
        "specverify_int4", "int4_matmul.cpp", "SPECVERIFY_INT4_KERNEL", "int4 kernel", "PyTorch's int4 kernel",
        _self_check,
    )  # fmt: skip
    return _kernels


def _self_check(module: ModuleType) -> None:
    """The kernel against a dense matmul on the dequantised weight, at 1-9 rows and a ragged last tile.
    Activations on the int8 grid of each group (a multiple of 2^-7, 127 at the top) make the kernel's
    integer part exact, so only float summation order is left."""
    if not module.has_int4():
        raise RuntimeError("the compiler did not target AVX2")
    g = torch.Generator().manual_seed(0)
    n, k = 40, 96
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // INT4_GROUP, generator=g) * 0.1).bfloat16()
    low = (torch.randn(n, k // INT4_GROUP, generator=g) * 0.5).bfloat16()
    packed = module.int4_pack(codes, scale, low)
    w = dequantize(codes, scale, low).double()
    for m in (1, 3, 8, 9):
        xi = torch.randint(-127, 128, (m, k), generator=g)
        xi[:, ::INT4_GROUP] = 127
        x = (xi * 2.0**-7).bfloat16()
        got = module.int4_matmul(x, packed, n, False).double()
        want = x.double() @ w.T
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
            raise RuntimeError(
                f"self-check failed at {m} rows: max error {(got - want).abs().max().item():.3g}"
            )


def dequantize(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that codes [N, K] and per-group scale / low [N, K / 32] stand for."""
    n, k = codes.shape
    q = codes.float().view(n, k // INT4_GROUP, INT4_GROUP)
    return (low.float()[..., None] + q * scale.float()[..., None]).view(n, k)


def int4_pack(
    module: ModuleType, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
) -> torch.Tensor:
    """codes [N, K] (0..15) and each 32-value group's scale and low end [N, K / 32] -> the kernel's
    layout (uint8, N rounded up to 16 rows); scale and low are rounded to bf16."""
    if codes.dim() != 2 or codes.shape[1] % INT4_GROUP:
        raise ValueError(
            f"int4 codes must be [N, K] with K a multiple of {INT4_GROUP}, got {tuple(codes.shape)}"
        )
    groups = (codes.shape[0], codes.shape[1] // INT4_GROUP)
    if tuple(scale.shape) != groups or tuple(low.shape) != groups:
        raise ValueError(f"scale and low must be {groups}, got {tuple(scale.shape)} and {tuple(low.shape)}")
    return module.int4_pack(
        codes.to(torch.uint8).contiguous(),
        scale.to(torch.bfloat16).contiguous(),
        low.to(torch.bfloat16).contiguous(),
    )


def int4_matmul(
    module: ModuleType, x: torch.Tensor, packed: torch.Tensor, n: int, per_row: bool = False
) -> torch.Tensor:
    """x [M, K] @ the packed weight [n, K]^T -> float32 [M, n]. The activations are quantized to int8
    with a scale per 32 values (per_row: one per row, for comparison; less accurate, no faster)."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return module.int4_matmul(x.contiguous(), packed, n, per_row)
