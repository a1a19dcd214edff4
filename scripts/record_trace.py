"""Record a trace of labelled drafts on real prompts, for `specverify calibrate`.

    .venv/bin/python scripts/record_trace.py TRACE.jsonl [--labels 21000] [--k 5] [--concurrency 32]
        [--max-tokens 96] [--temperature 1.0] [--top-p 0.95] [--datasets humaneval,mtbench]

Fixed-K speculation on the default pair (every draft verified, so labels are censored only by the first
rejection); stops once the estimator has seen `--labels` labels or the prompts run out.
"""

from __future__ import annotations

import argparse
import time

from specverify import LLM, SamplingParams
from specverify.bench.datasets import encode_prompts, interleave, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace")
    parser.add_argument("--labels", type=int, default=21000)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--datasets", default="humaneval,mtbench")
    args = parser.parse_args()

    spec = {"method": "draft_model", "num_speculative_tokens": args.k}
    llm = LLM(speculative_config=spec, max_num_seqs=args.concurrency, record_trace=args.trace)
    prompts = interleave([load_prompts(name) for name in args.datasets.split(",")])
    engine = llm.engine
    for i, ids in enumerate(encode_prompts(llm.tokenizer, prompts)):
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=i
        )
        engine.add_request(ids, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests() and engine.calibration.total < args.labels:
        engine.step()
        if engine.stats.steps % 10 == 0:
            print(
                f"step {engine.stats.steps}  {time.perf_counter() - start:.0f} s  {engine.calibration.total} labels"
            )
    engine.close()
    s = engine.stats
    print(
        f"{s.steps} steps, {s.output_tokens} tokens, drafted {s.drafted_tokens}, verified {s.verified_tokens}, "
        f"accepted {s.accepted_tokens}, labels {engine.calibration.total}, {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
