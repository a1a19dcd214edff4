"""`models/norm.py`'s one-pass RMSNorm against HF's PyTorch ops: the same values (float32: to rounding
of the sum; bf16: the same roundings, so within one bf16 step), the residual added in place, the
PyTorch fallback equal to the reference, and bad inputs raise."""

from __future__ import annotations

import pytest
import torch
from conftest import built_extension

from specverify.models import norm


@pytest.fixture(scope="module")
def kernel():
    return built_extension("specverify_rms_norm", "rms_norm.cpp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6, 700])  # 700: spread over threads
def test_kernel_matches_reference_and_adds_the_residual(kernel, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 320, generator=g) * 4).to(dtype)
    add = torch.randn(rows, 320, generator=g).to(dtype)
    w = torch.randn(320, generator=g).to(dtype)
    want_h = h + add
    want = norm.reference_rms_norm(want_h, w, 1e-6)
    got = kernel.rms_norm(h, add, w, 1e-6)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)  # x + add stored back, rounded once
    step = 1e-5 if dtype == torch.float32 else 2.0**-7  # bf16: one step of 8 mantissa bits
    assert ((got.float() - want.float()).abs() <= step * want.float().abs() + 1e-6).all()
    assert kernel.rms_norm(want_h, None, w, 1e-6).equal(got)  # no add: the same norm


def test_fallback_is_the_reference(monkeypatch):
    monkeypatch.setattr(norm, "_module", None)
    g = torch.Generator().manual_seed(0)
    h, add, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    want_h = h + add
    out = norm.rms_norm(h, w, 1e-6, add=add)
    assert h.equal(want_h) and out.equal(norm.reference_rms_norm(want_h, w, 1e-6))


def test_bad_inputs_raise(kernel):
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel.rms_norm(x, None, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="add must be"):
        kernel.rms_norm(x, torch.randn(2, 7), w, 1e-6)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel.rms_norm(x.double(), None, w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.rms_norm(torch.randn(8, 2).t(), None, torch.randn(2), 1e-6)
