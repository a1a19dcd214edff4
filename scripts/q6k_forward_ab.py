"""The default target's forward with and without the Q6_K kernel (`models/ggml.py`), side by side in one
process: per row count, the best of three interleaved runs of 8 forwards over a 300-token context.

    .venv/bin/python scripts/q6k_forward_ab.py [--rows 1,2,3,4]
"""

from __future__ import annotations

import argparse
import time

import torch

from specverify.llm import load_models
from specverify.models.ggml import Q6KWeight
from specverify.models.llama import KVCache, SeqChunk, SplitWeight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4", help="row counts to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]

    runner = load_models(speculative=False, progress=True).target
    model = runner.model
    weights = [w for layer in model.layers for w in (layer.wqkv, layer.w_down)] + [model.lm_head]
    splits = [w for w in weights if isinstance(w, SplitWeight)]  # Q4_K q, k beside a Q6_K v
    q6k = [w for w in weights + [p for s in splits for p in s.parts] if isinstance(w, Q6KWeight)]
    if not q6k:
        raise SystemExit("the Q6_K kernel is not in use here (see the log above for why)")
    kernel_rows = 1 << 30
    cache = KVCache(runner.config, runner.dtype, runner.device)
    cache.reserve(512, 4096)
    context = 300

    def forward(rows: int) -> None:
        start = cache.length
        tokens = torch.randint(0, 1000, (rows,))
        model(tokens, torch.arange(start, start + rows), [SeqChunk(0, rows, cache)])

    times: dict[tuple[int, bool], list[float]] = {}
    with torch.inference_mode():
        tokens = torch.randint(0, 1000, (context,))
        model(
            tokens,
            torch.arange(context),
            [SeqChunk(0, context, cache)],
            logit_rows=torch.tensor([context - 1]),
        )
        cache.length = context  # later forwards overwrite the positions after the context
        for _ in range(args.repeats):
            for rows in rows_list:
                for kernel in (False, True):
                    for w in q6k:
                        w.max_rows = kernel_rows if kernel else 0
                    for w in splits:
                        w.max_rows = min(p.max_rows for p in w.parts)
                    forward(rows)
                    t = time.perf_counter()
                    for _ in range(8):
                        forward(rows)
                    times.setdefault((rows, kernel), []).append((time.perf_counter() - t) / 8 * 1e3)
    print(f"{len(q6k)} Q6_K weights; ms per forward (best of {args.repeats}):")
    for rows in rows_list:
        dense, kernel = min(times[(rows, False)]), min(times[(rows, True)])
        print(
            f"rows={rows}: dense {dense:.1f}  Q6_K kernel {kernel:.1f}  dense / kernel {dense / kernel:.2f}"
        )


if __name__ == "__main__":
    main()
