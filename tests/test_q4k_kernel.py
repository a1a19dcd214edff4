"""A GGUF file's own Q4_K weights through `models/q4k.py`'s AVX512-VNNI kernel: the activations' int8
reading, the kernel against gguf's own dequantisation at every row count it takes (row tiles of 8 and
their remainders, an output count no 16-row tile divides), what it refuses, and a tiny Q4_K_M-like model
taking the kernel up to `Q4K_ROWS` rows (close to the dense path) and the dense path bit for bit above,
or the int4 path where the kernel is turned off."""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import pytest
import torch
from conftest import write_tiny_gguf
from test_q4k_int4 import (
    DOWN_SHAPE,
    HEAD_SHAPE,
    V_SHAPE,
    q4k_layer_shapes,
    random_q4k_blocks,
    tiny_quantizable_llama,
)
from test_q6k_kernel import random_q6k_blocks

from specverify.models import ggml, llama
from specverify.models.ggml import Q6KWeight, q6k_kernels
from specverify.models.llama import SplitWeight
from specverify.models.loader import GGUFFile, load_runner
from specverify.models.q4k import Q4K_ROWS, Q4KBlocks, Q4KWeight, q4k_kernels, q4k_matmul
from specverify.models.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(q4k_kernels() is None, reason="Q4_K kernel not available on this machine")


def reference_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernel reads it: per `group` values, round(x * 127 / max |x|) times max |x| / 127."""
    xf = x.float().numpy().reshape(x.shape[0], -1, group)
    top = np.abs(xf).max(-1, keepdims=True)
    # float32 as the kernel (NumPy's division is correctly rounded, like the kernel's), ties to even.
    inv = np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    codes = np.rint(xf * inv)
    return torch.from_numpy(codes.astype(np.float64) * (top.astype(np.float64) / 127)).view(x.shape)


@pytest.mark.parametrize("group", [32, 256])
def test_activations_are_read_as_int8_per_group(group: int) -> None:
    rng = np.random.default_rng(group)
    x = torch.from_numpy(rng.standard_normal((3, 512), dtype=np.float32) * 5).bfloat16()
    x[1, :256] = 0  # an all-zero group: zero codes, zero scale
    codes, scales, scaled_sums = q4k_kernels().q4k_quantize(x, group)
    assert codes.dtype == torch.int8 and codes.abs().max().item() <= 127
    read = codes.double() * scales.double().repeat_interleave(32, dim=1)
    assert torch.allclose(read, reference_int8(x, group), rtol=1e-6, atol=0)
    sums = codes.view(3, -1, 32).sum(-1).double() * scales.double()
    assert torch.allclose(scaled_sums.double(), sums, rtol=1e-6)
    assert torch.all(codes[1, :256] == 0) and torch.all(scales[1, :8] == 0)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_ggufs_dequantisation(rows: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(rows)
    n, k = 37, 768  # an output count no 16-row tile divides, three blocks per row
    blocks = random_q4k_blocks(n, k, rng)
    w = torch.from_numpy(gq.Q4_K.dequantize_blocks(blocks.reshape(-1, 144)).reshape(n, k)).double()
    x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32) * 3).to(dtype)
    weight = Q4KWeight(Q4KBlocks(torch.from_numpy(blocks), (n, k)), w.float(), Q4K_ROWS, q4k_kernels())
    for group in (32, 256):
        got = q4k_matmul(q4k_kernels(), x, weight.packed, n, group)
        want = reference_int8(x, group) @ w.T  # the kernel's inputs exactly, in float64
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
        # Against x unrounded: the int8 reading's error, a percent or so of these random outputs.
        exact = x.double() @ w.T
        assert ((got.double() - exact).norm() / exact.norm()).item() < 3e-2
    assert weight.matmul(x).dtype == dtype


def test_kernel_rejects_what_it_cannot_take() -> None:
    module = q4k_kernels()
    blocks = torch.zeros(4 * 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="do not hold"):
        module.q4k_pack(blocks, 5, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        module.q4k_pack(blocks, 4, 128)
    packed = module.q4k_pack(blocks, 4, 256)
    with pytest.raises(RuntimeError, match="does not hold"):
        q4k_matmul(module, torch.zeros(1, 512), packed, 4)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        q4k_matmul(module, torch.zeros(1, 200), packed, 4)
    with pytest.raises(RuntimeError, match="32 or 256"):
        q4k_matmul(module, torch.zeros(1, 256), packed, 4, group=64)
    with pytest.raises(ValueError, match="different widths"):
        Q4KBlocks.cat([Q4KBlocks(blocks.view(4, 144), (4, 256)), Q4KBlocks(blocks.view(2, 288), (2, 512))])


@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory):
    """A tiny llama laid out as a Q4_K_M file: Q4_K q, k, o, gate, up and LM head; layer 0's v and down
    Q4_K, layer 1's Q6_K."""
    model = tiny_quantizable_llama()
    rng = np.random.default_rng(0)
    q4k_shapes = q4k_layer_shapes() | {
        "blk.0.attn_v.weight": V_SHAPE,
        "blk.0.ffn_down.weight": DOWN_SHAPE,
        "output.weight": HEAD_SHAPE,
    }
    q6k_shapes = {"blk.1.attn_v.weight": V_SHAPE, "blk.1.ffn_down.weight": DOWN_SHAPE}
    q4k = {name: random_q4k_blocks(*shape, rng) for name, shape in q4k_shapes.items()}
    q6k = {name: random_q6k_blocks(*shape, rng) for name, shape in q6k_shapes.items()}
    return write_tiny_gguf(model, tmp_path_factory.mktemp("q4kv") / "tiny-q4k.gguf", q4k=q4k, q6k=q6k)


