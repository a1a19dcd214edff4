"""Compiling this package's C++ kernels for the machine they run on (CPU).

Each kernel file is built once per machine on first use by torch's C++ extension builder (`ninja`,
~30 s), with -march=native, so the build is keyed by the CPU's flags too and cached under
~/.cache/torch_extensions. Callers decide what a failure means (their dense or PyTorch path stays).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

# The dtypes the CPU kernels that take activations as stored (attention, RMSNorm) are built for.
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_extension(prefix: str, source: str) -> ModuleType:
    """Compile `source` (a file beside this one) for this CPU with OpenMP; raises where it cannot."""
    from torch.utils.cpp_extension import load

    tag = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return load(
        name=f"{prefix}_{tag}",
        sources=[str(Path(__file__).with_name(source))],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def checked_extension(
    prefix: str, source: str, switch: str, what: str, fallback: str, self_check: Callable[[ModuleType], None]
) -> ModuleType | None:
    """`build_extension`, then `self_check` on the module; None where the environment variable
    `switch` is "0" or the build or check fails (logged: `what` unavailable, `fallback` stays)."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        logger.info("loading the %s (built on first use on this machine, ~30 s)", what)
        module = build_extension(prefix, source)
        self_check(module)
    except Exception as e:  # noqa: BLE001 - any build or check failure keeps the caller's other path
        logger.warning("%s unavailable (%s: %s); %s stays", what, type(e).__name__, e, fallback)
        return None
    return module
