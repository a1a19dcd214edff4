"""Serve one very long prompt (default 30,000 tokens) on the default target beside a short request, and
measure what it costs: the process's peak resident memory over the weights, the KV bytes, the prefill
time, and how often the short request got a token while the long one was prefilled in chunks.

    .venv/bin/python scripts/long_prompt.py [--tokens 30000] [--max-prefill-tokens 512]
        [--max-tokens 16] [--no-speculation]

The prompt is the installed HumanEval and MT-Bench texts (the benchmark's prompt packages) repeated to
length, then a question about them.
"""

from __future__ import annotations

import argparse
import threading
import time

from specverify import LLM, SamplingParams
from specverify.bench.datasets import load_edit, load_humaneval, load_mtbench


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS(threading.Thread):
    """Polls the resident set size every 50 ms and keeps the peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = rss_bytes(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--max-prefill-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-speculation", action="store_true")
    args = parser.parse_args()

    spec = (
        None if args.no_speculation else {"num_speculative_tokens": 5, "enable_adaptive_verification": True}
    )
    llm = LLM(speculative_config=spec, max_prefill_tokens=args.max_prefill_tokens)
    engine, tokenizer = llm.engine, llm.tokenizer
    text = "\n\n".join(p.text for p in load_humaneval() + load_mtbench() + load_edit())
    ids = tokenizer.encode(text, add_special_tokens=False)
    question = tokenizer.encode(
        "\n\nWhich function above sorts a list? Answer briefly.", add_special_tokens=False
    )
    body = (ids * (args.tokens // len(ids) + 1))[: args.tokens - len(question)]
    prompt = body + question
    weights_rss = rss_bytes()
    monitor = PeakRSS()
    monitor.start()

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    short = engine.add_request(tokenizer.encode("def add(a, b):", add_special_tokens=False), params)
    engine.step()  # the short request is running before the long one arrives
    long_id = engine.add_request(prompt, params)
    start = time.perf_counter()
    first_token = None
    short_tokens_during_prefill = 0
    steps = 0
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == short and first_token is None:
                short_tokens_during_prefill += len(out.new_token_ids)
            if out.request_id == long_id and out.new_token_ids and first_token is None:
                first_token = time.perf_counter() - start
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if short in done and first_token is None:
            # The short request finished while the long one still prefills: start another, keep counting.
            short = engine.add_request(tokenizer.encode("def sub(a, b):", add_special_tokens=False), params)
    total = time.perf_counter() - start
    monitor.running = False
    monitor.join()
    out = done[long_id]
    gib = 1 << 30
    print(
        f"prompt: {len(prompt)} tokens; chunks of {args.max_prefill_tokens}; speculation: {spec is not None}"
    )
    print(
        f"time to first token {first_token:.1f} s ({len(prompt) / first_token:.0f} prompt tok/s); total {total:.1f} s"
    )
    print(f"short requests' tokens while the long prompt was prefilled: {short_tokens_during_prefill}")
    print(
        f"RSS after loading: {weights_rss / gib:.2f} GiB; peak while serving: {monitor.peak / gib:.2f} GiB "
        f"(+{(monitor.peak - weights_rss) / gib:.2f} GiB); the long request's KV caches: "
        f"{engine.kv.tokens(out.prompt_token_ids.__len__() + len(out.output_token_ids)) * engine.kv.bytes_per_token / gib:.2f} GiB counted"
    )
    print(f"KV budget: {engine.kv.budget_bytes / gib:.2f} GiB; preemptions: {engine.stats.preemptions}")
    print("answer:", repr(out.text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