def test_q4k_blocks_are_the_files_own(q4k_gguf) -> None:
    gf = GGUFFile(q4k_gguf)
    data = np.memmap(q4k_gguf, dtype=np.uint8, mode="r")
    for name in ("output.weight", "blk.0.ffn_down.weight", "blk.1.attn_q.weight"):
        codes = gf.q4k_blocks(name, data)
        assert codes.shape == gf.tensors[name].shape
        rebuilt = gq.Q4_K.dequantize_blocks(codes.blocks.numpy().reshape(-1, 144)).reshape(codes.shape)
        assert np.array_equal(rebuilt, gf.dequantize(name, data)), name
    assert gf.q4k_blocks("blk.1.ffn_down.weight", data) is None  # Q6_K


def test_forwards_take_the_q4k_kernel_up_to_its_row_limit(q4k_gguf, monkeypatch) -> None:
    limit = 8  # Q4K_ROWS itself is more rows than the tiny model's context
    monkeypatch.setattr(llama, "Q4K_ROWS", limit)
    monkeypatch.setattr(ggml, "Q6K_ROWS", {"VNNI": 2, "AVX2": 2})  # the Q6_K kernel too is dense from 3 rows
    dense, _ = load_runner(q4k_gguf, with_tokenizer=False, progress=False)
    quant, _ = load_runner(q4k_gguf, with_tokenizer=False, progress=False, int4_rows=4)
    layers = quant.model.layers
    assert all(isinstance(getattr(layers[0], a), Q4KWeight) for a in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(layers[1].wo, Q4KWeight) and isinstance(quant.model.lm_head, Q4KWeight)
    assert quant.model.lm_head.max_rows == limit
    # Layer 1's q and k are Q4_K and its v Q6_K: both kernels side by side where the Q6_K one runs.
    if q6k_kernels() is not None:
        assert isinstance(layers[1].wqkv, SplitWeight)
        assert [type(p) for p in layers[1].wqkv.parts] == [Q4KWeight, Q6KWeight]
    else:
        assert not isinstance(layers[1].wqkv, (Q4KWeight, QuantizedWeight, Q6KWeight, SplitWeight))
    assert quant.model.q4k_weights() == 7 and quant.model.int4_weights() == 0
    assert dense.model.q4k_weights() == 0
    if q6k_kernels() is not None:
        assert isinstance(layers[1].w_down, Q6KWeight)
    prompt = list(range(3, 40))
    for runner in (dense, quant):
        runner.forward([0], [prompt], [1])
    rows = [5, 9, 11, 17, 23, 29, 31, 37, 41]
    for n in (3, limit):  # the kernel (the Q6_K kernel, if any, is dense from 3 rows)
        small = [r.forward([0], [rows[:n]], [n]).float() for r in (dense, quant)]
        for runner in (dense, quant):
            runner.truncate(0, len(prompt))
        assert not torch.equal(small[0], small[1])
        # The same weights (the dense path rounds each to bf16), x rounded to int8 per 32 values.
        p, q = (torch.log_softmax(x, -1) for x in small)
        kl = (p.exp() * (p - q)).sum(-1)
        assert kl.max().item() < 1e-3, kl
        assert torch.equal(small[0].argmax(-1), small[1].argmax(-1))
    n = limit + 1
    large = [r.forward([0], [rows[:n]], [n]).float() for r in (dense, quant)]  # the dense path
    assert torch.equal(large[0], large[1])


def test_int4_path_stays_where_the_kernel_is_off(q4k_gguf, monkeypatch) -> None:
    monkeypatch.setenv("SPECVERIFY_Q4K_KERNEL", "0")
    assert q4k_kernels() is None
    quant, _ = load_runner(q4k_gguf, with_tokenizer=False, progress=False, int4_rows=4)
    assert quant.model.q4k_weights() == 0
    assert isinstance(quant.model.layers[0].w_gate_up, QuantizedWeight)
    assert quant.model.layers[0].w_gate_up.max_rows == 4


@pytest.mark.skipif(q6k_kernels() is None, reason="Q6_K kernel not available on this machine")
def test_a_fused_q4k_and_q6k_weight_runs_both_kernels_side_by_side(q4k_gguf) -> None:
    quant, _ = load_runner(q4k_gguf, with_tokenizer=False, progress=False, int4_rows=4)
    weight = quant.model.layers[1].wqkv
    assert isinstance(weight, SplitWeight) and weight.max_rows == min(p.max_rows for p in weight.parts)
    assert sum(p.shape[0] for p in weight.parts) == weight.shape[0]
    x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(quant.dtype)
    got = weight.matmul(x).double()
    want = llama.linear(x, weight.dense).double()  # the dense path: the same weights, x unrounded
    assert got.shape == want.shape
    assert (got - want).norm().item() < 0.02 * want.norm().item()  # x read as int8 per 32 values
