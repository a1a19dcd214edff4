"""The default target's forward with the Q4_K kernel (`models/q4k.py`) against the current paths, side by
side in one process.

Timing (default): per row count, the best of `--repeats` interleaved runs of 8 forwards over a 300-token
context: "old" is the path without the kernel (the Q4_K weights' int4 codes at <= 4 rows, through
`int4_kernel.py` or, with SPECVERIFY_INT4_KERNEL=0, PyTorch's kernel; packed bf16 above), "new" the kernel at every row count. Accuracy (`--accuracy FILE`): the next-token distributions
over FILE's first tokens, run as chunks of `--chunk` rows, of the kernel forward (int8 activations per 256
and per 32 values) and of the int4 path against the dense bf16 forward: KL(dense || other) and argmax
agreement.

    .venv/bin/python scripts/q4k_forward_ab.py [--rows 1,2,4,8] [--accuracy FILE --tokens 400 --chunk 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specverify.llm import load_models, resolve_model_path
from specverify.models.ggml import Q6KWeight
from specverify.models.llama import KVCache, SeqChunk
from specverify.models.loader import GGUFFile
from specverify.models.q4k import Q4KWeight
from specverify.models.quant import Int4Groups, QuantizedWeight

_PARTS = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "w_gate_up": ("ffn_gate", "ffn_up")}
_PARTS["w_down"] = ("ffn_down",)


def int4_twins(model, path: str) -> dict[tuple[int, str], tuple[Q4KWeight, QuantizedWeight]]:
    """Each Q4_K kernel weight with the int4 copy the loader would have built without the kernel."""
    gf = GGUFFile(path)
    data = np.memmap(gf.path, dtype=np.uint8, mode="r")
    twins = {}
    for i, layer in enumerate(model.layers):
        for attr, parts in _PARTS.items():
            weight = getattr(layer, attr)
            if not isinstance(weight, Q4KWeight):
                continue
            groups = Int4Groups.cat([gf.q4k_groups(f"blk.{i}.{p}.weight", data) for p in parts])
            plain = torch.empty(1, 1).expand(*weight.shape)  # only its shape is read
            twins[(i, attr)] = (weight, QuantizedWeight(plain, weight.dense, 4, 32, 4, groups=groups))
    return twins


def use(model, twins, mode: str, group: int = 256) -> None:
    """mode "new": the kernel at every row count; "old": int4 at <= 4 rows; "dense": bf16 everywhere
    (the Q6_K kernel too)."""
    for (i, attr), (q4k, int4) in twins.items():
        q4k.max_rows, q4k.group = 1 << 20, group
        setattr(model.layers[i], attr, int4 if mode == "old" else q4k)
        int4.max_rows = 4
        if mode == "dense":
            q4k.max_rows = int4.max_rows = 0
    q6k = [w for layer in model.layers for w in (layer.wqkv, layer.w_down) if isinstance(w, Q6KWeight)]
    for w in q6k + ([model.lm_head] if isinstance(model.lm_head, Q6KWeight) else []):
        w.max_rows = 0 if mode == "dense" else 2


def timing(runner, twins, rows_list: list[int], repeats: int) -> None:
    model = runner.model
    context = 300
    cache = KVCache(runner.config, runner.dtype, runner.device)
    cache.reserve(context + max(rows_list), context + max(rows_list))

    def forward(rows: int) -> None:
        start = cache.length
        tokens = torch.randint(0, 1000, (rows,))
        model(tokens, torch.arange(start, start + rows), [SeqChunk(0, rows, cache)])

    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        tokens = torch.randint(0, 1000, (context,))
        model(
            tokens,
            torch.arange(context),
            [SeqChunk(0, context, cache)],
            logit_rows=torch.tensor([context - 1]),
        )
        cache.length = context  # later forwards overwrite the positions after the context
        for _ in range(repeats):
            for rows in rows_list:
                for mode in ("old", "new"):
                    use(model, twins, mode)
                    forward(rows)
                    t = time.perf_counter()
                    for _ in range(8):
                        forward(rows)
                    times.setdefault((rows, mode), []).append((time.perf_counter() - t) / 8 * 1e3)
    print(f"{len(twins)} Q4_K kernel weights; ms per forward (best of {repeats}):")
    for rows in rows_list:
        old, new = min(times[(rows, "old")]), min(times[(rows, "new")])
        print(f"rows={rows:3d}: old {old:7.1f}  Q4_K kernel {new:7.1f}  old / kernel {old / new:.2f}")


def accuracy(runner, tokenizer, twins, text_path: str, n_tokens: int, chunk: int) -> None:
    model = runner.model
    ids = tokenizer.encode(open(text_path).read())[:n_tokens]
    tokens = torch.tensor(ids)

    def logits(mode: str, group: int = 256) -> torch.Tensor:
        use(model, twins, mode, group)
        cache = KVCache(runner.config, runner.dtype, runner.device)
        cache.reserve(len(ids), 4096)
        out = []
        with torch.inference_mode():
            for s in range(0, len(ids), chunk):
                t = tokens[s : s + chunk]
                out.append(model(t, torch.arange(s, s + len(t)), [SeqChunk(0, len(t), cache)]).float())
                cache.length += len(t)
        return torch.log_softmax(torch.cat(out), -1)

    ref = logits("dense")
    print(f"{len(ids)} positions of {text_path}, chunks of {chunk} rows, against the dense bf16 forward:")
    for name, other in (
        ("Q4_K kernel, int8 x per 256", logits("new", 256)),
        ("Q4_K kernel, int8 x per 32", logits("new", 32)),
        ("int4 (current <= 4 rows)", logits("old") if chunk <= 4 else None),
    ):
        if other is None:
            continue
        kl = (ref.exp() * (ref - other)).sum(-1)
        agree = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
        print(
            f"  {name:28s} KL mean {kl.mean().item():.2e}  p99 {kl.quantile(0.99).item():.2e}  "
            f"max {kl.max().item():.2e}  argmax agreement {agree:.4f}"
        )
        top = kl.topk(3)
        print(
            "    largest at positions",
            ", ".join(
                f"{i} ({v:.2e})" for v, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
            ),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16,24", help="row counts to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy", metavar="FILE", help="measure KL on FILE's text instead of timing")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--chunk", type=int, default=4)
    args = parser.parse_args()

    loaded = load_models(speculative=False, progress=False, target_int4_rows=4)
    runner = loaded.target
    if not runner.model.q4k_weights():
        raise SystemExit("the Q4_K kernel is not in use here (see the log above for why)")
    twins = int4_twins(runner.model, str(resolve_model_path(None, "target")))
    if args.accuracy:
        accuracy(runner, loaded.tokenizer, twins, args.accuracy, args.tokens, args.chunk)
    else:
        timing(runner, twins, [int(r) for r in args.rows.split(",")], args.repeats)


if __name__ == "__main__":
    main()
