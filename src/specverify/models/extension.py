"""Compiling this package's C++ kernels for the machine they run on (CPU).

Each kernel file is built once per machine on first use by torch's C++ extension builder (`ninja`,
~30 s), with -march=native, so the build is keyed by the CPU's flags too and cached under
~/.cache/torch_extensions. Callers decide what a failure means (their dense or PyTorch path stays).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType


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
