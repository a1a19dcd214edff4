"""`models/attention.py`'s kernel against PyTorch's SDPA path: the same logits and the same cache
contents over a ragged batch of decode rows, verification chunks (the kernel handles any causal chunk,
though the model sends it one-row chunks only) and a prefill chunk (SDPA either way), in float32 and
bf16; bad inputs raise."""

from __future__ import annotations

import pytest
import torch
from conftest import built_extension

from specverify.models import attention
from specverify.models.llama import KVCache, LlamaModel, SeqChunk
from specverify.models.model_config import ModelConfig


@pytest.fixture(scope="module")
def kernel():
    return built_extension("specverify_attention", "attention.cpp")


def tiny_model(dtype: torch.dtype) -> LlamaModel:
    config = ModelConfig(
        architecture="qwen2", vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, attention_bias=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    model = LlamaModel(config)
    for p in model.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.3).to(dtype)
    return model  # inv_freq stays float32, as from_weights leaves it


def ragged_run(model: LlamaModel, module, monkeypatch) -> tuple[torch.Tensor, list[KVCache]]:
    monkeypatch.setattr(attention, "_module", module)
    monkeypatch.setattr(attention, "KERNEL_ROWS", 32)
    c, dtype = model.config, model.embed.dtype
    g = torch.Generator().manual_seed(1)
    pasts, rows = [0, 70, 130, 5, 64], [40, 1, 6, 17, 1]  # 40 rows: SDPA either way
    caches, chunks, ids, positions, start = [], [], [], [], 0
    for past, n in zip(pasts, rows, strict=True):
        cache = KVCache(c, dtype, torch.device("cpu"))
        cache.reserve(past + n, 1024)
        if past:  # a context written by a prefill through SDPA
            monkeypatch.setattr(attention, "_module", None)
            context = torch.randint(0, c.vocab_size, (past,), generator=g)
            model(context, torch.arange(past), [SeqChunk(0, past, cache)], logit_rows=torch.tensor([0]))
            cache.length = past
            monkeypatch.setattr(attention, "_module", module)
        caches.append(cache)
        chunks.append(SeqChunk(start, start + n, cache))
        ids.append(torch.randint(0, c.vocab_size, (n,), generator=g))
        positions.append(torch.arange(past, past + n))
        start += n
    with torch.inference_mode():
        logits = model(torch.cat(ids), torch.cat(positions), chunks)
    for cache, n in zip(caches, rows, strict=True):
        cache.length += n
    return logits.float(), caches


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.06)])
def test_kernel_matches_sdpa_on_a_ragged_batch(kernel, dtype, tol, monkeypatch):
    model = tiny_model(dtype)
    got, got_caches = ragged_run(model, kernel, monkeypatch)
    want, want_caches = ragged_run(model, None, monkeypatch)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= tol * scale
    for a, b in zip(got_caches, want_caches, strict=True):
        n = a.length
        torch.testing.assert_close(a.k[:, :, :n].float(), b.k[:, :, :n].float(), atol=tol * 10, rtol=tol)
        torch.testing.assert_close(a.v[:, :, :n].float(), b.v[:, :, :n].float(), atol=tol * 10, rtol=tol)


def test_bad_inputs_raise(kernel):
    module = kernel
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    cache = torch.zeros(2, 2, 8, 16)
    out = torch.empty(3, 64)
    one = torch.tensor([0])

    def call(**kw):
        args = dict(q=q, k=k, v=v, keys=[cache], values=[cache.clone()], starts=one, ends=torch.tensor([3]),
                    past=torch.tensor([6]), layer=0, out=out)  # fmt: skip
        args.update(kw)
        module.chunk_attention(*args.values())

    with pytest.raises(RuntimeError, match="does not fit its cache"):
        call()  # 6 + 3 > 8 positions
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        call(q=torch.randn(3, 3, 16), past=torch.tensor([0]))
    with pytest.raises(RuntimeError, match="out of range"):
        call(ends=torch.tensor([4]), past=torch.tensor([0]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(k=k.double(), past=torch.tensor([0]))
    with pytest.raises(RuntimeError, match="layers, kv_heads"):
        call(layer=2, past=torch.tensor([0]))
