"""What asking for log-probabilities costs: two engines over the same loaded models, one asking for
`logprobs` (and the top alternatives), one not, stepping in turn on the same prompts and seeds.

    .venv/bin/python scripts/logprobs_overhead.py [--concurrency 16] [--drafter draft_model|suffix]
        [--adaptive] [--logprobs 5] [--rounds 2] [--max-tokens 128] [--temperature 1.0]

With fixed K (the default) both engines draw the same tokens (log-probabilities use no randomness), so
the difference in time is the log-probability work alone; the script checks the tokens agree. Each
engine is timed on its own steps only; the order alternates from round to round.
"""

from __future__ import annotations

import argparse
import time

from specverify.bench.datasets import encode_prompts, load_prompts
from specverify.config import EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine
from specverify.llm import load_models
from specverify.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--drafter", choices=["draft_model", "suffix"], default="draft_model")
    parser.add_argument("--adaptive", action="store_true", help="adaptive verification (tokens may differ)")
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dataset", default="mixed")
    args = parser.parse_args()

    k = 16 if args.drafter == "suffix" else 5
    spec = SpeculativeConfig(
        method=args.drafter, num_speculative_tokens=k, enable_adaptive_verification=args.adaptive
    )
    models = load_models(
        speculative=args.drafter == "draft_model",
        draft_vocab_size=spec.draft_vocab_size,
        draft_quantization=spec.draft_quantization,
    )
    prompts = encode_prompts(models.tokenizer, load_prompts(args.dataset, args.concurrency * args.rounds))
    engines = {
        name: LLMEngine(
            models.target,
            models.tokenizer,
            EngineConfig(max_num_seqs=args.concurrency, speculative=spec),
            draft=models.draft,
        )
        for name in ("off", "on")
    }
    seconds = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    same = True
    for r in range(args.rounds):
        batch = prompts[r * args.concurrency : (r + 1) * args.concurrency]
        results = {name: {} for name in engines}
        for name, engine in engines.items():
            for i, ids in enumerate(batch):
                params = SamplingParams(
                    temperature=args.temperature,
                    top_p=0.95,
                    max_tokens=args.max_tokens,
                    seed=1000 * r + i,
                    logprobs=args.logprobs if name == "on" else None,
                )
                engine.add_request(ids, params, f"{r}-{i}")
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        while any(e.has_unfinished_requests() for e in engines.values()):
            for name in order:
                engine = engines[name]
                if not engine.has_unfinished_requests():
                    continue
                start = time.perf_counter()
                outputs = engine.step()
                seconds[name] += time.perf_counter() - start
                for out in outputs:
                    tokens[name] += len(out.new_token_ids)
                    if out.finished:
                        results[name][out.request_id] = out.output_token_ids
        same &= results["off"] == results["on"]
    rate = {name: tokens[name] / seconds[name] for name in engines}
    print(
        f"{args.drafter} K={k} {'adaptive' if args.adaptive else 'fixed'} c{args.concurrency} "
        f"T={args.temperature} logprobs={args.logprobs}: off {rate['off']:.2f} tok/s, on {rate['on']:.2f} "
        f"tok/s, on/off {rate['on'] / rate['off']:.3f} (overhead {100 * (1 - rate['on'] / rate['off']):.1f} %); "
        f"same tokens: {same}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
