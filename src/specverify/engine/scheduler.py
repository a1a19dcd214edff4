"""Continuous batching: requests wait in arrival order and join the running batch between steps.

At most `max_prefill_tokens` prompt tokens join per step (a longer prompt joins alone): a burst of
arrivals is prefilled over several steps, each also decoding the running requests, instead of one long
step that stalls every running request (and that a side-by-side benchmark could not pair). With a KV
budget (`fits`), a request joins only when its caches fit beside the running ones; the queue keeps its
order (no request overtakes one that waits for memory). A preempted request goes back to the queue's front.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from specverify.engine.sequence import Request


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_prefill_tokens: int | None = None,
        fits: Callable[[list[Request], Request], bool] | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens  # None: no limit
        self.fits = fits  # fits(running, candidate): may the candidate join? (None: always)
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
            if self.fits is not None and not self.fits(self.running, self.waiting[0]):
                break
            joined += tokens
            self.running.append(self.waiting.popleft())
        return self.running

    def finish(self, finished: list[Request]) -> None:
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]

    def preempt(self, request: Request) -> None:
        """Take a running request out of the batch; it is the first to join again."""
        self.running.remove(request)
        self.waiting.appendleft(request)

    def remove(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    return request
        return None

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)
