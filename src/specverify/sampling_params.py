"""Per-request sampling parameters, checked when made so bad values fail before they reach the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """vLLM-style sampling parameters.

    temperature 0 means greedy. `logit_bias` / `banned_token_ids` change the target's sampling in ways the
    drafter does not see: such requests stay lossless but never train the shared acceptance estimator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    banned_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (
                isinstance(self.temperature, int | float) and 0.0 <= self.temperature <= 100.0,
                f"temperature must be in [0, 100], got {self.temperature!r}",
            ),
            (
                isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0,
                f"top_p must be in (0, 1], got {self.top_p!r}",
            ),
            (
                isinstance(self.top_k, int) and self.top_k >= 0,
                f"top_k must be 0 (off), -1 (off) or a positive integer, got {self.top_k!r}",
            ),
            (
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
            ),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.temperature != self.temperature:  # NaN
            raise ValueError("temperature must not be NaN")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def alters_target(self) -> bool:
        """True when the target's distribution is changed by something the drafter does not know about."""
        return bool(self.logit_bias or self.banned_token_ids)
