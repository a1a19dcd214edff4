"""Engine and speculative-decoding configuration, parsed from vLLM-style dicts/JSON with clear errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = 16
# Drafters: an independent draft model, or suffix drafting over the request's own text (suffix.py).
METHODS = ("draft_model", "suffix")
# Keys that only one method reads: giving one to the other method is an error, not a silent no-op.
_METHOD_KEYS = {
    "draft_model": ("model", "draft_vocab_size", "draft_quantization"),
    "suffix": ("suffix_cache_tokens",),
}
# Smallest frequency-ranked draft vocabulary accepted (draft_vocab.py always keeps the tokenizer's ~300
# special and single-byte tokens; far fewer ids than this leave the draft little to propose).
MIN_DRAFT_VOCAB_SIZE = 1024
# draft_quantization values and their weight bits (None: bf16).
DRAFT_QUANTIZATIONS = {None: None, "none": None, "int4": 4, "int8": 8}


class ConfigError(ValueError):
    """A configuration value is malformed or out of range."""


@dataclass
class SpeculativeConfig:
    method: str = "draft_model"
    model: str | None = None  # path to the draft model (GGUF file or HF directory); None: default draft
    num_speculative_tokens: int = 5
    enable_adaptive_verification: bool = False
    # Estimator knobs (see estimator.py); None keeps the estimator's defaults.
    estimator: dict[str, Any] = field(default_factory=dict)
    # Start the estimator from a saved state (AcceptanceEstimator.state_dict() as JSON).
    estimator_state: str | None = None
    # Draft LM head over only the N most frequent token ids (draft_vocab.py, as in FR-Spec); None or 0:
    # the whole vocabulary. Lossless: the draft simply never proposes a token outside the subset. 65536
    # covers 98 % of the default target's output tokens; on 6 mixed prompts at c1 (int4 draft, K=5,
    # stepping in turn) it ran 11.5 tok/s against 10.5 for the whole vocabulary, 11.2 for 32k, 10.3 16k.
    draft_vocab_size: int | None = 65536
    # Weight-only quantized draft matmuls ("int4", "int8"; None or "none": bf16), used only by draft
    # forwards over at most 4 rows, where they measure faster than packed bf16 (models/quant.py). CPU
    # only (bf16 or float32); elsewhere the draft keeps its weights. Lossless: only the draft's
    # distribution moves.
    draft_quantization: str | None = "int4"
    # Suffix drafting: the shared cache of finished requests' outputs, at most this many tokens (oldest
    # requests evicted first); 0: each request drafts from its own prompt and output only.
    suffix_cache_tokens: int = 65536

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """Accept a SpeculativeConfig, a dict, a JSON string, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative config keys {unknown}; known keys: {sorted(known)}")
        method = value.get("method", cls.method)
        for other, keys in _METHOD_KEYS.items():
            stray = sorted(k for k in keys if k in value and other != method)
            if stray and method in METHODS:
                raise ConfigError(f"{stray} apply to method {other!r} only, not {method!r}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported; use one of {', '.join(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if not isinstance(self.enable_adaptive_verification, bool):
            raise ConfigError("enable_adaptive_verification must be true or false")
        if not isinstance(self.estimator, dict):
            raise ConfigError("estimator must be a JSON object of AcceptanceEstimator options")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ConfigError(
                f"draft_quantization must be one of {sorted(k for k in DRAFT_QUANTIZATIONS if k)} or null, "
                f"got {self.draft_quantization!r}"
            )
        c = self.suffix_cache_tokens
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ConfigError(f"suffix_cache_tokens must be an integer >= 0 (0: no shared cache), got {c!r}")
        n = self.draft_vocab_size
        if n is not None and (
            not isinstance(n, int) or isinstance(n, bool) or (n != 0 and n < MIN_DRAFT_VOCAB_SIZE)
        ):
            raise ConfigError(
                f"draft_vocab_size must be null or 0 (the whole vocabulary) or an integer >= "
                f"{MIN_DRAFT_VOCAB_SIZE}, got {n!r}"
            )


@dataclass
class EngineConfig:
    max_num_seqs: int = 32
    max_model_len: int | None = None  # None: the smaller of the models' limits
    # Prompt tokens that may join the batch in one step (a longer prompt joins alone); None: no limit.
    max_prefill_tokens: int | None = 512
    seed: int = 0
    speculative: SpeculativeConfig | None = None
    record_trace: str | None = None  # path of a JSONL trace of labelled drafts
    # Which distribution `logprobs` report (logprobs.py): "raw_logprobs" or "processed_logprobs".
    logprobs_mode: str = "raw_logprobs"
    # GiB the KV caches of both models may hold (engine/kv_budget.py); None: derived from the memory
    # available once the weights are loaded.
    kv_cache_memory: float | None = None

    def __post_init__(self) -> None:
        from specverify.logprobs import LOGPROBS_MODES

        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        budget = self.max_prefill_tokens
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ConfigError(f"max_prefill_tokens must be a positive integer or None, got {budget!r}")
        memory = self.kv_cache_memory
        if memory is not None and (
            not isinstance(memory, int | float) or isinstance(memory, bool) or not 0 < memory < 1e6
        ):
            raise ConfigError(f"kv_cache_memory must be a positive number of GiB or None, got {memory!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
