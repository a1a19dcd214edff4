"""Whole forwards of the default draft (int4, draft vocabulary) and target with the VNNI int4 kernel
(`models/int4_kernel.py`) against PyTorch's int4 kernel and the dense bf16 path, interleaved in one
process (per row count, the best of the runs of 8 forwards over a 300-token context); then the next-token
distributions over real text, kernel vs PyTorch's int4 (draft) and vs the dense bf16 forward (both).

The target's Q4_K weights run through `QuantizedWeight` only where `q4k.py`'s kernel is off, so this
sets SPECVERIFY_Q4K_KERNEL=0 unless --keep-q4k.

    .venv/bin/python scripts/int4_forward_ab.py [--rows 1,2,3,4,6,8] [--models draft,target] [--no-timing]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8", help="row counts to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="draft,target")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--keep-q4k", action="store_true", help="leave q4k.py's kernel on")
    parser.add_argument("--positions", type=int, default=400)
    args = parser.parse_args()
    if not args.keep_q4k:
        os.environ["SPECVERIFY_Q4K_KERNEL"] = "0"

    from specverify.llm import load_models
    from specverify.models import quant
    from specverify.models.llama import ROW_LIMITED, KVCache, SeqChunk
    from specverify.models.quant import QuantizedWeight

    # Keep PyTorch's int4 form next to the kernel's, to switch between them per forward.
    real_pack = quant.int4_pack
    torch_forms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def both(module, codes, scale, low):
        packed = real_pack(module, codes, scale, low)
        scale, low = scale.float(), low.float()
        qweight = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 8)
        scales = torch.stack((scale, low + 8 * scale), -1).transpose(0, 1).contiguous().bfloat16()
        torch_forms[packed.data_ptr()] = (qweight, scales)
        return packed

    quant.int4_pack = both
    names = args.models.split(",")
    loaded = load_models(
        progress=False,
        speculative="draft" in names,
        draft_quantization="int4",
        draft_vocab_size=65536,
    )
    quant.int4_pack = real_pack
    runners = {"target": loaded.target, "draft": loaded.draft}
    rows_list = [int(r) for r in args.rows.split(",")]

    for name in names:
        runner = runners[name]
        model = runner.model
        weights = [getattr(layer, a) for layer in model.layers for a in ("wqkv", "wo", "w_gate_up", "w_down")]
        weights += [model.lm_head, runner._head]
        limited = list({id(w): w for w in weights if isinstance(w, ROW_LIMITED)}.values())
        int4 = [w for w in limited if isinstance(w, QuantizedWeight) and w.packed is not None]
        forms = {id(w): (w.packed, *torch_forms[w.packed.data_ptr()]) for w in int4}
        default_rows = {id(w): w.max_rows for w in limited}
        print(f"\n== {name}: {len(int4)} int4 weights on the kernel, {len(limited)} row-limited in all")

        mode = functools.partial(set_mode, limited, int4, forms, default_rows)

        if not args.no_timing:
            time_forwards(runner, rows_list, args.repeats, mode, KVCache, SeqChunk)
        if not args.no_accuracy:
            accuracy(runner, loaded.tokenizer, args.positions, mode, quant)
        mode("kernel")
        for w in limited:
            w.max_rows = default_rows[id(w)]


def set_mode(limited, int4, forms, default_rows, m: str) -> None:
    """ "kernel" / "torch4": the int4 weights on that kernel at every row count, other row-limited weights
    (Q6_K) at their own limits; "dense": every weight on its dense path."""
    for w in limited:
        w.max_rows = 0 if m == "dense" else (1 << 30 if id(w) in forms else default_rows[id(w)])
    for w in int4:
        packed, qweight, scales = forms[id(w)]
        w.packed = packed if m == "kernel" else None
        w.qweight, w.scales = (qweight, scales) if m == "torch4" else (None, None)


def time_forwards(runner, rows_list, repeats, mode, KVCache, SeqChunk) -> None:  # noqa: N803
    model = runner.model
    cache = KVCache(runner.config, runner.dtype, runner.device)
    cache.reserve(512, 4096)
    context = 300

    def forward(rows: int) -> None:
        start = cache.length
        tokens = torch.randint(0, 1000, (rows,))
        model(tokens, torch.arange(start, start + rows), [SeqChunk(0, rows, cache)], head=runner._head)

    modes = ("kernel", "torch4", "dense")
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        mode("dense")
        tokens = torch.randint(0, 1000, (context,))
        model(tokens, torch.arange(context), [SeqChunk(0, context, cache)], logit_rows=torch.tensor([0]))
        cache.length = context  # later forwards overwrite the positions after the context
        for _ in range(repeats):
            for rows in rows_list:
                for m in modes:
                    mode(m)
                    forward(rows)
                    t = time.perf_counter()
                    for _ in range(8):
                        forward(rows)
                    times.setdefault((rows, m), []).append((time.perf_counter() - t) / 8 * 1e3)
    print(f"ms per forward (best of {repeats}), threads {torch.get_num_threads()}:")
    print(f"{'rows':>4} {'kernel':>7} {'torch4':>7} {'dense':>7} {'t4/kern':>8} {'dense/kern':>10}")
    for rows in rows_list:
        t = {m: min(times[(rows, m)]) for m in modes}
        print(
            f"{rows:>4} {t['kernel']:7.1f} {t['torch4']:7.1f} {t['dense']:7.1f} "
            f"{t['torch4'] / t['kernel']:8.2f} {t['dense'] / t['kernel']:10.2f}"
        )


def accuracy(runner, tokenizer, positions, mode, quant) -> None:
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text() + (root / "src/specverify/models/llama.py").read_text()
    tokens = tokenizer.encode(text)[:positions]

    def logits(m: str, per_row: bool = False) -> torch.Tensor:
        mode(m)
        real = quant.int4_matmul
        if per_row:
            quant.int4_matmul = functools.partial(real, per_row=True)
        try:
            out = runner.forward([99], [tokens], [len(tokens)])
        finally:
            quant.int4_matmul = real
            runner.release(99)
        return out.double()

    ref = {"dense": logits("dense"), "torch4": logits("torch4")}
    tests = {"kernel": logits("kernel"), "kernel, per-row x scale": logits("kernel", per_row=True)}
    tests["torch4"] = ref["torch4"]
    print(f"next-token distributions over {len(tokens)} positions of README.md + llama.py:")
    print(f"{'test':>24} {'vs':>7} {'mean KL':>9} {'max KL':>8} {'argmax agree':>13}")
    for ref_name, r in ref.items():
        lp = torch.log_softmax(r, -1)
        for test_name, t in tests.items():
            if test_name == ref_name:
                continue
            lq = torch.log_softmax(t, -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)
            agree = (r.argmax(-1) == t.argmax(-1)).double().mean().item()
            print(
                f"{test_name:>24} {ref_name:>7} {kl.mean().item():9.2e} {kl.max().item():8.2e} "
                f"{100 * agree:12.1f}%"
            )


if __name__ == "__main__":
    main()
