"""RMSNorm, with the residual add before it, in one pass.

In PyTorch it is 8 tensor ops (~16 us at one row whatever the width), and at the few rows of drafting
and decoding that fixed cost outweighs the arithmetic (without its 49 norms, the default draft's 1-row
forward took 15.9 ms instead of 17.4 on a 2-core Xeon). On the CPU `rms_norm.cpp` does it in one pass
(~1 us), in float32 with the same roundings to the model's dtype as the PyTorch ops (the sum of squares
is ordered differently). Built once per machine on first use (~20 s, cached) and checked against the
PyTorch ops when it loads; where it cannot be built, on a GPU, or with SPECVERIFY_NORM_KERNEL=0, the
PyTorch ops run.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .extension import KERNEL_DTYPES, checked_extension

_module: ModuleType | None | bool = False  # False: not tried yet; None: unavailable


def norm_kernel() -> ModuleType | None:
    """The compiled `rms_norm.cpp`, built and checked on first call; None where it is unavailable (the
    reason is logged once)."""
    global _module
    if _module is False:
        _module = checked_extension(
            "specverify_rms_norm", "rms_norm.cpp", "SPECVERIFY_NORM_KERNEL", "RMSNorm kernel", "the PyTorch ops",
            _self_check,
        )  # fmt: skip
    return _module  # type: ignore[return-value]


def _kernel_for(*tensors: torch.Tensor) -> ModuleType | None:
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES or x.dim() != 2:
        return None
    if not all(t.is_contiguous() and t.dtype == x.dtype for t in tensors):
        return None
    return norm_kernel()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [N, H] (statistics in float32, as HF computes them). With `add`, x += add in place
    first: the residual stream takes a sub-layer's output and the next sub-layer's input comes back."""
    module = _kernel_for(x, weight, *(() if add is None else (add,)))
    if module is not None:
        return module.rms_norm(x, add, weight, eps)
    if add is not None:
        x.add_(add)
    return reference_rms_norm(x, weight, eps)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm in PyTorch ops: statistics in float32, x / rms(x) rounded to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _self_check(module: ModuleType) -> None:
    """The kernel against the PyTorch ops on random rows, float32 and bf16 (bf16: within a rounding)."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        h = torch.randn(37, 96, generator=g).to(dtype)
        add = torch.randn(37, 96, generator=g).to(dtype)
        w = torch.randn(96, generator=g).to(dtype)
        want_h = h + add
        checks = {
            "rms_norm": (module.rms_norm(h, add, w, 1e-6), reference_rms_norm(want_h, w, 1e-6)),
            "residual": (h, want_h),
        }
        for name, (got, want) in checks.items():
            scale = want.abs().max().item()
            error = (got.float() - want.float()).abs().max().item()
            if error > tol * scale:
                raise RuntimeError(f"self-check of {name} failed in {dtype}: max error {error:.3g}")
