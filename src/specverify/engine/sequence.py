"""One request's state as it moves through the engine."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

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
