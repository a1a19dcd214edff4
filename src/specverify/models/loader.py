"""Load a Llama-family model from a GGUF file or a Hugging Face directory into a `TorchModelRunner`.

GGUF: the header is parsed here (the `gguf` package's reader walks the 150k-entry vocabulary arrays one
numpy view at a time, ~15 s on the default target, while we only need their lengths); tensors are
dequantised with `gguf.quants.dequantize` (vectorised numpy) and converted to the run dtype one at a
time, so peak memory stays near the final model size. llama.cpp's converter permutes the Q/K rows of
`llama` models for its own RoPE layout; that is undone here to get HF's rotate-half layout.
HF: `config.json` + `*.safetensors`. Tokenizers come from transformers; the one converted from a GGUF
file is cached on disk because the conversion takes seconds to tens of seconds.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .ggml import Q6K_BLOCK_VALUES, Q6KBlocks, q6k_kernels
from .llama import LlamaModel, weight_shapes
from .model_config import ModelConfig, ModelConfigError
from .q4k import Q4K_BLOCK_VALUES, Q4KBlocks, q4k_kernels
from .quant import Int4Groups
from .runner import TorchModelRunner, resolve_dtype

logger = logging.getLogger(__name__)

_HOW_TO = "Pass a .gguf file or a Hugging Face model directory holding config.json and *.safetensors."


class ModelLoadError(ValueError):
    """The model at the given path cannot be loaded; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------------------------- GGUF
@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # HF order (GGUF stores dims innermost first)
    qtype: Any  # gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFArray:
    """A metadata array we skipped rather than decoded (the vocabulary, merges): only its length."""

    length: int


