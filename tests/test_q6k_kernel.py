"""A GGUF file's own Q6_K weights through `models/ggml.py`'s kernel: the kernel against gguf's own
dequantisation at every row count it takes, the blocks read from a file as stored, and a tiny model whose
LM head and one down projection are Q6_K taking the kernel at small row counts (close to the dense
path), the dense path bit for bit above them, and the dense path where Q6_K shares a fused weight with
Q4_K."""

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

from specverify.models.ggml import (
    Q6KWeight,
    q6k_kernels,
    q6k_layout,
    q6k_matmul,
    q6k_reading_of_x,
    q6k_row_limit,
)
from specverify.models.loader import GGUFFile, load_runner
from specverify.models.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(q6k_kernels() is None, reason="Q6_K kernel not available on this machine")


@pytest.fixture(autouse=True)
def _int4_path(monkeypatch):
    """These tests are about the int4 (and Q6_K) paths: `models/q4k.py`'s kernel would take the Q4_K
    weights from them where it runs (`tests/test_q4k_kernel.py`)."""
    monkeypatch.setenv("SPECVERIFY_Q4K_KERNEL", "0")


def random_q6k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q6_K blocks (210 bytes per 256 values): random codes and signed sub-block scales, small
    fp16 super-scales that differ from block to block."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 4e-4, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("rows", [*range(1, 10), 13, 20])  # past one pass of rows (8, or 4 in AVX2)
def test_kernel_matches_ggufs_dequantisation(rows: int) -> None:
    rng = np.random.default_rng(rows)
    n, k = 37, 768  # an output count no tile divides, three blocks per row
    blocks = random_q6k_blocks(n, k, rng)
    w = torch.from_numpy(gq.Q6_K.dequantize_blocks(blocks.reshape(-1, 210)).reshape(n, k)).double()
    x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32) * 3).bfloat16()
    codes = q6k_layout(q6k_kernels(), torch.from_numpy(blocks), n, k)
    got = q6k_matmul(q6k_kernels(), x, codes, n)
    want = q6k_reading_of_x(q6k_kernels(), x) @ w.T  # the kernel's inputs exactly, in float64
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_kernel_rejects_what_it_cannot_take() -> None:
    module = q6k_kernels()
    blocks = torch.zeros(4 * 210, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="no rows"):
        q6k_matmul(module, torch.zeros(0, 256), q6k_layout(module, blocks, 4, 256), 4)
    with pytest.raises(RuntimeError, match="do not hold"):  # 5 rows' worth of blocks expected
        q6k_matmul(module, torch.zeros(1, 256), q6k_layout(module, blocks, 5, 256), 5)


@pytest.fixture(scope="module")
def q6k_gguf(tmp_path_factory):
    """A tiny llama laid out as a Q4_K_M file: Q4_K q, k, o, gate, up; layer 1's v and down and the LM
    head in Q6_K; layer 0's v and down Q4_K."""
    model = tiny_quantizable_llama()
    rng = np.random.default_rng(0)
    q4k_shapes = q4k_layer_shapes() | {"blk.0.attn_v.weight": V_SHAPE, "blk.0.ffn_down.weight": DOWN_SHAPE}
    q6k_shapes = {
        "output.weight": HEAD_SHAPE,
        "blk.1.attn_v.weight": V_SHAPE,
        "blk.1.ffn_down.weight": DOWN_SHAPE,
    }
    q4k = {name: random_q4k_blocks(*shape, rng) for name, shape in q4k_shapes.items()}
    q6k = {name: random_q6k_blocks(*shape, rng) for name, shape in q6k_shapes.items()}
    return write_tiny_gguf(model, tmp_path_factory.mktemp("q6k") / "tiny-q6k.gguf", q4k=q4k, q6k=q6k)


def test_q6k_blocks_are_the_files_own(q6k_gguf) -> None:
    gf = GGUFFile(q6k_gguf)
    data = np.memmap(q6k_gguf, dtype=np.uint8, mode="r")
    for name in ("output.weight", "blk.1.ffn_down.weight"):
        codes = gf.q6k_blocks(name, data)
        assert codes.shape == gf.tensors[name].shape
        rebuilt = gq.Q6_K.dequantize_blocks(codes.blocks.numpy().reshape(-1, 210)).reshape(codes.shape)
        assert np.array_equal(rebuilt, gf.dequantize(name, data)), name
    assert gf.q6k_blocks("blk.0.ffn_down.weight", data) is None  # Q4_K


def test_small_forwards_take_the_q6k_blocks_and_agree_with_the_dense_path(q6k_gguf) -> None:
    dense, _ = load_runner(q6k_gguf, with_tokenizer=False, progress=False)
    quant, _ = load_runner(q6k_gguf, with_tokenizer=False, progress=False, int4_rows=4)
    layers = quant.model.layers
    assert isinstance(layers[1].w_down, Q6KWeight) and isinstance(quant.model.lm_head, Q6KWeight)
    limit = q6k_row_limit()
    assert quant.model.lm_head.max_rows == limit
    assert isinstance(layers[0].w_down, QuantizedWeight) and isinstance(layers[0].wqkv, QuantizedWeight)
    # Layer 1's q and k are Q4_K and its v Q6_K: without the Q4_K kernel, the dense path.
    assert not isinstance(layers[1].wqkv, (QuantizedWeight, Q6KWeight))
    assert quant.model.q6k_weights() == 2 and dense.model.q6k_weights() == 0
    prompt = list(range(3, 40))
    for runner in (dense, quant):
        runner.forward([0], [prompt], [1])
    small = [r.forward([0], [[5, 9]], [2]).float() for r in (dense, quant)]
    for runner in (dense, quant):
        runner.truncate(0, len(prompt))
    over = list(range(5, 6 + max(limit, 4)))  # one row past every limit (Q6_K's, int4's 4): dense
    large = [r.forward([0], [over], [len(over)]).float() for r in (dense, quant)]
    assert torch.equal(large[0], large[1])
    # The same weights (the dense path rounds each to bf16; the kernel takes them as stored).
    p, q = (torch.log_softmax(x, -1) for x in small)
    kl = (p.exp() * (p - q)).sum(-1)
    assert not torch.equal(small[0], small[1]) and kl.max().item() < 1e-3, kl
    assert torch.equal(small[0].argmax(-1), small[1].argmax(-1))
