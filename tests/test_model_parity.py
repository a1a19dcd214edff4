"""Our Llama-family runner against transformers: tiny random checkpoints (HF safetensors and GGUF written
here) and, marked `integration`, the real SmolLM2-135M GGUF."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VARIANTS, TINY_VOCAB, write_tiny_gguf

from specverify.models.base import ModelRunner
from specverify.models.loader import load_runner

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# fp32 against fp32: the only differences are summation order (fused q/k/v and gate/up matmuls, SDPA).
TINY_ATOL = 1e-4
# SmolLM2 (30 layers, logits up to ~40): observed max |diff| ~8e-5.
SMOLLM_ATOL = 1e-3


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation with transformers, recomputing the whole prefix each step (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def runner_greedy(runner, prompt: list[int], steps: int, seq_id: int = 0) -> list[int]:
    """Greedy continuation with our runner: prefill, then one cached token per step."""
    out: list[int] = []
    logits = runner.forward([seq_id], [prompt], [1])
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([seq_id], [[out[-1]]], [1])
    runner.release(seq_id)
    return out


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_hf_logits_and_greedy_match_transformers(tiny_hf, variant, device):
    directory, hf = tiny_hf(variant)
    runner, tokenizer = load_runner(directory, dtype="float32", device=device, progress=False)
    assert tokenizer is None  # the tiny directories carry no tokenizer
    assert isinstance(runner, ModelRunner)
    prompt = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = runner.forward([7], [prompt], [len(prompt)]).cpu()  # the reference runs on the CPU
    assert got.dtype == torch.float32 and got.shape == (len(prompt), TINY_VOCAB)
    assert ref.abs().max() > 1.0  # logits spread out enough to make the comparison meaningful
    assert (got - ref).abs().max().item() < TINY_ATOL
    assert runner_greedy(runner, prompt[:5], 20, seq_id=8) == hf_greedy(hf, prompt[:5], 20)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen2-tied"])
def test_tiny_gguf_matches_transformers(tiny_hf, tmp_path, variant, device):
    """GGUF path: llama.cpp names, F32 tensors, and for llama the Q/K permutation that must be undone."""
    _, hf = tiny_hf(variant)
    path = write_tiny_gguf(hf, tmp_path / f"{variant}.gguf")
    runner, _ = load_runner(path, dtype="float32", device=device, with_tokenizer=False, progress=False)
    assert runner.config.tie_word_embeddings == TINY_VARIANTS[variant][1]["tie_word_embeddings"]
    prompt = list(range(3, 35))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = runner.forward([0], [prompt], [len(prompt)]).cpu()
    assert (got - ref).abs().max().item() < TINY_ATOL


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_ragged_batch_equals_sequences_alone(tiny_hf, variant, device):
    directory, _ = tiny_hf(variant)
    runner, _ = load_runner(directory, dtype="float32", device=device, progress=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=g).tolist() for n in (7, 1, 12)]
    steps = [torch.randint(0, TINY_VOCAB, (n,), generator=g).tolist() for n in (1, 4, 3)]
    num_logits = [[7, 1, 2], [1, 3, 0]]

    alone = []  # per step, per sequence: logits of that sequence run by itself
    for i in range(3):
        rows = []
        for toks, logit_counts in zip((prompts[i], steps[i]), num_logits, strict=True):
            rows.append(runner.forward([100 + i], [toks], [logit_counts[i]]))
        alone.append(rows)
        runner.release(100 + i)

    first = runner.forward([0, 1, 2], prompts, num_logits[0])
    second = runner.forward([0, 1, 2], steps, num_logits[1])
    for step, batched in enumerate((first, second)):
        expected = torch.cat([alone[i][step] for i in range(3)])
        assert batched.shape == expected.shape == (sum(num_logits[step]), TINY_VOCAB)
        torch.testing.assert_close(batched, expected, atol=1e-5, rtol=1e-5)
    assert [runner.cache_length(i) for i in range(3)] == [8, 5, 15]


def test_bf16_close_to_fp32_and_packed_weights_match_plain(tiny_hf):
    directory, _ = tiny_hf("qwen2")
    fp32, _ = load_runner(directory, dtype="float32", progress=False)
    bf16, _ = load_runner(directory, dtype="bfloat16", progress=False, pack_weights=False)
    packed, _ = load_runner(directory, dtype="bfloat16", progress=False, pack_weights=True)
    assert bf16.model.embed.dtype == torch.bfloat16 and not bf16.packed_weights
    prompt = list(range(1, 41))
    a = fp32.forward([0], [prompt], [len(prompt)])
    b = bf16.forward([0], [prompt], [len(prompt)])
    assert b.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the argmax should almost always survive.
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9
    if packed.packed_weights:  # oneDNN packing only changes the memory layout, not the arithmetic
        c = packed.forward([0], [prompt[:-3]], [0])
        assert c.shape == (0, TINY_VOCAB)  # no logits asked: the (packed) LM head is skipped
        c = packed.forward([0], [prompt[-3:]], [3])
        torch.testing.assert_close(c, b[-3:], atol=0.02 * a.abs().max().item(), rtol=0.0)


# ------------------------------------------------------------------------------------ SmolLM2 GGUF
@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf, specverify_cache, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    ours, tokenizer = load_runner(smollm2_gguf, dtype="float32", device=device, progress=False)
    # The reference's config is written out from SmolLM2-135M's published values rather than read
    # from the GGUF: independent of our metadata parsing, and it spares transformers one slow parse.
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    reference = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, config=config, dtype=torch.float32
    ).eval()
    return ours, tokenizer, reference


@pytest.mark.integration
def test_smollm2_gguf_matches_transformers(smollm2_pair):
    ours, tokenizer, reference = smollm2_pair
    assert ours.config.architecture == "llama" and ours.vocab_size == 49152
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    with torch.no_grad():
        ref = reference(torch.tensor([prompt])).logits[0]
    got = ours.forward([0], [prompt], [len(prompt)]).cpu()  # the reference runs on the CPU
    assert (got - ref).abs().max().item() < SMOLLM_ATOL
    ours.release(0)

    assert runner_greedy(ours, prompt, 16) == hf_greedy(reference, prompt, 16)


@pytest.mark.integration
def test_smollm2_tokenizer_has_chat_template_and_is_cached(smollm2_pair, smollm2_gguf, specverify_cache):
    _, tokenizer, _ = smollm2_pair
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in rendered
    cached = list((specverify_cache / "tokenizers").glob(f"{smollm2_gguf.stem}-*"))
    assert cached and (cached[0] / "tokenizer.json").is_file()