class GGUFFile:
    """Header of a GGUF file (v2/v3, little-endian): metadata dict and tensor table; data stays on disk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import gguf

        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        size = self.path.stat().st_size
        if size < 24:
            raise ModelLoadError(f"{self.path} is not a GGUF file: it is only {size} bytes long")
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            magic = bytes(buf[:4])
            if struct.unpack_from("<I", buf, 0)[0] != gguf.GGUF_MAGIC:
                raise ModelLoadError(
                    f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'). {_HOW_TO}"
                )
            try:
                self._parse(buf, size, gguf)
            except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
                if isinstance(e, ModelLoadError):
                    raise
                raise ModelLoadError(
                    f"{self.path} is truncated or corrupt: its GGUF header cannot be read ({e}). "
                    "Re-download or re-assemble the file and check its sha256."
                ) from e

    def _parse(self, buf: mmap.mmap, size: int, gguf: Any) -> None:
        pos = 4
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, pos)
        pos += 20
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (only 2 and 3)")
        if n_tensors > size or n_kv > size:  # each entry takes bytes; larger counts mean garbage
            raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
        vt = gguf.GGUFValueType
        scalars = {
            vt.UINT8: "<B", vt.INT8: "<b", vt.UINT16: "<H", vt.INT16: "<h", vt.UINT32: "<I", vt.INT32: "<i",
            vt.FLOAT32: "<f", vt.BOOL: "<?", vt.UINT64: "<Q", vt.INT64: "<q", vt.FLOAT64: "<d",
        }  # fmt: skip

        def read_str(p: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, p)
            if p + 8 + n > size:
                raise ValueError("string runs past the end of the file")
            return bytes(buf[p + 8 : p + 8 + n]).decode("utf-8"), p + 8 + n

        def read_value(p: int, kind: int) -> tuple[Any, int]:
            kind = vt(kind)
            if kind in scalars:
                fmt = scalars[kind]
                return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
            if kind == vt.STRING:
                return read_str(p)
            if kind == vt.ARRAY:
                item_kind, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                item_kind = vt(item_kind)
                if item_kind in scalars:  # numeric arrays in one go
                    dtype = np.dtype(scalars[item_kind])
                    end = p + count * dtype.itemsize
                    if end > size:
                        raise ValueError("array runs past the end of the file")
                    return np.frombuffer(buf, dtype=dtype, count=count, offset=p).copy(), end
                if item_kind == vt.STRING:  # skip: walk the lengths only
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, p)
                        p += 8 + n
                    if p > size:
                        raise ValueError("array runs past the end of the file")
                    return GGUFArray(count), p
                items = []
                for _ in range(count):
                    item, p = read_value(p, item_kind)
                    items.append(item)
                return items, p
            raise ValueError(f"unknown metadata value type {kind}")

        for _ in range(n_kv):
            key, pos = read_str(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            self.metadata[key], pos = read_value(pos + 4, kind)

        infos = []
        for _ in range(n_tensors):
            name, pos = read_str(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            qtype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, dims, qtype, offset))

        alignment = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        for name, dims, qtype, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(qtype)
            except ValueError:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown GGML type {qtype}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise ValueError(
                    f"tensor {name!r}: row length {dims[0]} is not a multiple of block size {block}"
                )
            nbytes = n_elements // block * type_size
            start = data_start + offset
            if start + nbytes > size:
                raise ModelLoadError(
                    f"{self.path} is truncated: tensor {name!r} needs bytes {start}..{start + nbytes} but the "
                    f"file has {size}. Re-download or re-assemble the file and check its sha256."
                )
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = GGUFTensor(name, shape, qtype, start, nbytes)

    def dequantize(self, name: str, data: np.ndarray, rows: int | None = None) -> np.ndarray:
        """Float32 array of tensor `name` in HF shape; `data` is the whole file as a uint8 memmap.
        `rows`: only the first that many rows (of a 2-D tensor), as [rows, row length]."""
        import gguf.quants as gq

        t = self.tensors[name]
        total = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        shape = t.shape if rows is None else (rows, t.shape[-1])
        rows = total if rows is None else rows
        raw = data[t.offset : t.offset + t.nbytes // total * rows].reshape(rows, -1)
        if t.qtype.name == "F32":
            return np.array(raw.view(np.float32).reshape(shape))  # copy out of the memmap
        # gguf.quants.dequantize splits its input into 16-row groups (Python overhead per group); its
        # per-type `dequantize_rows` is the same vectorised code without the grouping, ~1.7x faster here.
        # Chunks of ~512k values keep its float32 temporaries cache-sized and memory bounded.
        quant = getattr(gq, t.qtype.name, None)
        rows_fn = getattr(quant, "dequantize_rows", None)
        fn = rows_fn if callable(rows_fn) else (lambda block: gq.dequantize(block, t.qtype))
        out = np.empty((rows, t.shape[-1]), dtype=np.float32)
        step = max(1, (1 << 19) // max(1, t.shape[-1]))
        for r in range(0, rows, step):
            out[r : r + step] = fn(raw[r : r + step]).reshape(-1, t.shape[-1])
        return out.reshape(shape)

    def q4k_groups(self, name: str, data: np.ndarray) -> Int4Groups | None:
        """Tensor `name`'s Q4_K codes with each 32-value group's scale and low end, exactly as stored
        (w = low + code * scale, computed in float32 as gguf dequantises), in HF shape; None for
        another type, or where gguf's own dequantisation of the first rows disagrees (a layout this
        reading does not know)."""
        import gguf.quants as gq

        t = self.tensors[name]
        if t.qtype.name != "Q4_K" or len(t.shape) != 2 or not hasattr(gq.Q4_K, "get_scale_min"):
            return None
        rows, cols = t.shape
        blocks = data[t.offset : t.offset + t.nbytes].reshape(-1, 144)  # 256 values per block
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
        sc, mn = gq.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(rows, cols // 32)
        low = -(dmin * mn.astype(np.float32)).reshape(rows, cols // 32)
        # 32 bytes hold two sub-blocks: the low nibbles the first, the high nibbles the second.
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & np.uint8(0x0F)).reshape(rows, cols)
        check = min(rows, 16)
        rebuilt = (
            low[:check, :, None] + codes[:check].reshape(check, -1, 32) * scale[:check, :, None]
        ).reshape(check, cols)
        if not np.array_equal(rebuilt, self.dequantize(name, data, rows=check)):
            logger.warning(
                "%s: Q4_K codes do not reproduce gguf's dequantisation; using the dense path", name
            )
            return None
        return Int4Groups(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low))

    def q6k_blocks(self, name: str, data: np.ndarray) -> Q6KBlocks | None:
        """Tensor `name`'s Q6_K blocks as stored (row after row, HF shape); None for another type."""
        t = self.tensors[name]
        if t.qtype.name != "Q6_K" or len(t.shape) != 2 or t.shape[1] % Q6K_BLOCK_VALUES:
            return None
        rows, cols = t.shape
        raw = np.array(data[t.offset : t.offset + t.nbytes]).reshape(rows, -1)
        return Q6KBlocks(torch.from_numpy(raw), (rows, cols))

    def q4k_blocks(self, name: str, data: np.ndarray) -> Q4KBlocks | None:
        """Tensor `name`'s Q4_K blocks as stored (row after row, HF shape); None for another type."""
        t = self.tensors[name]
        if t.qtype.name != "Q4_K" or len(t.shape) != 2 or t.shape[1] % Q4K_BLOCK_VALUES:
            return None
        rows, cols = t.shape
        raw = np.array(data[t.offset : t.offset + t.nbytes]).reshape(rows, -1)
        return Q4KBlocks(torch.from_numpy(raw), (rows, cols))


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "attn_output.bias": "o_bias",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "norm",
    "output.weight": "lm_head",
    "rope_freqs.weight": "rope_freqs",
}


