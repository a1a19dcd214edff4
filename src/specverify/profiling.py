"""Start-up profiling of forward times, through the `ModelRunner` protocol only (no model code).

Target: median time of one forward over N flattened tokens, spread over dummy sequences as a
verification step spreads its tokens over requests (`tokens_per_seq`, K + 1, to each; at most
`max_seqs`), logits for every token (as verification needs). Draft: median time of one forward over a batch of B sequences, one token each,
one logit each (a drafting step), and over larger token counts spread like the target's (a catch-up
forward: the draft consuming a prompt, or the tokens it missed while speculation was off). Both curves
are indexed by tokens fed. Every dummy sequence is prefilled with `context` tokens once (untimed)
and rolled back to that length after each timed forward, so all measurements see the same context.
Repeats are interleaved across sizes so a slow spell of the machine does not bias a single size.

`load_or_profile` caches profiles in one JSON file keyed by model pair and machine.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specverify.models.base import ModelRunner

# Dummy sequence ids live far below any id the engine hands out (those are >= 0).
RESERVED_SEQ_ID_BASE = -(1 << 40)
PROFILE_VERSION = 2


def _sync(runner: ModelRunner) -> None:
    device = getattr(runner, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.synchronize(device)


def _split(total: int, parts: int) -> list[int]:
    """`total` tokens over `parts` sequences, sizes differing by at most one."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def _dummy_tokens(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(0, max(1, vocab), size=n).tolist()


def _time_sizes(
    runner: ModelRunner,
    sizes: Sequence[int],
    layout: dict[int, list[int]],
    ids: list[int],
    context: int,
    logits_per_token: bool,
    repeats: int,
    rng: np.random.Generator,
    bar: Any,
) -> list[float]:
    """Median seconds per size; layout[size] = tokens per dummy sequence (a prefix of `ids`)."""
    vocab = int(runner.vocab_size)

    def run(size: int) -> float:
        counts = layout[size]
        seqs = ids[: len(counts)]
        toks = [_dummy_tokens(rng, vocab, c) for c in counts]
        num_logits = counts if logits_per_token else [1] * len(counts)
        _sync(runner)
        start = time.perf_counter()
        runner.forward(seqs, toks, num_logits)
        _sync(runner)
        elapsed = time.perf_counter() - start
        for sid in seqs:
            runner.truncate(sid, context)
        return elapsed

    run(sizes[0])  # warm-up: lazy allocations, kernel selection
    times: dict[int, list[float]] = {s: [] for s in sizes}
    for _ in range(repeats):
        for size in sizes:
            times[size].append(run(size))
            if bar is not None:
                bar.update(1)
    return [float(np.median(times[s])) for s in sizes]


def _prefill(runner: ModelRunner, ids: list[int], context: int, rng: np.random.Generator) -> None:
    if context > 0:
        vocab = int(runner.vocab_size)
        runner.forward(ids, [_dummy_tokens(rng, vocab, context) for _ in ids], [1] * len(ids))


