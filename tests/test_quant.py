"""Weight-only quantized matmuls (models/quant.py): kernel accuracy, the row-count dispatch in `linear`, and
`LlamaModel.quantize_weights` on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from specverify.models.llama import (
    KVCache,
    LlamaModel,
    PackedWeight,
    SeqChunk,
    can_pack_weights,
    linear,
    weight_shapes,
)
from specverify.models.model_config import ModelConfig
from specverify.models.quant import QuantizedWeight, can_quantize_weights, quantizable

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not can_quantize_weights(torch.bfloat16, CPU), reason="quantized CPU kernels not available"
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_weights_on_the_grid_are_reproduced_exactly() -> None:
    # Scales are powers of two and every group / channel uses its extreme codes, so quantizing is exact and
    # only bf16 rounding of the output is left: a wrong packing layout or scale order would show here.
    g = torch.Generator().manual_seed(0)
    n, k, group = 48, 128, 32
    q4 = torch.randint(0, 16, (n, k), generator=g)
    q4[:, ::group], q4[:, 1::group] = 0, 15
    s4 = 2.0 ** -torch.randint(3, 7, (n, k // group), generator=g).float()
    w4 = ((q4.view(n, -1, group) - 8) * s4[..., None]).view(n, k)
    q8 = torch.randint(-127, 128, (n, k), generator=g)
    q8[:, 0] = 127
    w8 = q8 * 2.0 ** -torch.randint(6, 10, (n, 1), generator=g).float()
    # Activations on the int8 grid of every 32 values (the VNNI int4 kernel rounds them to it): integers
    # times 2^-7, 127 the top of each group.
    xi = torch.randint(-127, 128, (5, k), generator=g)
    xi[:, 3::32] = 127
    x = (xi * 2.0**-7).bfloat16()
    for bits, w in ((4, w4), (8, w8)):
        w = w.bfloat16()
        out = QuantizedWeight(w, w, bits, group).matmul(x)
        ref = x.float() @ w.float().T
        assert torch.allclose(out.float(), ref, rtol=2**-7, atol=1e-3), bits


@pytest.mark.parametrize("bits,group,tol", [(8, 32, 0.02), (4, 32, 0.12), (4, 128, 0.15)])
def test_quantized_matmul_is_close_to_the_float_matmul(bits: int, group: int, tol: float) -> None:
    # Gaussian weights: int4 over a group's min..max range has a step of ~range/15, an rms weight error
    # of ~8 % (g32) to ~10 % (g128), and the output's relative error follows it; int8 per channel: <1 %.
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 256, generator=g) * 0.05).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(4, 256, generator=g).bfloat16()
    out = QuantizedWeight(w, w, bits, group).matmul(x, b)
    assert rel_err(out, x.float() @ w.float().T + b.float()) < tol


def test_quantizable_follows_the_int4_kernel_limits() -> None:
    assert quantizable((48, 96), 4, 32) and quantizable((40, 96), 8)
    assert not quantizable((40, 96), 4, 32)  # N must be a multiple of 16
    assert not quantizable((48, 96), 4, 64)  # K must be a multiple of the group
    with pytest.raises(ValueError):
        QuantizedWeight(torch.zeros(40, 96, dtype=torch.bfloat16), None, 4, 32)


@pytest.mark.parametrize("packed", [False, True])
def test_linear_uses_the_quantized_kernel_up_to_max_rows_only(packed: bool) -> None:
    if packed and not can_pack_weights(torch.bfloat16, CPU):
        pytest.skip("oneDNN weight packing is not available here")
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(64, 128, generator=g) * 0.05).bfloat16()
    b = torch.randn(64, generator=g).bfloat16()
    dense = PackedWeight(w) if packed else w
    qw = QuantizedWeight(w, dense, bits=4, group_size=32, max_rows=3)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        out = linear(x, qw, b)
        if rows <= 3:
            assert torch.equal(out, qw.matmul(x, b))
            assert not torch.equal(out, linear(x, dense, b))  # int4 error: the two paths differ
        else:
            assert torch.equal(out, linear(x, dense, b))


def tiny_model(tied: bool, seed: int = 3) -> LlamaModel:
    # Shapes the int4 kernel takes (N % 16, K % 32): wqkv [128, 64], wo [64, 64], gate_up [192, 64],
    # down [64, 96], head [160, 64]; Qwen2-style q/k/v bias.
    config = ModelConfig(
        architecture="qwen2",
        vocab_size=160,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        tie_word_embeddings=tied,
        attention_bias=True,
    )
    g = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(shape) if "norm" in name else torch.randn(shape, generator=g) * 0.15
        for name, shape in weight_shapes(config).items()
    }
    return LlamaModel.from_weights(config, weights).eval()


def run(model: LlamaModel, tokens: list[list[int]]) -> torch.Tensor:
    """A ragged forward over fresh caches, logits for every row."""
    flat, positions, chunks = [], [], []
    for seq in tokens:
        chunks.append(SeqChunk(len(flat), len(flat) + len(seq), KVCache(model.config, torch.bfloat16, CPU)))
        chunks[-1].cache.reserve(len(seq), 64)
        flat += seq
        positions += range(len(seq))
    with torch.inference_mode():
        return model(torch.tensor(flat), torch.tensor(positions), chunks).float()


def dequantized(weight: QuantizedWeight) -> torch.nn.Parameter:
    eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
    return torch.nn.Parameter(weight.matmul(eye).T.contiguous(), requires_grad=False)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_quantize_weights_gives_logits_close_to_the_bf16_model(tied: bool, pack: bool) -> None:
    if pack and not can_pack_weights(torch.bfloat16, CPU):
        pytest.skip("oneDNN weight packing is not available here")
    tokens = [[5, 17, 99], [140], [3, 3, 8, 150, 2]]  # 9 rows
    model = tiny_model(tied)
    if pack:
        model.pack_weights()
    ref = run(model, tokens)

    model.quantize_weights(bits=4, max_rows=0)  # never at or below max_rows: the bf16 path, bit for bit
    assert torch.equal(run(model, tokens), ref)
    assert model.is_packed == pack

    # Loose bounds against the bf16 model: the per-matmul errors above (~1 % int8, ~8 % int4 g32) compound
    # over two layers and the head of this small random net (0.02-0.03 and 0.20-0.28 over five seeds).
    for bits, tol in ((8, 0.06), (4, 0.35)):
        model.quantize_weights(bits=bits, max_rows=64)  # every forward on the quantized kernels
        out = run(model, tokens)
        assert rel_err(out, ref) < tol, bits
        # Tight: the same model with the dequantized weights in bf16 (only bf16 rounding differs), so the
        # gap above is quantization error, not a mix-up of weights, biases or heads.
        twin = tiny_model(tied)
        for layer, q_layer in zip(twin.layers, model.layers, strict=True):
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(layer, name, dequantized(getattr(q_layer, name)))
        twin.lm_head = dequantized(model.lm_head)  # tied: an own head, lookups keep the plain table
        assert rel_err(out, run(twin, tokens)) < 0.03
    assert isinstance(model.lm_head, QuantizedWeight)
    assert isinstance(model.embed, torch.nn.Parameter)  # lookups keep the plain table
    if tied:
        assert model.lm_head.dense is model.embed

    # Packing after quantizing packs the bf16 paths and keeps the quantized ones.
    if not pack and can_pack_weights(torch.bfloat16, CPU):
        model.pack_weights()
        assert model.is_packed and isinstance(model.layers[0].wo.dense, PackedWeight)
        assert torch.equal(run(model, tokens), out)


def test_auto_dtype_is_bf16_only_where_the_cpu_has_bf16_dot_products(monkeypatch) -> None:
    import specverify.models.runner as runner_module

    monkeypatch.setattr(runner_module, "cpu_has_native_bf16", lambda: False)
    assert runner_module.resolve_dtype("auto", "cpu") == torch.float32
    assert runner_module.resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(runner_module, "cpu_has_native_bf16", lambda: True)
    assert runner_module.resolve_dtype("AUTO", "cpu") == torch.bfloat16
    assert runner_module.resolve_dtype("float32", "cpu") == torch.float32
    with pytest.raises(ValueError, match="auto"):
        runner_module.resolve_dtype("int3")


def test_a_float32_model_runs_the_int4_kernel_on_bf16_activations() -> None:
    if not can_quantize_weights(torch.float32, torch.device("cpu")):
        pytest.skip("no quantized CPU kernels in this PyTorch build")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(3, 128, generator=g)
    out = QuantizedWeight(w, w, 4, 32).matmul(x)
    assert out.dtype == torch.float32
    ref = x @ w.T
    assert torch.allclose(out, ref, atol=0.15 * ref.abs().max())