def _canonical(name: str, top: dict[str, str], layer_pattern: str, layer_names: dict[str, str]) -> str | None:
    """Map a checkpoint's tensor name to ours (`embed`, `layers.N.q`, ...); None for tensors we skip."""
    if name in top:
        return top[name]
    m = re.fullmatch(layer_pattern, name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


def _gguf_canonical(name: str) -> str | None:
    return _canonical(name, _GGUF_TOP_NAMES, r"blk\.(\d+)\.(.+)", _GGUF_LAYER_NAMES)


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: it stores each head's rows as interleaved (even, odd) pairs;
    HF's rotate-half wants the first halves of the pairs, then the second halves."""
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(gf: GGUFFile) -> ModelConfig:
    try:
        config = ModelConfig.from_gguf_metadata(gf.metadata, {n: t.shape for n, t in gf.tensors.items()})
    except (ModelConfigError, TypeError, ValueError) as e:  # also per-layer arrays where scalars belong
        raise ModelLoadError(f"{gf.path}: unsupported or inconsistent GGUF metadata: {e}") from e
    if not config.name:
        config.name = gf.path.stem
    return config


def _load_gguf_weights(
    gf: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
    codes: dict[str, Int4Groups | Q6KBlocks | Q4KBlocks] | None = None,
) -> dict[str, torch.Tensor]:
    """The dense weights by canonical name; with `codes`, also fills it with the Q4_K tensors' blocks
    where the Q4_K kernel runs here (else their int4 codes) and, where the Q6_K kernel runs here, the
    Q6_K tensors' blocks."""
    expected = weight_shapes(config)
    wanted: dict[str, str] = {}  # canonical -> gguf name
    for name in gf.tensors:
        canonical = _gguf_canonical(name)
        if canonical is not None and (canonical in expected or canonical == "rope_freqs"):
            wanted[canonical] = name
    missing = [n for n in expected if n not in wanted]
    if missing:
        raise ModelLoadError(
            f"{gf.path} lacks tensors this {config.architecture} model needs: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. The file is incomplete or was "
            "converted for a different architecture."
        )
    for canonical, name in wanted.items():
        if canonical in expected and gf.tensors[name].shape != expected[canonical]:
            raise ModelLoadError(
                f"{gf.path}: tensor {name!r} has shape {gf.tensors[name].shape}, expected "
                f"{expected[canonical]} from the metadata; the file is corrupt or inconsistent."
            )
    unsupported = sorted({gf.tensors[n].qtype.name for n in wanted.values()} - _dequantizable())
    if unsupported:
        raise ModelLoadError(
            f"{gf.path} uses GGML types {unsupported} that gguf {_gguf_version()} cannot dequantise; "
            "upgrade the gguf package or use another quantisation of the model."
        )

    data = np.memmap(gf.path, dtype=np.uint8, mode="r")
    weights: dict[str, torch.Tensor] = {}
    q6k_kernels_ok = codes is not None and q6k_kernels() is not None
    q4k_kernels_ok = codes is not None and q4k_kernels() is not None
    permuted = config.architecture == "llama"
    items = tqdm(list(wanted.items()), desc=f"loading {gf.path.name}", unit="tensor", disable=not progress)
    for canonical, name in items:
        array = gf.dequantize(name, data)
        if permuted and canonical.rsplit(".", 1)[-1] in ("q", "q_bias", "k", "k_bias"):
            heads = config.num_heads if canonical.rsplit(".", 1)[-1].startswith("q") else config.num_kv_heads
            array = _unpermute_rows(array, heads)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        weights[canonical] = tensor if canonical == "rope_freqs" else tensor.to(device=device, dtype=dtype)
        del array, tensor
        if codes is None or canonical not in expected:
            continue
        if q6k_kernels_ok and (blocks := gf.q6k_blocks(name, data)) is not None:
            if not (permuted and canonical.rsplit(".", 1)[-1] in ("q", "k")):  # rows as stored
                codes[canonical] = blocks
            continue
        if q4k_kernels_ok and (q4k := gf.q4k_blocks(name, data)) is not None:
            if permuted and canonical.rsplit(".", 1)[-1] in ("q", "k"):  # whole rows move: blocks follow
                heads = config.num_heads if canonical.endswith("q") else config.num_kv_heads
                q4k = Q4KBlocks(
                    torch.from_numpy(_unpermute_rows(q4k.blocks.numpy(), heads).copy()), q4k.shape
                )
            codes[canonical] = q4k
            continue
        groups = gf.q4k_groups(name, data)
        if groups is not None:
            if permuted and canonical.rsplit(".", 1)[-1] in ("q", "k"):
                heads = config.num_heads if canonical.endswith("q") else config.num_kv_heads
                groups = Int4Groups(
                    *(
                        torch.from_numpy(_unpermute_rows(g.numpy(), heads).copy())
                        for g in vars(groups).values()
                    )
                )
            codes[canonical] = groups
    return weights


def _dequantizable() -> set[str]:
    import gguf
    import gguf.quants as gq

    quantized = {
        q.name for q in gguf.GGMLQuantizationType if hasattr(getattr(gq, q.name, None), "dequantize_rows")
    }
    return {"F32", "F16"} | quantized


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001 - only used in a message
        return "(unknown version)"


# ------------------------------------------------------------------------------------ HF directory
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o",
    "self_attn.o_proj.bias": "o_bias",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}


