"""The command line on the small real model, and its errors."""

import json
import subprocess
import sys

import pytest
from conftest import TEST_DEVICE

from specverify.models.assets import smollm2_path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specverify.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **_home()},
    )


def _home() -> dict:
    import os

    # CUDA_VISIBLE_DEVICES and LD_LIBRARY_PATH: what a CUDA TEST_DEVICE may need to be found.
    keep = ("HOME", "SPECVERIFY_CACHE", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH")
    return {k: v for k, v in os.environ.items() if k in keep}


@pytest.mark.integration
def test_generate_with_speculation_prints_the_completion() -> None:
    model = str(smollm2_path())
    spec = json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    result = run_cli(
        "generate",
        "--prompt",
        "Name a colour.",
        "--model",
        model,
        "--speculative-config",
        spec,
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--device",
        str(TEST_DEVICE),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "drafted" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--speculative-config", "{oops"], "not valid JSON"),
        (["--speculative-config", '{"num_speculative_tokens": 0}'], "num_speculative_tokens"),
        (["--no-speculation", "--temperature", "-1"], "temperature"),
        (["--no-speculation", "--model", "/nonexistent/model.gguf"], "nonexistent"),
    ],
)
def test_bad_input_is_a_clear_error(args, message) -> None:
    result = run_cli("generate", "--prompt", "hi", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
