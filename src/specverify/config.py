"""Engine and speculative-decoding configuration, parsed from vLLM-style dicts/JSON with clear errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = 16


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
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method != "draft_model":
            raise ConfigError(f"speculative method {self.method!r} is not supported; use 'draft_model'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if not isinstance(self.enable_adaptive_verification, bool):
            raise ConfigError("enable_adaptive_verification must be true or false")
        if not isinstance(self.estimator, dict):
            raise ConfigError("estimator must be a JSON object of AcceptanceEstimator options")


@dataclass
class EngineConfig:
    max_num_seqs: int = 32
    max_model_len: int | None = None  # None: the smaller of the models' limits
    # Prompt tokens that may join the batch in one step (a longer prompt joins alone); None: no limit.
    max_prefill_tokens: int | None = 512
    seed: int = 0
    speculative: SpeculativeConfig | None = None
    record_trace: str | None = None  # path of a JSONL trace of labelled drafts

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        budget = self.max_prefill_tokens
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ConfigError(f"max_prefill_tokens must be a positive integer or None, got {budget!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