def _hf_canonical(name: str) -> str | None:
    return _canonical(name, _HF_TOP_NAMES, r"model\.layers\.(\d+)\.(.+)", _HF_LAYER_NAMES)


def _hf_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} is a directory but has no config.json. {_HOW_TO}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(
            f"{config_path} is not valid JSON ({e}); restore it from the model's source"
        ) from e
    try:
        config = ModelConfig.from_hf_config(raw)
    except ModelConfigError as e:
        raise ModelLoadError(f"{config_path}: {e}") from e
    if not config.name:
        config.name = directory.name
    return config


def _load_hf_weights(
    directory: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, progress: bool
) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        extra = " (pytorch_model.bin checkpoints are not supported)" if any(directory.glob("*.bin")) else ""
        raise ModelLoadError(f"{directory} has config.json but no *.safetensors weights{extra}. {_HOW_TO}")
    expected = weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(
        files, desc=f"loading {directory.name}", unit="file", disable=not progress or len(files) < 2
    ):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    canonical = _hf_canonical(key)
                    if canonical in expected:
                        weights[canonical] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file} cannot be read ({e}); the file is corrupt or incomplete") from e
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ModelLoadError(
            f"{directory} lacks weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. "
            "Check that every safetensors shard is present."
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{directory}: weight {name} has shape {tuple(weights[name].shape)}, expected {shape} from config.json"
            )
    return weights


# ------------------------------------------------------------------------------------- tokenizers
def _cache_root() -> Path:
    root = os.environ.get("SPECVERIFY_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "specverify"


def _gguf_tokenizer(path: Path) -> Any:
    """transformers' GGUF tokenizer conversion, cached per file (name, size, mtime) with save_pretrained."""
    from transformers import AutoTokenizer

    stat = path.stat()
    key = re.sub(r"[^A-Za-z0-9._-]", "_", f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}")
    cached = _cache_root() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # noqa: BLE001 - a broken cache entry is rebuilt, not fatal
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
    logger.info("converting the tokenizer of %s (cached afterwards under %s)", path.name, cached)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"cannot build a tokenizer from {path}: {e}") from e
    if tokenizer.chat_template is None and isinstance(template := _gguf_chat_template(path), str):
        tokenizer.chat_template = template
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=key + ".", dir=cached.parent))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cached)  # atomic: a concurrent loader sees all of it or none
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except OSError as e:
        logger.warning("cannot cache the tokenizer under %s: %s", cached, e)
    return tokenizer


