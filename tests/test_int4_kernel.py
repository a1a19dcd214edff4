"""The VNNI int4 kernel (models/int4_kernel.py, int4_matmul.cpp): against a dense matmul on the dequantised
weight at 1-9 rows, its shape checks, and `QuantizedWeight` running on it where it is available."""

from __future__ import annotations

import pytest
import torch

from specverify.models import int4_kernel, quant
from specverify.models.int4_kernel import INT4_GROUP, dequantize, int4_kernels, int4_matmul, int4_pack
from specverify.models.quant import Int4Groups, QuantizedWeight

pytestmark = pytest.mark.skipif(int4_kernels() is None, reason="int4 kernel not available (no AVX512-VNNI?)")


def random_groups(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // INT4_GROUP, generator=g) * 0.01 + 1e-3).bfloat16()
    low = (-8 * scale.float() + torch.randn(n, k // INT4_GROUP, generator=g) * 1e-3).bfloat16()
    return codes, scale, low


def on_int8_grid(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """bf16 activations that int8 per 32 values represents exactly: integers times 2^-7, 127 the top of
    each group (so the kernel's integer dot products are exact)."""
    g = torch.Generator().manual_seed(seed)
    xi = torch.randint(-127, 128, (m, k), generator=g)
    xi[:, 5::INT4_GROUP] = -127
    return (xi * 2.0**-7).bfloat16()


@pytest.mark.parametrize("n,k", [(40, 896), (1000, 4864), (16, 32)])
@pytest.mark.parametrize("m", range(1, 10))
def test_kernel_matches_the_dense_dequantised_weight(n: int, k: int, m: int) -> None:
    # n = 40 and 1000 leave a ragged last tile of 16 rows; m = 9 takes two passes over each tile.
    module = int4_kernels()
    codes, scale, low = random_groups(n, k)
    packed = int4_pack(module, codes, scale, low)
    w = dequantize(codes, scale, low).double()

    x = on_int8_grid(m, k)
    want = x.double() @ w.T
    got = int4_matmul(module, x, packed, n)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    # Arbitrary activations (bf16 and float32): only their rounding to 8 bits per group is left, an
    # output error of well under 1 % of its rms.
    g = torch.Generator().manual_seed(m)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(m, k, generator=g).to(dtype)
        want = x.double() @ w.T
        err = (int4_matmul(module, x, packed, n).double() - want).norm() / want.norm()
        assert err < 0.01, dtype
        # One scale per row is coarser, but still close.
        err_row = (int4_matmul(module, x, packed, n, per_row=True).double() - want).norm() / want.norm()
        assert err_row < 0.03, dtype


def test_zero_activations_and_zero_groups_give_zeros() -> None:
    module = int4_kernels()
    codes, scale, low = random_groups(32, 64)
    packed = int4_pack(module, codes, scale, low)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    x[1, 32:] = 1.0  # row 1: group 0 all zero, group 1 not
    out = int4_matmul(module, x, packed, 32)
    assert torch.equal(out[0], torch.zeros(32)) and torch.equal(out[2], torch.zeros(32))
    want = dequantize(codes, scale, low)[:, 32:].double().sum(1)
    assert torch.allclose(out[1].double(), want, rtol=1e-5)


def test_bad_shapes_raise_clear_errors() -> None:
    module = int4_kernels()
    codes, scale, low = random_groups(32, 64)
    packed = int4_pack(module, codes, scale, low)
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_pack(module, torch.zeros(32, 48, dtype=torch.uint8), scale, low)
    with pytest.raises(ValueError, match="scale and low"):
        int4_pack(module, codes, scale[:, :1], low)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        int4_matmul(module, torch.zeros(1, 48), packed, 32)
    with pytest.raises(RuntimeError, match="does not hold"):
        int4_matmul(module, torch.zeros(1, 96), packed, 32)  # K of another weight
    with pytest.raises(RuntimeError, match="does not hold"):
        int4_matmul(module, torch.zeros(1, 64), packed, 48)  # more rows than packed
    with pytest.raises(RuntimeError, match="no rows"):
        int4_matmul(module, torch.zeros(0, 64), packed, 32)
    with pytest.raises(RuntimeError, match="uint8"):
        module.int4_pack(codes.int(), scale, low)


def test_quantized_weight_runs_on_the_kernel_and_keeps_one_copy() -> None:
    codes, scale, low = random_groups(48, 128)
    wf = dequantize(codes, scale, low)  # what the kernel multiplies by (its bf16 copy is only the dense path)
    w = wf.bfloat16()
    qw = QuantizedWeight(w, w, 4, 32, max_rows=4, groups=Int4Groups(codes, scale.float(), low.float()))
    assert qw.packed is not None and qw.qweight is None and qw.scales is None
    assert qw.nbytes() == qw.packed.numel() == 48 * 128 // 2 + 48 * 4 * 4  # codes, bf16 scale and low
    for m in (1, 4, 8, 11):
        x = on_int8_grid(m, 128)
        b = torch.randn(48).bfloat16()
        got = qw.matmul(x, b)
        assert got.dtype == torch.bfloat16
        want = x.double() @ wf.double().T + b.double()
        # Exact but for two bf16 roundings: the product, then the sum with the bias.
        assert torch.allclose(got.double(), want, rtol=2**-7, atol=2**-8 * want.abs().max().item())
        xf = x.float()
        assert qw.matmul(xf).dtype == torch.float32

    # Group sizes other than 32 and int8 keep PyTorch's kernels.
    assert QuantizedWeight(w, w, 4, 64).packed is None
    assert QuantizedWeight(w, w, 8).packed is None


def test_without_the_kernel_quantized_weight_keeps_pytorchs(monkeypatch) -> None:
    monkeypatch.setattr(quant, "int4_kernels", lambda: None)
    codes, scale, low = random_groups(48, 128)
    w = dequantize(codes, scale, low).bfloat16()
    qw = QuantizedWeight(w, w, 4, 32)
    assert qw.packed is None and qw.qweight is not None
    x = torch.randn(3, 128).bfloat16()
    monkeypatch.undo()
    ours = QuantizedWeight(w, w, 4, 32)
    assert ours.packed is not None
    ref = x.float() @ w.float().T
    for out in (qw.matmul(x), ours.matmul(x)):
        assert ((out.float() - ref).norm() / ref.norm()) < 0.12


def test_env_switch_turns_the_kernel_off(monkeypatch) -> None:
    monkeypatch.setattr(int4_kernel, "_kernels", False)
    monkeypatch.setenv("SPECVERIFY_INT4_KERNEL", "0")
    assert int4_kernels() is None
    monkeypatch.setattr(int4_kernel, "_kernels", False)
    monkeypatch.setattr(int4_kernel, "cpu_flags", lambda: {"avx512f", "avx512bw"})
    monkeypatch.delenv("SPECVERIFY_INT4_KERNEL")
    assert int4_kernels() is None  # no VNNI
