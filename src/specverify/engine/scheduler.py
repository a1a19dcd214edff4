"""Continuous batching: requests wait in arrival order and join the running batch between steps."""

from __future__ import annotations

from collections import deque

from specverify.engine.sequence import Request


class Scheduler:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """Fill free slots from the queue and return the batch for this step."""
        while self.waiting and len(self.running) < self.max_num_seqs:
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
