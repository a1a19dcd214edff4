"""Continuous batching: requests wait in arrival order and join the running batch between steps.

At most `max_prefill_tokens` prompt tokens join per step (a longer prompt joins alone): a burst of
arrivals is prefilled over several steps, each also decoding the running requests, instead of one long
step that stalls every running request (and that a side-by-side benchmark could not pair)."""

from __future__ import annotations

from collections import deque

from specverify.engine.sequence import Request


class Scheduler:
    def __init__(self, max_num_seqs: int, max_prefill_tokens: int | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens  # None: no limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """Fill free slots from the queue, within the step's prompt-token budget; the batch for this step."""
        joined = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            tokens = self.waiting[0].num_tokens
            if joined and self.max_prefill_tokens is not None and joined + tokens > self.max_prefill_tokens:
                break
            joined += tokens
            self.running.append(self.waiting.popleft())
        return self.running

    def finish(self, finished: list[Request]) -> None:
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]

    def remove(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    return request
        return None

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)
