"""Every way a model path can be wrong ends in a ModelLoadError that says what is wrong and what to do."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import write_tiny_gguf

from specverify.models.loader import ModelLoadError, load_config, load_runner, model_name

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_nonexistent_path(tmp_path):
    with pytest.raises(
        ModelLoadError, match=r"no such model file or directory.*\.gguf file or a Hugging Face"
    ):
        load_runner(tmp_path / "missing.gguf")


def test_random_bytes_named_gguf(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_runner(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_runner(path)


def test_other_file_type(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a directory"):
        load_runner(path)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf, tmp_path_factory):
    _, hf = tiny_hf("llama")
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_tiny_gguf_loads(tiny_gguf, device):
    runner, tokenizer = load_runner(
        tiny_gguf, dtype="float32", device=device, with_tokenizer=False, progress=False
    )
    assert tokenizer is None and runner.vocab_size == 128
    assert model_name(tiny_gguf) == "tiny-llama"


@pytest.mark.parametrize("where", ["data", "header"])
def test_truncated_gguf(tiny_gguf, tmp_path, where):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2 if where == "data" else 200])
    with pytest.raises(ModelLoadError, match=r"truncated.*Re-download"):
        load_runner(path, with_tokenizer=False, progress=False)


@pytest.mark.integration
def test_truncated_real_gguf(smollm2_gguf, tmp_path):
    path = tmp_path / "half.gguf"
    with open(smollm2_gguf, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match=r"is truncated: tensor .* file has"):
        load_runner(path, progress=False)


def test_unsupported_architecture(tiny_hf, tmp_path):
    _, hf = tiny_hf("llama")
    path = write_tiny_gguf(hf, tmp_path / "gemma.gguf", architecture="gemma")
    with pytest.raises(
        ModelLoadError, match=r"architecture 'gemma' is not supported; supported: llama, qwen2"
    ):
        load_runner(path, with_tokenizer=False, progress=False)


def test_missing_tensor(tiny_hf, tmp_path):
    _, hf = tiny_hf("llama")
    path = write_tiny_gguf(hf, tmp_path / "holey.gguf", omit=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelLoadError, match=r"lacks tensors .*layers\.1\.up"):
        load_runner(path, with_tokenizer=False, progress=False)


def test_hf_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_runner(tmp_path)


def test_hf_dir_without_weights(tiny_hf, tmp_path):
    directory, _ = tiny_hf("qwen2")
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_runner(tmp_path)


def test_hf_dir_with_corrupt_weights(tiny_hf, tmp_path):
    directory, _ = tiny_hf("qwen2")
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(os.urandom(100))
    with pytest.raises(ModelLoadError, match="corrupt or incomplete"):
        load_runner(tmp_path)


def test_hf_dir_unsupported_model_type(tiny_hf, tmp_path):
    directory, _ = tiny_hf("qwen2")
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model_type 'mamba' is not supported"):
        load_config(tmp_path)
    assert model_name(tmp_path) == tmp_path.name  # the name still works for messages
