"""KV-cache bookkeeping of TorchModelRunner: rollback, release, growth, limits and input validation."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB

from specverify.models.loader import load_runner

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture
def runner(tiny_hf, device):
    directory, _ = tiny_hf("qwen2")
    r, _ = load_runner(directory, dtype="float32", device=device, max_model_len=64, progress=False)
    return r


# fp32 logits of one sequence computed in chunks of other sizes: the matmul kernels block the sums
# differently (seen: 1.8e-6 absolute on some CPUs), while a KV-cache bug moves logits by O(1).
SAME_MATH = dict(atol=1e-5, rtol=1e-4)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_truncate_then_reappend_equals_fresh_run(runner):
    prefix, rejected, accepted = tokens(10, 0), tokens(5, 1), tokens(3, 2)
    runner.forward([0], [prefix], [0])
    runner.forward([0], [rejected], [5])
    assert runner.cache_length(0) == 15
    runner.truncate(0, 10)  # roll back the rejected drafts
    assert runner.cache_length(0) == 10
    after_rollback = runner.forward([0], [accepted], [3])

    fresh = runner.forward([1], [prefix + accepted], [3])
    torch.testing.assert_close(after_rollback, fresh, **SAME_MATH)
    # The stale entries past the rollback point must not leak into later steps either.
    torch.testing.assert_close(runner.forward([0], [[5]], [1]), runner.forward([1], [[5]], [1]), **SAME_MATH)


def test_truncate_to_zero_and_release_start_over(runner):
    runner.forward([3], [tokens(8, 3)], [0])
    runner.truncate(3, 0)
    assert runner.cache_length(3) == 0
    first = runner.forward([3], [tokens(4, 4)], [4])
    runner.release(3)
    assert runner.cache_length(3) == 0 and runner.num_sequences == 0
    runner.release(3)  # unknown ids are ignored
    again = runner.forward([3], [tokens(4, 4)], [4])  # a released id starts a fresh cache
    torch.testing.assert_close(first, again, **SAME_MATH)
    assert runner.cache_bytes() > 0
    runner.release(3)
    assert runner.cache_bytes() == 0


def test_cache_grows_in_blocks(tiny_hf, monkeypatch, device):
    from specverify.models import llama

    monkeypatch.setattr(llama, "KV_BLOCK_TOKENS", 64)
    directory, _ = tiny_hf("qwen2")
    runner, _ = load_runner(directory, dtype="float32", device=device, max_model_len=256, progress=False)
    capacities = []
    runner.forward([0], [tokens(3, 5)], [0])
    for i in range(250):
        runner.forward([0], [[i % TINY_VOCAB]], [0])
        capacities.append(runner._caches[0].capacity)
    assert runner.cache_length(0) == 253
    # Whole blocks, never more than one block beyond the length (what the KV budget counts): no
    # per-token realloc, no doubling that would leave half a cache unaccounted.
    assert sorted(set(capacities)) == [64, 128, 192, 256]
    assert all(c - 64 < n + 4 <= c for n, c in enumerate(capacities))
    runner.truncate(0, 10)  # rollback keeps the allocation for the next appends
    assert runner._caches[0].capacity == 256
    runner.reserve(1, 200)  # a prompt's room at once
    assert runner._caches[1].capacity == 256 and runner.cache_length(1) == 0


def test_exceeding_max_model_len_raises_and_leaves_caches_alone(runner):
    runner.forward([0, 1], [tokens(60, 6), tokens(2, 7)], [0, 0])
    with pytest.raises(ValueError, match="max_model_len=64"):
        runner.forward([1, 0], [[1], tokens(5, 8)], [1, 1])
    assert runner.cache_length(0) == 60 and runner.cache_length(1) == 2
    runner.forward([0], [tokens(4, 9)], [1])  # exactly at the limit is fine
    assert runner.cache_length(0) == 64
    with pytest.raises(ValueError, match="max_model_len"):
        runner.forward([2], [tokens(65, 10)], [1])


def test_truncate_errors(runner):
    runner.forward([0], [tokens(5, 11)], [0])
    with pytest.raises(ValueError, match="between 0 and 5"):
        runner.truncate(0, 6)
    with pytest.raises(ValueError, match="between 0 and 5"):
        runner.truncate(0, -1)
    with pytest.raises(ValueError, match="holds 0"):
        runner.truncate(42, 1)
    runner.truncate(42, 0)  # a no-op on an unknown id
    assert runner.cache_length(0) == 5


@pytest.mark.parametrize(
    ("seq_ids", "toks", "num_logits", "match"),
    [
        ([0, 1], [[1, 2]], [1, 1], "same length"),
        ([0], [[1, TINY_VOCAB]], [1], "out of range"),
        ([0], [[-1, 2]], [1], "out of range"),
        ([0], [[1, 2]], [3], "num_logits=3"),
        ([0], [[1, 2]], [-1], "num_logits=-1"),
        ([0, 0], [[1], [2]], [1, 1], "more than once"),
    ],
)
def test_invalid_forward_arguments(runner, seq_ids, toks, num_logits, match):
    with pytest.raises(ValueError, match=match):
        runner.forward(seq_ids, toks, num_logits)
    assert runner.num_sequences == 0  # validation happens before any cache is created


def test_logit_selection_and_empty_chunks(runner):
    out = runner.forward([0, 1], [tokens(6, 12), tokens(3, 13)], [0, 2])
    assert out.shape == (2, TINY_VOCAB) and out.dtype == torch.float32
    assert runner.forward([0], [tokens(2, 14)], [0]).shape == (0, TINY_VOCAB)
    # A sequence with no new tokens is a no-op in a batch with others.
    out = runner.forward([0, 1], [[], [4]], [0, 1])
    assert out.shape == (1, TINY_VOCAB) and runner.cache_length(0) == 8 and runner.cache_length(1) == 4
    assert runner.forward([], [], []).shape == (0, TINY_VOCAB)


def test_max_model_len_above_model_limit_is_rejected(tiny_hf):
    from specverify.models.loader import ModelLoadError

    directory, _ = tiny_hf("qwen2")
    with pytest.raises(ModelLoadError, match="max_position_embeddings=256"):
        load_runner(directory, dtype="float32", max_model_len=1000, progress=False)


def test_two_runners_can_share_one_model(tiny_hf, device):
    """Target and draft may be the same weights with separate caches; packing happens once."""
    from specverify.models.loader import load_model
    from specverify.models.runner import TorchModelRunner

    directory, _ = tiny_hf("llama")
    model, config = load_model(directory, dtype="bfloat16", device=device, progress=False)
    a = TorchModelRunner(model, config, device=device, dtype="bfloat16")
    b = TorchModelRunner(model, config, device=device, dtype="bfloat16")
    prompt = tokens(9, 15)
    torch.testing.assert_close(a.forward([0], [prompt], [2]), b.forward([0], [prompt], [2]))
    a.truncate(0, 3)
    assert b.cache_length(0) == 9
    if a.packed_weights:
        with pytest.raises(ValueError, match="packed for torch.bfloat16"):
            TorchModelRunner(model, config, dtype="float32")
