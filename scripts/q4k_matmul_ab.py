"""One matmul through the Q4_K kernel (`models/q4k.py`), oneDNN's packed bf16 GEMM and the int4 path
(`QuantizedWeight`: `int4_kernel.py`'s, or PyTorch's with SPECVERIFY_INT4_KERNEL=0), interleaved in one
process: per row count, the best of `--repeats` rounds, each a pass over `--copies` copies of the weight
(several: a forward reads its weights from memory, not from the 32 MB L3 one copy would sit in).

    .venv/bin/python scripts/q4k_matmul_ab.py [--rows 1,2,4,8] [--copies 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specverify.models.llama import PackedWeight, linear
from specverify.models.q4k import Q4KBlocks, Q4KWeight, q4k_kernels
from specverify.models.quant import Int4Groups, QuantizedWeight


def random_blocks(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n, k // 256 * 144), dtype=np.uint8)
    blocks.reshape(-1, 144)[:, 0:4] = np.full((n * k // 256, 2), 1e-3, dtype=np.float16).view(np.uint8)
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,6,8,12,16,24,32")
    parser.add_argument("--shapes", default="17920x1536,8960x1536,1536x8960", help="N x K, comma-separated")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    module = q4k_kernels()
    if module is None:
        raise SystemExit("the Q4_K kernel is not available here (see the log above for why)")
    rows_list = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weights: dict[str, list] = {"q4k": [], "bf16": [], "int4": []}
        for _ in range(args.copies):
            blocks = Q4KBlocks(torch.from_numpy(random_blocks(n, k, rng)), (n, k))
            dense = PackedWeight(torch.randn(n, k).bfloat16() / 64)
            groups = Int4Groups(
                torch.randint(0, 16, (n, k)), torch.rand(n, k // 32) / 1e3, -torch.rand(n, k // 32) / 1e2
            )
            weights["q4k"].append(Q4KWeight(blocks, dense, 1 << 20, module))
            weights["bf16"].append(dense)
            weights["int4"].append(
                QuantizedWeight(torch.empty(1, 1).expand(n, k), dense, 4, 32, 1 << 20, groups=groups)
            )
        times: dict[tuple[int, str], list[float]] = {}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for rows in rows_list:
                    x = torch.randn(rows, k).bfloat16()
                    for name, copies in weights.items():
                        linear(x, copies[-1])
                        t = time.perf_counter()
                        for w in copies:
                            linear(x, w)
                        times.setdefault((rows, name), []).append(
                            (time.perf_counter() - t) / len(copies) * 1e3
                        )
        print(f"N={n} K={k}: ms per matmul (best of {args.repeats}, {args.copies} copies)")
        for rows in rows_list:
            q, d, i = (min(times[(rows, name)]) for name in ("q4k", "bf16", "int4"))
            print(
                f"  M={rows:3d}  Q4_K kernel {q:6.3f}  bf16 {d:6.3f}  int4 {i:6.3f}"
                f"   bf16 / kernel {d / q:4.2f}  int4 / kernel {i / q:4.2f}"
            )


if __name__ == "__main__":
    main()