def _gguf_chat_template(path: Path) -> Any:
    try:
        return GGUFFile(path).metadata.get("tokenizer.chat_template")
    except ModelLoadError:
        return None


def _hf_tokenizer(directory: Path) -> Any:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / n).is_file() for n in names):
        logger.warning("%s has no tokenizer files; returning no tokenizer", directory)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {e}") from e


# ------------------------------------------------------------------------------------- public API
def _resolve(path: str | os.PathLike[str]) -> tuple[Path, str]:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"no such model file or directory: {p}. {_HOW_TO}")
    if p.is_dir():
        return p, "hf"
    if p.suffix.lower() == ".gguf":
        return p, "gguf"
    with open(p, "rb") as f:  # a GGUF file under another name is still a GGUF file
        if f.read(4) == b"GGUF":
            return p, "gguf"
    raise ModelLoadError(f"{p} is neither a .gguf file nor a directory. {_HOW_TO}")


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model's `ModelConfig` without loading any weights (fast)."""
    p, kind = _resolve(path)
    return _gguf_config(GGUFFile(p)) if kind == "gguf" else _hf_config(p)


def model_name(path: str | os.PathLike[str]) -> str:
    """A human-readable model name: GGUF `general.name`, else the file stem / directory name."""
    p = Path(path).expanduser()
    try:
        return load_config(p).name
    except ModelLoadError:
        return p.stem if p.suffix.lower() == ".gguf" else p.name


def load_model(
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    progress: bool = True,
    int4_rows: int = 0,
) -> tuple[LlamaModel, ModelConfig]:
    """Build the `LlamaModel` (weights in `dtype` on `device`; "auto": see `resolve_dtype`) and its config.
    `int4_rows` > 0: a GGUF file's Q4_K weights also keep their blocks for the Q4_K kernel where it runs
    here (`q4k.py`, forwards over at most `Q4K_ROWS` rows), else their codes for the CPU int4 kernel,
    used by forwards over at most `int4_rows` rows (see `LlamaModel.use_checkpoint_codes`; bf16 or
    float32 on the CPU), and where the Q6_K kernel runs here (`ggml.py`) its Q6_K weights keep their
    blocks for it."""
    from .quant import can_quantize_weights

    torch_dtype = resolve_dtype(dtype, device)
    torch_device = torch.device(device)
    p, kind = _resolve(path)
    codes: dict[str, Int4Groups | Q6KBlocks | Q4KBlocks] | None = None
    if kind == "gguf":
        gf = GGUFFile(p)
        config = _gguf_config(gf)
        if int4_rows > 0 and can_quantize_weights(torch_dtype, torch_device):
            codes = {}
        weights = _load_gguf_weights(gf, config, torch_dtype, torch_device, progress, codes)
    else:
        config = _hf_config(p)
        weights = _load_hf_weights(p, config, torch_dtype, torch_device, progress)
    try:
        model = LlamaModel.from_weights(config, weights, dtype=torch_dtype, device=torch_device, consume=True)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{p}: {e}") from e
    if codes:
        model.use_checkpoint_codes(codes, int4_rows)
    return model, config


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The transformers tokenizer (with its chat template) for a GGUF file or HF directory; None for an HF
    directory that has no tokenizer files."""
    p, kind = _resolve(path)
    return _gguf_tokenizer(p) if kind == "gguf" else _hf_tokenizer(p)


def load_runner(
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    *,
    with_tokenizer: bool = True,
    progress: bool = True,
    pack_weights: bool | None = None,
    int4_rows: int = 0,
) -> tuple[TorchModelRunner, Any]:
    """Load a `.gguf` file or HF directory: `(runner, tokenizer)`. The tokenizer is None when
    `with_tokenizer` is false (e.g. a draft sharing the target's tokenizer) or the directory has none.
    `pack_weights`: see `TorchModelRunner` (None: oneDNN-packed weights on the CPU when available).
    `int4_rows`: see `load_model`. Raises `ModelLoadError` with what is wrong and what to do."""
    model, config = load_model(path, dtype=dtype, device=device, progress=progress, int4_rows=int4_rows)
    try:
        runner = TorchModelRunner(
            model,
            config,
            device=device,
            dtype=model.embed.dtype,
            max_model_len=max_model_len,
            pack_weights=pack_weights,
        )
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return runner, tokenizer