def profile_runners(
    target: ModelRunner,
    draft: ModelRunner | None,
    token_counts: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128),
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    catchup_tokens: Sequence[int] = (64, 128, 256),
    repeats: int = 3,
    context: int = 64,
    *,
    max_seqs: int = 8,
    tokens_per_seq: int = 1,
    progress: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Median forward times of the target (by flattened token count, `tokens_per_seq` to a sequence,
    at most `max_seqs` sequences) and the draft (by batch size, one token per sequence, then by
    `catchup_tokens` spread over up to `max_seqs` sequences).

    `tokens_per_seq`: what one request verifies at most (K + 1). Where a forward's cost hangs on its
    layout this is what prices verification: on a 2-core CPU a 6-token forward took 130 ms as one
    sequence (one request verifying 5 drafts) and 150 ms as six, and the six-sequence profile priced
    each draft past the fourth at 15 ms, so at one request the planner stopped drafting early.

    Returns {"version", "context", "repeats", "max_seqs", "tokens_per_seq", "target": {"tokens", "seconds"},
    "draft": {"tokens", "seconds"} | None}, ready for `CostModel.from_profile`."""
    token_counts = sorted({int(n) for n in token_counts if int(n) > 0})
    batch_sizes = sorted({int(b) for b in batch_sizes if int(b) > 0})
    if not token_counts:
        raise ValueError("token_counts must contain a positive count")
    repeats = max(1, int(repeats))
    # Leave room for the timed tokens in the context window.
    limit = int(getattr(target, "max_model_len", context + max(token_counts) + 1))
    if draft is not None:
        limit = min(limit, int(getattr(draft, "max_model_len", limit)))
    n_target_seqs = min(max(1, max_seqs), max(token_counts))
    # Tiny context windows (toy models): keep half for context, drop sizes that would not fit.
    context = max(0, min(int(context), limit // 2))
    per_seq = max(1, int(tokens_per_seq))
    target_layout = {n: _split(n, min(n_target_seqs, math.ceil(n / per_seq))) for n in token_counts}
    token_counts = [n for n in token_counts if max(target_layout[n]) <= limit - context - 1]
    if not token_counts:
        raise ValueError(f"no token count fits a context window of {limit} tokens")
    rng = np.random.default_rng(seed)

    target_ids = [RESERVED_SEQ_ID_BASE - i for i in range(n_target_seqs)]
    draft_layout = {b: [1] * b for b in batch_sizes}
    for n in sorted({int(n) for n in catchup_tokens}):
        if n > max(batch_sizes, default=0) and math.ceil(n / n_target_seqs) <= limit - context - 1:
            draft_layout[n] = _split(n, n_target_seqs)
    draft_sizes = sorted(draft_layout)
    n_draft_seqs = max((len(v) for v in draft_layout.values()), default=0)
    draft_ids = [RESERVED_SEQ_ID_BASE - n_target_seqs - i for i in range(n_draft_seqs)]
    total = (len(token_counts) + (len(draft_sizes) if draft is not None else 0)) * repeats

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="profiling forward times", unit="fwd", leave=False)
    try:
        _prefill(target, target_ids, context, rng)
        target_seconds = _time_sizes(
            target, token_counts, target_layout, target_ids, context, True, repeats, rng, bar
        )
        draft_part = None
        if draft is not None and draft_sizes:
            _prefill(draft, draft_ids, context, rng)
            draft_seconds = _time_sizes(
                draft, draft_sizes, draft_layout, draft_ids, context, False, repeats, rng, bar
            )
            draft_part = {"tokens": draft_sizes, "seconds": draft_seconds}
    finally:
        for sid in target_ids:
            target.release(sid)
        if draft is not None:
            for sid in draft_ids:
                draft.release(sid)
        if bar is not None:
            bar.close()
    return {
        "version": PROFILE_VERSION,
        "context": context,
        "repeats": repeats,
        "max_seqs": n_target_seqs,
        "tokens_per_seq": per_seq,
        "target": {"tokens": token_counts, "seconds": target_seconds},
        "draft": draft_part,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _runner_id(runner: ModelRunner | None) -> dict[str, str]:
    if runner is None:
        return {"runner": "none"}
    out = {"runner": type(runner).__name__}
    for attr in ("name", "model_name", "model_path", "path", "dtype"):
        value = getattr(runner, attr, None)
        if value is not None:
            out[attr] = str(value)
    device = getattr(runner, "device", None)
    out["device"] = str(device)
    if isinstance(device, torch.device) and device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def profile_key(target: ModelRunner, draft: ModelRunner | None, key: str, **profile_kwargs: Any) -> str:
    """Cache key: the caller's key (model names/paths, dtype) + what the runners tell about themselves +
    the machine (CPU model, torch threads) + the profiling options. Timings are only reused where all match."""
    parts = {
        "key": key,
        "target": _runner_id(target),
        "draft": _runner_id(draft),
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "options": {
            k: list(v) if isinstance(v, (tuple, list)) else v for k, v in sorted(profile_kwargs.items())
        },
        "version": PROFILE_VERSION,
    }
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def load_or_profile(
    target: ModelRunner,
    draft: ModelRunner | None,
    cache_path: str | os.PathLike[str],
    key: str,
    **profile_kwargs: Any,
) -> dict[str, Any]:
    """The cached profile for this model pair and machine, or a fresh one (then stored).

    `cache_path` is one JSON file holding profiles by key; an unreadable file is treated as empty."""
    path = os.fspath(cache_path)
    full_key = profile_key(target, draft, key, **{k: v for k, v in profile_kwargs.items() if k != "progress"})
    cache: dict[str, Any] = {}
    try:
        with open(path) as f:
            loaded = json.load(f)
        if isinstance(loaded, dict) and isinstance(loaded.get("profiles"), dict):
            cache = loaded
    except (OSError, ValueError):
        cache = {}
    profiles = cache.setdefault("profiles", {})
    hit = profiles.get(full_key)
    if isinstance(hit, dict) and hit.get("version") == PROFILE_VERSION and "target" in hit:
        return hit
    profile = profile_runners(target, draft, **profile_kwargs)
    profile["key"] = key
    profiles[full_key] = profile
    # Atomic replace: a concurrent reader never sees a half-written file.
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return profile
