"""A GGUF file's own Q4_K weights through the CPU int4 kernel (`load_model(int4_rows=...)`): the codes and
group scales read from the file reproduce gguf's dequantisation exactly, forwards over at most
`int4_rows` rows take the int4 path and agree with the dense one, larger forwards are the dense path
bit for bit, and weights with a part in another type stay dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import write_tiny_gguf

from specverify.models.loader import GGUFFile, load_runner
from specverify.models.quant import QuantizedWeight, can_quantize_weights

pytestmark = pytest.mark.skipif(
    not can_quantize_weights(torch.bfloat16, torch.device("cpu")), reason="int4 CPU kernel not available"
)


@pytest.fixture(autouse=True)
def _int4_path(monkeypatch):
    """These tests are about the int4 (and Q6_K) paths: `models/q4k.py`'s kernel would take the Q4_K
    weights from them where it runs (`tests/test_q4k_kernel.py`)."""
    monkeypatch.setenv("SPECVERIFY_Q4K_KERNEL", "0")


def random_q4k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K blocks (144 bytes per 256 values): small fp16 super-scales, random 6-bit scales and
    mins, random 4-bit codes."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((len(blocks), 1), 2e-4, dtype=np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 4e-4, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


# The Q4_K tensors of a Q4_K_M file's layer (the others: v and down, Q4_K or Q6_K by layer).
Q4K_LAYER_SHAPES = {
    "attn_q.weight": (256, 256),
    "attn_k.weight": (128, 256),
    "attn_output.weight": (256, 256),
    "ffn_gate.weight": (512, 256),
    "ffn_up.weight": (512, 256),
}
V_SHAPE, DOWN_SHAPE, HEAD_SHAPE = (128, 256), (256, 512), (128, 256)


def tiny_quantizable_llama():
    """A tiny llama with 256-value rows (a Q4_K / Q6_K block) everywhere, two layers, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def q4k_layer_shapes(layers: int = 2) -> dict[str, tuple[int, int]]:
    return {f"blk.{i}.{name}": shape for i in range(layers) for name, shape in Q4K_LAYER_SHAPES.items()}


@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory):
    """A tiny llama (hidden 256: Q4_K's 256-value rows) whose q, k, o, gate, up and LM head are Q4_K, and
    whose layer 0 v and down stay F32 (as a Q4_K_M file keeps some v / down in Q6_K)."""
    model = tiny_quantizable_llama()
    rng = np.random.default_rng(0)
    shapes = {"output.weight": HEAD_SHAPE} | q4k_layer_shapes()
    shapes |= {"blk.1.attn_v.weight": V_SHAPE, "blk.1.ffn_down.weight": DOWN_SHAPE}
    q4k = {name: random_q4k_blocks(*shape, rng) for name, shape in shapes.items()}
    return write_tiny_gguf(model, tmp_path_factory.mktemp("q4k") / "tiny-q4k.gguf", q4k=q4k)


def test_q4k_codes_reproduce_ggufs_dequantisation(q4k_gguf) -> None:
    gf = GGUFFile(q4k_gguf)
    data = np.memmap(q4k_gguf, dtype=np.uint8, mode="r")
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight"):
        g = gf.q4k_groups(name, data)
        rows, cols = gf.tensors[name].shape
        assert g.codes.shape == (rows, cols) and int(g.codes.max()) <= 15
        rebuilt = g.low.repeat_interleave(32, dim=1) + g.codes.float() * g.scale.repeat_interleave(32, dim=1)
        assert np.array_equal(rebuilt.numpy(), gf.dequantize(name, data)), name
    assert gf.q4k_groups("blk.0.attn_v.weight", data) is None  # F32: no codes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # float32: a CPU without bf16 dot products
def test_small_forwards_take_the_q4k_codes_and_agree_with_the_dense_path(q4k_gguf, dtype: str) -> None:
    dense, _ = load_runner(q4k_gguf, dtype=dtype, with_tokenizer=False, progress=False)
    int4, _ = load_runner(q4k_gguf, dtype=dtype, with_tokenizer=False, progress=False, int4_rows=4)
    layers = int4.model.layers
    # Layer 0's v and down are F32, so its fused q/k/v and its down stay dense; the rest take int4.
    assert not isinstance(layers[0].wqkv, QuantizedWeight) and not isinstance(
        layers[0].w_down, QuantizedWeight
    )
    assert all(
        isinstance(getattr(layers[1], a), QuantizedWeight) for a in ("wqkv", "wo", "w_gate_up", "w_down")
    )
    assert isinstance(layers[0].wo, QuantizedWeight) and isinstance(int4.model.lm_head, QuantizedWeight)
    assert int4.model.int4_weights() == 6 and dense.model.int4_weights() == 0
    prompt = list(range(3, 40))
    for runner in (dense, int4):
        runner.forward([0], [prompt], [1])
    small = [r.forward([0], [[5, 9, 11]], [3]).float() for r in (dense, int4)]  # 3 rows: int4
    for runner in (dense, int4):
        runner.truncate(0, len(prompt))
    large = [r.forward([0], [[5, 9, 11, 17, 23]], [5]).float() for r in (dense, int4)]  # 5 rows: dense
    assert torch.equal(large[0], large[1])
    assert not torch.equal(small[0], small[1])  # another kernel and rounding: it did take the int4 path
    # The same weights up to bf16 rounding (of each weight, or of each group's scale and offset, and in
    # float32 of the activations the kernel is handed).
    p, q = (torch.log_softmax(x, -1) for x in small)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.max().item() < 1e-3, kl
    assert torch.equal(small[0].argmax(-1), small[1].argmax(-1))
