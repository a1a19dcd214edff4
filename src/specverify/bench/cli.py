"""`specverify bench`: no speculation vs fixed K vs adaptive verification, side by side, on real prompts."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specverify.bench.datasets import DATASETS
from specverify.cli import DTYPE_CHOICES, DTYPE_HELP, add_batch_arguments, prefill_budget

# Sized for a 2-core CPU and the default pair: with a target step of ~0.35 s (1 token) to ~1.9 s (192),
# a draft step of ~0.2 s and prefill at ~100 prompt tokens/s, loading + cost profiling + warm-up + the
# sweep come to ~14-15 min for the default (budget: 20; min_prompts 4 adds ~2 min at c=1) and ~4 min
# for --quick (budget: 5; min_prompts 2 adds ~20 s). Each extra temperature repeats the sweep.
DEFAULT = {"concurrencies": "1,4,16,32", "max_tokens": 64, "num_prompts": None, "min_prompts": 4}
QUICK = {"concurrencies": "1,4", "max_tokens": 32, "num_prompts": None, "min_prompts": 2}
DEFAULT_K = 5
# The suffix drafter drafts for free, so its drafts go deep and the planner trims them.
DEFAULT_SUFFIX_K = 16


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one temperature, got {text!r}")
    bad = [v for v in values if not (0.0 <= v <= 100.0)]  # also catches NaN
    if bad:
        raise argparse.ArgumentTypeError(
            f"temperatures must be >= 0 (0: greedy) and at most 100, got {text!r}"
        )
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"temperatures repeat: {text!r}")
    return values


def _modes(text: str) -> list[str]:
    from specverify.bench.runner import MODES

    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in MODES]
    if not values or bad:
        raise argparse.ArgumentTypeError(
            f"modes must be a comma-separated subset of {','.join(MODES)}, got {text!r}"
        )
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the `specverify` command's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark no speculation / fixed K / adaptive verification over a concurrency sweep",
        description=__doc__ + " Without options: the default model pair and profile (sized to finish within "
        "20 minutes on a 2-core CPU); --quick: a smaller profile (within 5 minutes).",
    )
    p.add_argument(
        "--model",
        help="target model: a .gguf file or an HF safetensors directory (default: "
        "Qwen2.5-Coder-1.5B-Instruct, assembled from its PyPI chunk packages)",
    )
    p.add_argument(
        "--speculative-config",
        help='JSON, vLLM\'s convention, e.g. \'{"method": "draft_model", '
        '"model": "draft.gguf", "num_speculative_tokens": 5}\'; the benchmark sets '
        "enable_adaptive_verification itself per mode (default: the default draft, K=5)",
    )
    p.add_argument(
        "--drafter",
        choices=["draft_model", "suffix"],
        default=None,
        help="who drafts for the fixed and adaptive modes: the draft model (default, K=5) or suffix "
        f"drafting from each request's own text and earlier outputs (no draft model, K={DEFAULT_SUFFIX_K}); "
        "a --speculative-config's method decides otherwise",
    )
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--max-model-len", type=int, default=None)
    add_batch_arguments(p)
    p.add_argument(
        "--dataset",
        default="mixed",
        choices=DATASETS,
        help="prompt set; mixed interleaves humaneval, mtbench and gsm8k; edit asks to rework a code "
        "solution or an answer given in the prompt (repetition-heavy) (default: mixed)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="prompts per (temperature, concurrency) point, run by every mode, never fewer than "
        "concurrency x --rounds (default: max(concurrency x --rounds, --min-prompts))",
    )
    p.add_argument(
        "--min-prompts",
        type=_positive_int,
        default=None,
        help="without --num-prompts, each point gets max(concurrency, N) prompts, so a low-concurrency "
        f"point is not decided by one prompt (default {DEFAULT['min_prompts']}; "
        f"--quick {QUICK['min_prompts']})",
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        help="each point gets at least concurrency x N prompts: N requests per client in the pool "
        "(or N closed rounds), more side-by-side repetitions at a high concurrency (default 1)",
    )
    p.add_argument(
        "--closed-rounds",
        action="store_true",
        help="run each point in closed batches of `concurrency` prompts, each lasting as long as its "
        "slowest request, instead of one pool of all its prompts with `concurrency` in flight "
        "(a finished request's place going to the next, as under steady clients; the default)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens per request (default {DEFAULT['max_tokens']}; --quick {QUICK['max_tokens']})",
    )
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=None,
        help=f"comma-separated concurrencies (default {DEFAULT['concurrencies']}; "
        f"--quick {QUICK['concurrencies']})",
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default=["none", "fixed", "adaptive"],
        help="comma-separated subset of none,fixed,adaptive (default: all three)",
    )
    p.add_argument(
        "--temperature",
        type=_temperatures,
        default=[1.0],
        help="sampling temperature, or a comma-separated list swept in turn with the same loaded "
        "models, e.g. 1,0 (0: greedy; default 1.0)",
    )
    p.add_argument("--top-p", type=float, default=0.95, help="top-p, for temperature > 0 (default 0.95)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens tokens")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the untimed warm-up per mode")
    p.add_argument(
        "--warmup-labels",
        type=int,
        default=None,
        help="labels the adaptive mode's estimators learn in an untimed warm-up before the sweep, as a "
        "server started with --estimator-state has them (default: the engine's warm-up length, 200; 0: "
        "start cold, the first point pays the exploration)",
    )
    p.add_argument("--quick", action="store_true", help="a small profile that finishes in about 5 minutes")
    p.add_argument("--output-dir", default="bench-results", help="where results.json and the plots go")
    p.add_argument(
        "--profile-cache",
        default=None,
        help="JSON file caching start-up cost profiles (default: the specverify cache directory)",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the start-up cost profile afresh instead of using the cached one (e.g. when the "
        "machine was busy while the cached one was taken); the fresh profile is not cached",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def _speculative(args: argparse.Namespace):
    """The base speculative config (adaptive is switched per mode), or None when only `none` runs."""
    from specverify.config import SpeculativeConfig

    speculates = any(m != "none" for m in args.modes)
    if args.speculative_config:
        spec = SpeculativeConfig.from_any(args.speculative_config)
        if args.drafter and args.drafter != spec.method:
            raise SystemExit(
                f"error: --drafter {args.drafter} contradicts the --speculative-config method {spec.method!r}"
            )
    elif args.drafter == "suffix":
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=DEFAULT_SUFFIX_K)
    elif args.model is not None and speculates:
        raise SystemExit(
            'error: with --model, give --speculative-config with a draft "model", or --drafter suffix '
            "(or --modes none to benchmark the target alone)"
        )
    else:
        spec = SpeculativeConfig(num_speculative_tokens=DEFAULT_K)
    return spec if speculates else None


def dtype_name(args: argparse.Namespace) -> str:
    """The dtype the models run in ("auto" resolved for this machine)."""
    from specverify.models.runner import resolve_dtype

    return str(resolve_dtype(args.dtype, args.device)).removeprefix("torch.")


def _cost_model(models, args: argparse.Namespace, k: int, progress: bool):
    """One cost model for every adaptive engine: profiled once (cached per model pair, machine and K,
    whose K + 1 tokens per request lay out the verification forwards it times)."""
    from specverify.cost_model import CostModel
    from specverify.models.assets import cache_dir
    from specverify.profiling import load_or_profile, profile_runners

    if args.reprofile:
        profile = profile_runners(models.target, models.draft, tokens_per_seq=k + 1, progress=progress)
    else:
        path = Path(args.profile_cache) if args.profile_cache else cache_dir() / "profiles.json"
        key = f"{models.target_name}|{models.draft_name}|{dtype_name(args)}|{args.device}"
        profile = load_or_profile(
            models.target, models.draft, path, key, tokens_per_seq=k + 1, progress=progress
        )
    return CostModel.from_profile(profile)


def run(args: argparse.Namespace) -> int:
    import torch

    from specverify.bench.datasets import encode_prompts, has_chat_template, load_prompts
    from specverify.bench.report import format_table, results_dict, write_report, write_results
    from specverify.bench.runner import BenchConfig, BenchRunner
    from specverify.llm import load_models

    preset = QUICK if args.quick else DEFAULT
    spec = _speculative(args)
    config = BenchConfig(
        modes=args.modes,
        concurrencies=args.concurrency or _int_list(preset["concurrencies"]),
        num_prompts=args.num_prompts if args.num_prompts is not None else preset["num_prompts"],
        min_prompts=args.min_prompts if args.min_prompts is not None else preset["min_prompts"],
        rounds=args.rounds,
        closed_rounds=args.closed_rounds,
        max_tokens=args.max_tokens or preset["max_tokens"],
        # One value stays a float in results.json; several become the list (BenchConfig decides).
        temperature=list(args.temperature),
        top_p=args.top_p,
        num_speculative_tokens=spec.num_speculative_tokens if spec else DEFAULT_K,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        warmup_tokens=args.warmup_tokens,
        **({} if args.warmup_labels is None else {"warmup_labels": args.warmup_labels}),
        max_prefill_tokens=prefill_budget(args),
        kv_cache_memory=args.kv_cache_memory,
    )
    progress = not args.no_progress
    started = time.perf_counter()
    needed = max(config.prompts_for(c) for c in config.concurrencies)
    prompts = load_prompts(args.dataset, needed)
    if len(prompts) < needed:
        raise ValueError(
            f"dataset {args.dataset} has {len(prompts)} prompts; the sweep needs {needed} per point"
        )

    models = load_models(
        args.model,
        spec.model if spec else None,
        spec is not None and spec.method == "draft_model",
        args.dtype,
        args.device,
        args.max_model_len,
        progress=progress,
        draft_vocab_size=spec.draft_vocab_size if spec else None,
        draft_quantization=spec.draft_quantization if spec else None,
    )
    prompt_ids = encode_prompts(models.tokenizer, prompts)
    chat = has_chat_template(models.tokenizer)
    k = config.num_speculative_tokens
    cost_model = _cost_model(models, args, k, progress) if "adaptive" in config.modes else None
    setup_s = time.perf_counter() - started

    runner = BenchRunner(
        models.target,
        models.tokenizer,
        models.draft,
        config,
        dataset=args.dataset,
        speculative=spec,
        cost_model=cost_model,
        progress=progress,
    )
    extra = {
        "target": models.target_name,
        "draft": models.draft_name,
        "dtype": dtype_name(args),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "chat_template": chat,
        "prompt_tokens_mean": sum(map(len, prompt_ids)) / len(prompt_ids),
        "setup_s": setup_s,
        "partial": False,
    }

    def save_partial(partial) -> None:
        # A long sweep that dies late still leaves every finished point on disk.
        write_results(results_dict(partial, {**extra, "partial": True}), args.output_dir)

    bench = runner.run(prompt_ids, on_result=save_partial)
    extra["total_s"] = time.perf_counter() - started
    if cost_model is not None and hasattr(cost_model, "to_dict"):
        extra["cost_model"] = cost_model.to_dict()
    results = write_report(bench, args.output_dir, extra)
    print(format_table(results))
    written = ", ".join(["results.json"] + [p for p in results["plots"].values() if p])
    print(f"wrote {written} to {args.output_dir}/ in {extra['total_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover - `python -m specverify.bench.cli`
    parser = argparse.ArgumentParser(prog="specverify")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    parsed = parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
