"""`specverify` command line: generate, bench, serve, calibrate."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# Each subcommand lives beside the feature it drives and registers itself through `add_parser`.
_COMMAND_MODULES = ("specverify.bench.cli", "specverify.server.cli", "specverify.calibrate_cli")

DTYPE_CHOICES = ("auto", "bfloat16", "float32")
DTYPE_HELP = (
    "weights and activations; auto (default): bfloat16 on a GPU and on a CPU with bf16 dot products "
    "(AVX512-BF16, AMX, Arm BF16), float32 on other CPUs, where bf16 is emulated"
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model selection shared by generate, bench and serve."""
    parser.add_argument(
        "--model",
        help="target model: a .gguf file or an HF safetensors directory (default: "
        "Qwen2.5-Coder-1.5B-Instruct, assembled from its PyPI chunk packages)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--speculative-config",
        help='JSON, vLLM\'s convention, e.g. \'{"method": "draft_model", '
        '"model": "draft.gguf", "num_speculative_tokens": 5, "enable_adaptive_verification": true}\'',
    )
    group.add_argument("--no-speculation", action="store_true", help="plain decoding with the target only")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None)
    add_batch_arguments(parser)


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """How much the batch may take per step (prompt tokens) and in all (KV-cache memory)."""
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=512,
        help="prompt tokens prefilled per step; a longer prompt is prefilled in chunks of this size over "
        "several steps while the running requests keep decoding (0: no limit, one forward; default 512)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=_positive_float,
        metavar="GIB",
        help="GiB the KV caches of both models may hold; requests wait, or the newest is preempted, to "
        "stay within it (default: 90 %% of the memory available after loading the weights, less 2 GiB)",
    )


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def prefill_budget(args: argparse.Namespace) -> int | None:
    return args.max_prefill_tokens if args.max_prefill_tokens != 0 else None


def speculative_config_from_args(args: argparse.Namespace) -> dict | None:
    """Default: speculation with the default draft and adaptive verification, unless told otherwise."""
    if args.no_speculation:
        return None
    if args.speculative_config:
        try:
            config = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --speculative-config is not valid JSON: {e}") from e
        return config
    if args.model is not None:
        raise SystemExit(
            'error: with --model, give --speculative-config (with a draft "model") or --no-speculation'
        )
    return {"method": "draft_model", "num_speculative_tokens": 5, "enable_adaptive_verification": True}


def llm_from_args(args: argparse.Namespace, **kwargs):
    """An `LLM` from the shared model arguments (see `add_model_arguments`)."""
    from specverify import LLM

    return LLM(
        model=args.model,
        speculative_config=speculative_config_from_args(args),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_prefill_tokens=prefill_budget(args),
        kv_cache_memory=args.kv_cache_memory,
        **kwargs,
    )


def _generate(args: argparse.Namespace) -> int:
    from specverify import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    llm = llm_from_args(args, record_trace=args.record_trace)
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    try:
        (out,) = llm.generate(prompt, params, use_tqdm=False)
    finally:
        llm.engine.close()
    print(out.text)
    m = out.metrics
    if m.drafted:
        print(
            f"[{len(out.output_token_ids)} tokens in {m.steps} steps; drafted {m.drafted}, verified {m.verified}, "
            f"accepted {m.accepted}; accepted per position {m.accepted_per_position}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specverify", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    gen.add_argument("--prompt", required=True)
    add_model_arguments(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default: on)",
    )
    gen.add_argument("--record-trace", metavar="PATH", help="write every labelled draft to a JSONL trace")
    gen.set_defaults(func=_generate)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specverify.config import ConfigError
    from specverify.engine.llm_engine import PromptError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PromptError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
