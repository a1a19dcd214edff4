"""One matmul on int4 weights (32-value groups): the VNNI kernel (`models/int4_kernel.py`) against PyTorch's
int4 kernel and packed bf16, interleaved in one process; per shape and row count, the best of the runs.

    .venv/bin/python scripts/int4_matmul_ab.py [--rows 1,2,4,6,8] [--repeats 25] [--threads 2] [--per-row]
"""

from __future__ import annotations

import argparse
import time

import torch

from specverify.models.int4_kernel import int4_kernels, int4_matmul, int4_pack
from specverify.models.llama import PackedWeight, linear
from specverify.models.quant import _min_max_groups

# (K, N): the draft's gate/up and down, its restricted LM head, a 1.5B target's gate/up and down.
SHAPES = [(896, 4864), (4864, 896), (896, 65536), (1536, 8960), (8960, 1536)]


def copies(t: torch.Tensor, total: float = 128e6) -> list[torch.Tensor]:
    return [t] + [t.clone() for _ in range(int(total // (t.numel() * t.element_size())))]


def rotate(items: list, fn):
    state = iter(())

    def call():
        nonlocal state
        item = next(state, None)
        if item is None:
            state = iter(items)
            item = next(state)
        return fn(item)

    return call


def best_ms(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,6,8")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--per-row", action="store_true", help="one activation scale per row")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    module = int4_kernels()
    if module is None:
        raise SystemExit("the int4 kernel is not available here (see the log)")
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; ms per matmul, best of {args.repeats} interleaved runs")
    print(
        f"{'K->N':>12} {'rows':>4} {'kernel':>8} {'torch4':>8} {'bf16':>8} {'t4/kern':>8} {'bf16/kern':>9} GB/s"
    )
    for k, n in SHAPES:
        w = (torch.randn(n, k) * 0.02).bfloat16()
        groups = _min_max_groups(w.float(), 32)
        # Copies of each form, used in turn, so that every call streams its weight from memory (more
        # than the 32 MiB L3), as a forward through a whole model does.
        packed = copies(int4_pack(module, groups.codes, groups.scale, groups.low))
        qweight = copies(torch._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32), 8))
        scales = torch.stack((groups.scale, groups.low + 8 * groups.scale), -1).transpose(0, 1).contiguous()
        scales = scales.bfloat16()
        dense = [PackedWeight(c) for c in copies(w)]
        del w, groups
        calls = max(2, int(2e7 // (n * k)))  # short samples: many of them miss a busy neighbour
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            fns = {
                "kernel": rotate(packed, lambda p, x=x, n=n: int4_matmul(module, x, p, n, args.per_row)),
                "torch4": rotate(
                    qweight, lambda q, x=x, s=scales: torch._weight_int4pack_mm_for_cpu(x, q, 32, s)
                ),
                "bf16": rotate(dense, lambda d, x=x: linear(x, d)),
            }
            times: dict[str, list[float]] = {name: [] for name in fns}
            for fn in fns.values():
                fn()
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    times[name].append(best_ms(fn, calls))
            t = {name: min(v) for name, v in times.items()}
            gbs = packed[0].numel() / t["kernel"] / 1e6
            print(
                f"{k:>5}->{n:<6} {rows:>4} {t['kernel']:8.3f} {t['torch4']:8.3f} {t['bf16']:8.3f} "
                f"{t['torch4'] / t['kernel']:8.2f} {t['bf16'] / t['kernel']:9.2f} {gbs:5.1f}"
            )


if __name__ == "__main__":
    main()
