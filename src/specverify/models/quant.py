"""Weight-only quantized matmuls for small row counts (CPU).

At the few rows of a draft step a matmul is bound by reading the weight from memory, so int4 weights
(a quarter of bf16's bytes) run ~2x faster there; at more rows the int4 kernel's compute catches up and
oneDNN's packed GEMM wins. A `QuantizedWeight` therefore keeps both copies and picks by row count
(`linear` in `llama.py` does the dispatch). Weight-only quantization changes the draft's distribution
slightly, never the output: verification against the target stays lossless. A target takes only its
checkpoint's own 4-bit codes (`Int4Groups` from a GGUF file's Q4_K tensors), never a re-quantization.
Int4 with 32-value groups runs on `int4_kernel.py`'s VNNI kernel where this CPU has it (1.2-3.7x PyTorch's
int4 kernel per matmul at 1-8 rows, in its place: the same bytes), else on PyTorch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .int4_kernel import INT4_GROUP, int4_kernels, int4_matmul, int4_pack

if TYPE_CHECKING:
    from .llama import PackedWeight

# The CPU int4 kernel's limits: N a multiple of 16, K a multiple of the group size, these group sizes.
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class Int4Groups:
    """A weight [N, K] as 4-bit codes: w[n, i] = low[n, i // G] + codes[n, i] * scale[n, i // G]."""

    codes: torch.Tensor  # [N, K] integers in 0..15
    scale: torch.Tensor  # [N, K // G]
    low: torch.Tensor  # [N, K // G]

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Row-wise concatenation (the fused q/k/v and gate/up weights)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "low")))


def _min_max_groups(w: torch.Tensor, group_size: int) -> Int4Groups:
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = (hi - lo).clamp(min=1e-12) / 15
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).view(n, k)
    return Int4Groups(q, scale, lo)


class QuantizedWeight:
    """A weight [N, K] as int8 (symmetric, one scale per output channel) or int4 (asymmetric, a scale
    and zero per `group_size` inputs), next to its dense form `dense` (a `PackedWeight` or the plain
    tensor, kept for `rows > max_rows`)."""

    def __init__(
        self,
        weight: torch.Tensor,
        dense: torch.Tensor | PackedWeight,
        bits: int = 4,
        group_size: int = 32,
        max_rows: int = 4,
        groups: Int4Groups | None = None,
    ) -> None:
        """`groups`: the int4 codes and each group's scale and low end as the checkpoint stores them
        (`weight` is then only read for its shape); None: min-max quantization of `weight`."""
        if not quantizable(weight.shape, bits, group_size) or (groups is not None and bits != 4):
            raise ValueError(
                f"cannot quantize a weight of shape {tuple(weight.shape)} to {bits} bits, g{group_size}"
            )
        self.shape, self.bits, self.group_size, self.max_rows = weight.shape, bits, group_size, max_rows
        self.dense = dense
        self.packed: torch.Tensor | None = None  # the VNNI kernel's codes, where it runs
        self.qweight: torch.Tensor | None = None  # PyTorch's int4 / int8 codes otherwise
        self.scales: torch.Tensor | None = None
        self._kernels = int4_kernels() if bits == 4 and group_size == INT4_GROUP else None
        w = weight.detach().float() if groups is None else None
        # The kernels want scales in the activations' dtype, and bf16 activations: with float32 ones
        # the int4 kernel falls back to scalar code (26x slower at one row on an AVX2 CPU).
        dtype = torch.bfloat16
        if bits == 8:
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
            self.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            self.scales = scale.to(dtype)
        else:
            if groups is None:
                groups = _min_max_groups(w, group_size)
            if self._kernels is not None:
                # Faster than PyTorch's kernel at every row count measured (1-16, per matmul and whole
                # forwards), so it replaces it: no second copy of the codes.
                self.packed = int4_pack(self._kernels, groups.codes, groups.scale, groups.low)
                return
            q, scale, lo = groups.codes.to(torch.int32), groups.scale.float(), groups.low.float()
            self.qweight = torch._convert_weight_to_int4pack_for_cpu(
                q, 8
            )  # innerKTiles: no effect on CPU (1-8 agree)
            # The kernel computes (q - 8) * scale + zero, so zero is the value code 8 stands for.
            self.scales = torch.stack((scale, lo + 8 * scale), dim=-1).transpose(0, 1).contiguous().to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] through the quantized kernel (whatever M is), in x's dtype."""
        if self.packed is not None:
            out = int4_matmul(self._kernels, x, self.packed, self.shape[0]).to(x.dtype)
            return out if bias is None else out + bias
        xq = x.to(self.scales.dtype)
        if self.bits == 8:
            out = torch._weight_int8pack_mm(xq, self.qweight, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(xq, self.qweight, self.group_size, self.scales)
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        """Bytes of the quantized copy (on top of `dense`)."""
        parts = (self.packed, self.qweight, self.scales)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)


def quantizable(shape: torch.Size | tuple[int, ...], bits: int, group_size: int = 32) -> bool:
    if bits == 8:
        return len(shape) == 2
    if bits == 4:
        return (
            len(shape) == 2
            and shape[0] % 16 == 0
            and group_size in INT4_GROUP_SIZES
            and shape[1] % group_size == 0
        )
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def can_quantize_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the quantized CPU kernels run here and agree with a float matmul (they are PyTorch
    internals: a build without them keeps the dense path). A float32 model runs them on bf16 copies of
    its activations."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 64, generator=g).to(dtype)
        x = torch.randn(3, 64, generator=g).to(dtype)
        ref = x.float() @ w.float().T
        return all(
            torch.allclose(
                QuantizedWeight(w, w, bits, 32).matmul(x).float(), ref, atol=0.15 * ref.abs().max()
            )
            for bits in (4, 8)
        )
    except (AttributeError, RuntimeError):
        return False
