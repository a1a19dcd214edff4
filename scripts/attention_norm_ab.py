"""Whole forwards of the default draft and target with and without the attention kernel
(`models/attention.py`) and the one-pass RMSNorm (`models/norm.py`), interleaved in one process: per
case (model, requests x rows each), the best of `--repeats` runs of 5 forwards over 300-token contexts.

    .venv/bin/python scripts/attention_norm_ab.py [--cases draft:1x1,draft:4x1,target:1x1,target:16x1,target:32x1]
"""

from __future__ import annotations

import argparse
import time

import torch

from specverify.llm import load_models
from specverify.models import attention, norm
from specverify.models.llama import KVCache, SeqChunk

VARIANTS = ("both", "no attention kernel", "no norm kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default="draft:1x1,draft:4x1,target:1x1,target:6x1,target:16x1,target:32x1"
    )
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    loaded = load_models(progress=False, speculative=True, draft_quantization="int4", draft_vocab_size=65536)
    kernels = {"attention": attention.attention_kernel(), "norm": norm.norm_kernel()}
    print(f"kernels built: {', '.join(k for k, m in kernels.items() if m is not None) or 'none'}")
    print(f"{'case':>14} " + " ".join(f"{v:>20}" for v in VARIANTS) + "   (ms per forward)")
    for case in args.cases.split(","):
        which, shape = case.split(":")
        seqs, rows = (int(x) for x in shape.split("x"))
        runner = loaded.draft if which == "draft" else loaded.target
        times = time_case(runner, seqs, rows, args.repeats, kernels)
        print(f"{case:>14} " + " ".join(f"{min(times[v]):20.1f}" for v in VARIANTS))
    attention._module, norm._module = kernels["attention"], kernels["norm"]


def time_case(runner, seqs: int, rows: int, repeats: int, kernels) -> dict[str, list[float]]:
    model, config = runner.model, runner.config
    caches = [KVCache(config, runner.dtype, runner.device) for _ in range(seqs)]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with torch.inference_mode():
        for cache in caches:
            cache.reserve(512, 4096)
            model(
                torch.randint(0, 1000, (300,)),
                torch.arange(300),
                [SeqChunk(0, 300, cache)],
                torch.tensor([0]),
            )
            cache.length = 300  # later forwards overwrite the positions after the context

        def forward() -> None:
            chunks = [SeqChunk(i * rows, (i + 1) * rows, c) for i, c in enumerate(caches)]
            positions = torch.arange(300, 300 + rows).repeat(seqs)
            ids = torch.randint(0, 1000, (seqs * rows,))
            model(ids, positions, chunks, torch.arange(seqs) * rows + rows - 1, head=runner._head)

        for _ in range(repeats):
            for v in VARIANTS:
                attention._module = None if v == "no attention kernel" else kernels["attention"]
                norm._module = None if v == "no norm kernel" else kernels["norm"]
                forward()
                start = time.perf_counter()
                for _ in range(5):
                    forward()
                times[v].append((time.perf_counter() - start) / 5 * 1e3)
    return times


if __name__ == "__main__":
    main()
