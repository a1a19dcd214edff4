"""Shape and hyper-parameters of a Llama-family model (Llama, Qwen2, SmolLM2), read from GGUF metadata or
from a Hugging Face `config.json`. Everything the model code needs, nothing it does not."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# RoPE variants llama.py implements (HF `rope_type` names).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """The model's configuration is missing a value or uses a feature this runner does not implement."""


@dataclass
class ModelConfig:
    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (always on for Qwen2)
    attention_out_bias: bool = False  # bias on the output projection (Llama with attention_bias=True)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # HF-style RoPE scaling dict ({"rope_type": "linear"|"llama3", "factor": ..., ...}); None: plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelConfigError(
                    f"RoPE scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]] | None = None
    ) -> ModelConfig:
        """Build from GGUF key/values. `tensor_shapes` (name -> HF-order shape) fills in what metadata
        leaves implicit: the vocabulary size (embedding rows), tied embeddings, q/k/v bias."""
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelConfigError("GGUF metadata has no general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        shapes = dict(tensor_shapes or {})

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in metadata:
                raise ModelConfigError(f"GGUF metadata is missing {full!r}")
            return metadata[full]

        hidden = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", num_heads))
        head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads))
        vocab = metadata.get(f"{arch}.vocab_size")
        if "token_embd.weight" in shapes:
            vocab = shapes["token_embd.weight"][0]  # the tensor is the ground truth for the logits width
        if vocab is None:
            raise ModelConfigError(
                "cannot tell the vocabulary size: no vocab_size key and no token_embd.weight"
            )

        rope_scaling = None
        scaling_type = metadata.get(f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
            rope_scaling = {"rope_type": scaling_type, "factor": float(factor)}

        eos = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            value = metadata.get(key)
            if value is not None and int(value) not in eos:
                eos.append(int(value))
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(need("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(need("feed_forward_length")),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings="output.weight" not in shapes if shapes else False,
            attention_bias="blk.0.attn_q.bias" in shapes,
            attention_out_bias="blk.0.attn_output.bias" in shapes,
            max_position_embeddings=int(metadata.get(f"{arch}.context_length", 4096)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
            rope_scaling=rope_scaling,
            name=str(metadata.get("general.name", "")),
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json` (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters` both understood)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ModelConfigError(f"config.json is missing {key!r}")
            return config[key]

        if config.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if config.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported")
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise ModelConfigError(
                "Qwen2 sliding-window attention (use_sliding_window=true) is not supported"
            )

        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or hidden // num_heads)

        # transformers 5 folds rope_theta and the scaling into rope_parameters.
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        scaling = dict(config.get("rope_scaling") or {}) or {
            k: v for k, v in rope.items() if k != "rope_theta"
        }
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}

        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        bos = config.get("bos_token_id")
        qkv_bias = True if model_type == "qwen2" else bool(config.get("attention_bias", False))
        return cls(
            architecture=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            rope_theta=rope_theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=model_type == "llama" and bool(config.get("attention_bias", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling,
            name=str(config.get("_name_or_path", "")),
        )
