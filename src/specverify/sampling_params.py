"""Per-request sampling parameters, checked when made so bad values fail before they reach the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

# Most top alternatives per position that `logprobs` / `prompt_logprobs` may ask for (vLLM's default
# max_logprobs is 20, OpenAI's chat top_logprobs goes to 20 as well).
MAX_LOGPROBS = 20
# Most samples of one prompt (`n`): the samples share the prompt's prefill (engine/llm_engine.py), but each
# takes a running slot.
MAX_N = 16


@dataclass
class SamplingParams:
    """vLLM-style sampling parameters.

    temperature 0 means greedy. `logit_bias` / `banned_token_ids` change the target's sampling in ways the
    drafter does not see: such requests stay lossless but never train the shared acceptance estimator.
    `n` independent samples of the prompt (each its own output, prefilled once); `logprobs` (0-20): the
    target's log-probability of each generated token and its `logprobs` best alternatives;
    `prompt_logprobs` (0-20): the same for the prompt's tokens (the first has none). `max_tokens=0`
    only prefills (with `prompt_logprobs`: prompt scoring).
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
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

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
                _is_int(self.max_tokens) and self.max_tokens >= 0,
                f"max_tokens must be an integer >= 0, got {self.max_tokens!r}",
            ),
            (
                _is_int(self.n) and 1 <= self.n <= MAX_N,
                f"n must be an integer in [1, {MAX_N}], got {self.n!r}",
            ),
            (
                self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
            ),
            (
                self.prompt_logprobs is None
                or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"prompt_logprobs must be null or an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}",
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
