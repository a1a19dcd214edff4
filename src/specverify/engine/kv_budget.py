"""The KV-cache budget: what the running requests' caches (both models) may hold, counted before each step.

A request is counted at what its caches may hold after its next step: its tokens plus the step's growth
(K + 1 with speculation, else 1), rounded up to the runners' cache block (a cache's capacity is its
length rounded up to a block, models/llama.py). Both models' bytes per token are summed, so the count is
an upper bound of the memory the caches really take. A prompt shared by several samples holds one more
cache while samples still have to copy it.

Default budget (no `kv_cache_memory`): measured once the weights are loaded. On the CPU, 90 % of the
memory the kernel reports available (MemAvailable) less 2 GiB kept for activations, logits and the
process itself; on a GPU, 90 % of its free memory less 1 GiB.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specverify.engine.sequence import Request

GIB = 1 << 30


class KVBudget:
    def __init__(self, budget_bytes: int, bytes_per_token: int, block_tokens: int, growth: int, max_len: int):
        self.budget_bytes = int(budget_bytes)
        self.bytes_per_token = int(bytes_per_token)
        self.block = max(1, int(block_tokens))
        self.growth = growth
        self.max_len = max_len

    @property
    def budget_tokens(self) -> int:
        return self.budget_bytes // self.bytes_per_token

    def tokens(self, length: int) -> int:
        """Cache positions a sequence of `length` tokens may hold after its next step."""
        return -(-min(length + self.growth, self.max_len) // self.block) * self.block

    def in_use(self, requests: Iterable[Request], shared_prompts: Iterable[int] = ()) -> int:
        """Positions counted for `requests` and for shared prompt caches of the given lengths."""
        counted = sum(self.tokens(r.num_tokens) for r in requests)
        return counted + sum(-(-n // self.block) * self.block for n in shared_prompts)

    def fits_alone(self, length: int) -> bool:
        return self.tokens(length) <= self.budget_tokens

    def describe(self, tokens: int) -> str:
        return f"{tokens * self.bytes_per_token / GIB:.2f} GiB"


def default_kv_bytes(device: torch.device) -> int:
    """The default budget (see the module's docstring), in bytes; at least 256 MiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = 0.9 * free - GIB
    else:
        budget = 0.9 * _mem_available() - 2 * GIB
    return int(max(budget, 256 << 20))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
