"""One request's state as it moves through the engine."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specverify.logprobs import PositionLogprobs
from specverify.sampling_params import SamplingParams

# Sequence ids are unique per process, so engines that share loaded runners (the benchmark runs several
# modes over the same models) never collide in a runner's caches.
_seq_ids = itertools.count()


@dataclass
class RequestMetrics:
    """Per-request speculation counters; `*_per_position[k]` counts draft slot k."""

    steps: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, verified: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.verified += verified
        self.accepted += accepted
        for counts, n in (
            (self.drafted_per_position, drafted),
            (self.verified_per_position, verified),
            (self.accepted_per_position, accepted),
        ):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for k in range(n):
                counts[k] += 1


@dataclass
class PromptGroup:
    """The `n` samples of one prompt: its prompt is prefilled once, into a cache of its own (`seq_id`)
    that each sample copies when it starts; the cache is freed once no sample still needs it."""

    request_id: str  # what the caller named the request; the samples are `{request_id}-{index}`
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    waiting: set[int] = field(default_factory=set)  # seq ids of samples that have not copied it yet
    prefilled: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    text: str = ""
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    group: PromptGroup | None = None  # with n > 1: the samples of one prompt
    index: int = 0  # which of the n samples
    prepared: bool = False  # prefilled before its first step (prompt logprobs, a shared prompt)
    logprobs: list[PositionLogprobs] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token (first: None)

    @property
    def group_id(self) -> str:
        """The id the caller gave: the samples of one prompt share it."""
        return self.request_id if self.group is None else self.group.request_id

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    group_id: str = ""  # the id the caller gave (several samples of one prompt share it)
    index: int = 0  # which of the prompt's n samples
    logprobs: list[PositionLogprobs] | None = None  # per output token so far (None: not asked)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # All n samples of the prompt in index order (LLM.generate fills it; the engine leaves it empty).
    outputs: list[RequestOutput] = field(default_factory=list)
