"""Engine behaviour on toy models: batching, stopping, KV rollback, and clear errors for bad input."""

import warnings

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE
from exact import VOCAB, toy_pair

from specverify.config import ConfigError, EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine, PromptError
from specverify.models.toy import ToyRunner, ToyTokenizer
from specverify.sampling_params import SamplingParams


def make_engine(
    k: int | None = 3,
    max_num_seqs: int = 8,
    eos: int | None = None,
    max_model_len: int = 4096,
    *,
    cost_model=None,
    record_trace: str | None = None,
):
    """An engine over the toy pair; with `cost_model`, adaptive verification on."""
    target_fn, draft_fn = toy_pair()
    target = ToyRunner(VOCAB, target_fn, max_model_len=max_model_len, device=TEST_DEVICE)
    draft = ToyRunner(VOCAB, draft_fn, max_model_len=max_model_len, device=TEST_DEVICE)
    adaptive = cost_model is not None
    spec = SpeculativeConfig(num_speculative_tokens=k, enable_adaptive_verification=adaptive) if k else None
    engine = LLMEngine(
        target,
        ToyTokenizer(VOCAB, eos),
        EngineConfig(max_num_seqs=max_num_seqs, speculative=spec, record_trace=record_trace),
        draft=draft,
        cost_model=cost_model,
    )
    return engine, target, draft


def run_all(engine):
    outs = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs, steps


def test_caches_hold_all_but_the_last_token_between_steps() -> None:
    engine, target, draft = make_engine(k=4)
    rid = engine.add_request(
        [0, 1, 2], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=3)
    )
    request = engine.scheduler.waiting[0]
    while engine.has_unfinished_requests():
        engine.step()
        if not request.finished:
            assert target.cache_length(request.seq_id) == request.num_tokens - 1
            assert draft.cache_length(request.seq_id) <= request.num_tokens - 1
            # The rolled-back cache must hold exactly the request's tokens, never a rejected draft.
            assert target.caches[request.seq_id] == request.tokens[:-1]
            assert draft.caches[request.seq_id] == request.tokens[: draft.cache_length(request.seq_id)]
    assert rid and len(request.output_token_ids) == 40


def test_continuous_batching_respects_max_num_seqs_and_finishes_everyone() -> None:
    engine, _, _ = make_engine(k=2, max_num_seqs=3)
    ids = [engine.add_request([1, 2], SamplingParams(max_tokens=5 + i, ignore_eos=True)) for i in range(7)]
    seen_running = []
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        seen_running.append(engine.stats.last_batch_size)
    assert max(seen_running) == 3
    assert [len(outs[r].output_token_ids) for r in ids] == [5 + i for i in range(7)]
    assert all(outs[r].finish_reason == "length" for r in ids)


@pytest.mark.parametrize("k", [None, 3])
def test_prompt_token_budget_spreads_a_burst_over_steps_and_changes_no_output(k) -> None:
    """Prompts of 6 tokens under a 13-token budget: two join per step (a third would make 18), and the
    staggered prefill yields exactly the outputs of admitting everyone at once (same seeds)."""
    prompts = [[i % 4 + 1, 2, 3, 4, 0, 1] for i in range(5)]
    outputs = {}
    for budget in (None, 13):
        engine, _, _ = make_engine(k=k, max_num_seqs=8)
        engine.scheduler.max_prefill_tokens = budget
        ids = [
            engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts)
        ]
        sizes = []
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.output_token_ids
            sizes.append(engine.stats.last_batch_size)
        outputs[budget] = [outs[r] for r in ids]
        if budget is None:
            assert sizes[0] == 5
        else:
            assert sizes[:3] == [2, 4, 5]
    assert outputs[13] == outputs[None]


def test_a_prompt_longer_than_the_budget_joins_alone() -> None:
    engine, _, _ = make_engine(k=2, max_num_seqs=8)
    engine.scheduler.max_prefill_tokens = 4
    for n in (10, 3, 3):
        engine.add_request([i % 5 for i in range(n)], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.stats.last_batch_size == 1  # the 10-token prompt, alone
    engine.step()
    assert engine.stats.last_batch_size == 2  # the 3-token one; the next would make 6 > 4
    assert engine.num_waiting == 1
    _, _ = run_all(engine)


def test_prompt_token_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=0)


def test_same_seed_same_output_with_or_without_speculation_for_greedy() -> None:
    spec_engine, _, _ = make_engine(k=3)
    plain_engine, _, _ = make_engine(k=None)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a = spec_engine.add_request([3, 1], params)
    b = plain_engine.add_request([3, 1], params)
    assert run_all(spec_engine)[0][a].output_token_ids == run_all(plain_engine)[0][b].output_token_ids


def test_eos_stops_and_is_kept_last() -> None:
    engine, _, _ = make_engine(k=3, eos=4)
    ids = [
        engine.add_request([0, 1], SamplingParams(temperature=1.0, max_tokens=50, seed=s)) for s in range(20)
    ]
    outs, _ = run_all(engine)
    stopped = [outs[i] for i in ids if outs[i].finish_reason == "stop"]
    assert stopped, "with 5 tokens and 50 steps some request must draw EOS"
    for out in stopped:
        assert out.output_token_ids[-1] == 4 and 4 not in out.output_token_ids[:-1]


def test_stop_string_truncates_text() -> None:
    engine, _, _ = make_engine(k=3)
    rid = engine.add_request(
        [0, 1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["t"])
    )
    out = run_all(engine)[0][rid]
    assert out.finish_reason == "stop" and out.text == ""


def test_stop_string_ends_output_where_plain_decoding_would() -> None:
    """Drafts accepted after the token that completes a stop string are dropped, so tokens, usage and
    log-probabilities are those of plain decoding."""
    engine, _, _ = make_engine(k=None)
    rid = engine.add_request([0, 1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    free = run_all(engine)[0][rid].output_token_ids
    stop = f"t{free[6]} t{free[7]}"  # plain decoding stops at the first token completing it
    results = []
    for k in (None, 4):
        engine, _, _ = make_engine(k=k)
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=0)
        rid = engine.add_request([0, 1], params)
        out = run_all(engine)[0][rid]
        assert out.finish_reason == "stop" and stop not in out.text
        assert len(out.logprobs) == len(out.output_token_ids) == engine.stats.output_tokens
        results.append((out.output_token_ids, out.text))
        if k:
            assert out.metrics.accepted > 0
    assert results[0] == results[1]
    assert len(results[0][0]) <= 8


def test_speculation_takes_fewer_steps_than_plain_decoding() -> None:
    spec_engine, _, _ = make_engine(k=4)
    plain_engine, _, _ = make_engine(k=None)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec_engine.add_request([2, 2], params)
    plain_engine.add_request([2, 2], params)
    assert run_all(spec_engine)[1] < run_all(plain_engine)[1] == 30


def test_abort_releases_caches() -> None:
    engine, target, draft = make_engine(k=2)
    rid = engine.add_request([0, 1], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests() and not target.caches and not draft.caches


def test_context_window_ends_generation_with_length() -> None:
    engine, _, _ = make_engine(k=4, max_model_len=12)
    rid = engine.add_request([0] * 8, SamplingParams(max_tokens=100, ignore_eos=True))
    out = run_all(engine)[0][rid]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.output_token_ids) == 12


@pytest.mark.parametrize(
    "prompt, error",
    [([], "empty"), ([0] * 20, "at most"), ([0, 99], "out of range")],
)
def test_bad_prompts_raise_clear_errors(prompt, error) -> None:
    engine, _, _ = make_engine(max_model_len=16)
    with pytest.raises(PromptError, match=error):
        engine.add_request(prompt, SamplingParams())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_raise(kwargs, error) -> None:
    with pytest.raises(ValueError, match=error):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "config, error",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"num_speculative_tokens": "5"}, "num_speculative_tokens"),
        ({"method": "eagle"}, "not supported"),
        ({"enable_adaptive_verification": "yes"}, "true or false"),
        ({"speculative_tokens": 5}, "unknown"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_speculative_configs_raise(config, error) -> None:
    with pytest.raises(ConfigError, match=error):
        SpeculativeConfig.from_any(config)


def test_vocabulary_mismatch_is_refused(device) -> None:
    target_fn, _ = toy_pair()
    target = ToyRunner(VOCAB, target_fn, device=device)
    draft = ToyRunner(VOCAB + 1, lambda ctx: torch.zeros(VOCAB + 1), device=device)
    with pytest.raises(ConfigError, match="vocabularies differ"):
        LLMEngine(target, ToyTokenizer(VOCAB), EngineConfig(speculative=SpeculativeConfig()), draft=draft)


def test_requests_with_logit_bias_do_not_train_the_estimator() -> None:
    engine, _, _ = make_engine(k=3)
    before = engine.estimator.state_dict()
    for s in range(5):
        engine.add_request(
            [0, 1], SamplingParams(max_tokens=20, ignore_eos=True, seed=s, logit_bias={2: 3.0})
        )
    run_all(engine)
    assert engine.stats.verified_tokens > 0
    assert engine.estimator.state_dict() == before


@pytest.mark.parametrize("pays", [True, False])
def test_probes_draft_for_a_few_requests_and_only_where_speculation_could_pay(monkeypatch, pays) -> None:
    import numpy as np

    import specverify.engine.llm_engine as engine_module
    from specverify.cost_model import CostModel

    monkeypatch.setattr(engine_module, "WARMUP_LABELS", 0)
    monkeypatch.setattr(engine_module, "_PROBE_MIN_STREAK", 3)
    monkeypatch.setattr(engine_module, "_EXPLORATION_SHARE", 1e9)  # time is no object here
    tokens = np.array([1.0, 8.0, 64.0])
    cost = CostModel(tokens, 1.0 + tokens, tokens, 0.1 + tokens)  # speculation never chosen on merit
    engine, *_ = make_engine(k=3, max_num_seqs=8, cost_model=cost)
    monkeypatch.setattr(engine.planner, "could_pay", lambda *args, **kwargs: pays)
    for i in range(8):
        engine.add_request([i % VOCAB, 2, 3], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    drafting_rows = []
    while engine.has_unfinished_requests():
        before = list(engine.stats.drafted_per_position) or [0]
        engine.step()
        drafting_rows.append((list(engine.stats.drafted_per_position) or [0])[0] - before[0])
    probes = [n for n in drafting_rows if n > 0]
    if pays:
        assert probes and max(probes) <= engine_module._PROBE_REQUESTS
        assert engine.stats.verified_tokens == engine.stats.drafted_tokens  # probes verify everything
    else:
        assert engine.stats.drafted_tokens == 0


def test_recent_draft_features_are_kept_per_position_and_bounded() -> None:
    """The look-ahead's acceptance means come from recent drafts kept as rows per position; the memory
    keeps at least _FEATURE_MEMORY features and drops whole old steps, and a loaded state keeps the newest."""
    import numpy as np

    import specverify.engine.llm_engine as engine_module

    engine, *_ = make_engine(k=3)
    memory = engine_module._FEATURE_MEMORY
    for step in range(memory):
        rows = np.full((2, 2), float(step))  # two requests, two slots drafted, padded to K = 3
        engine._remember_features(rows)
    kept = np.concatenate(engine._recent_features)
    assert kept.shape[1] == 3 and np.isnan(kept[:, 2]).all()
    assert memory <= np.isfinite(kept).sum() < memory + 4
    assert kept[-1, 0] == memory - 1  # the newest step is kept, the oldest dropped
    fresh, *_ = make_engine(k=3)
    fresh.load_speculation_state(
        engine.speculation_state() | {"recent_features": np.vstack([kept] * 3).tolist()}
    )
    assert memory <= np.isfinite(np.concatenate(fresh._recent_features)).sum() < memory + 2


def test_speculation_state_carries_estimator_and_recent_features() -> None:
    import numpy as np

    engine, *_ = make_engine(k=3)
    for i in range(4):
        engine.add_request([i % VOCAB, 1, 2], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    run_all(engine)
    state = engine.speculation_state()
    fresh, *_ = make_engine(k=3)
    before = fresh._expected_acceptance()
    fresh.load_speculation_state(state)
    np.testing.assert_allclose(fresh._expected_acceptance(), engine._expected_acceptance())
    assert not np.allclose(before, fresh._expected_acceptance())  # it did change something
    assert fresh.estimator.n_observed_ == engine.estimator.n_observed_
    plain, *_ = make_engine(k=None)
    assert plain.speculation_state() is None
    with pytest.raises(ConfigError):
        plain.load_speculation_state(state)


def test_speculation_state_carries_the_planners_realised_gain() -> None:
    from specverify.cost_model import CostModel

    tokens = np.array([1.0, 8.0, 64.0])
    engine, *_ = make_engine(k=3, cost_model=CostModel(tokens, 0.1 + 0.01 * tokens, tokens, 0.01 * tokens))
    engine.planner.load_gain_state({"expected": 200.0, "realised": 100.0})
    fresh, *_ = make_engine(k=3, cost_model=CostModel(tokens, 0.1 + 0.01 * tokens, tokens, 0.01 * tokens))
    assert fresh.planner.gain_factor == 1.0
    fresh.load_speculation_state(engine.speculation_state())
    assert fresh.planner.gain_factor == pytest.approx(120.0 / 220.0)


@pytest.mark.parametrize("clear_win", [False, True])
def test_plain_steps_stay_measured_while_speculation_is_on(monkeypatch, clear_win: bool) -> None:
    """With speculation chosen every step, plain steps still run: while plain decoding near this batch
    size has fewer than 3 used measurements, and then one per _PLAIN_PROBE_EVERY speculative steps;
    never on a step that prefills, and never while speculation is predicted to win by the margin."""
    import specverify.engine.llm_engine as engine_module
    from specverify.cost_model import CostModel

    monkeypatch.setattr(engine_module, "_PLAIN_PROBE_EVERY", 8)
    tokens = np.array([1.0, 2.0, 4.0, 8.0, 64.0])
    engine, *_ = make_engine(
        k=3, max_num_seqs=4, cost_model=CostModel(tokens, np.ones(5), tokens, np.ones(5))
    )

    def choose(num_requests, *args, **kwargs) -> int:  # speculation always pays: by a little, or by 2x
        plain_rate = num_requests / engine.planner.cost.plain_time(num_requests)  # as now predicted
        engine.planner.expected_rate = plain_rate * (2.0 if clear_win else 1.2)
        return 3

    monkeypatch.setattr(engine.planner, "choose_draft_depth", choose)
    engine.estimator.n_observed_ = engine.greedy_estimator.n_observed_ = 10**6  # past the warm-up
    for i in range(4):
        engine.add_request([i % VOCAB, 1], SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True))
    depths = []
    while engine.has_unfinished_requests():
        engine.step()
        depths.append(engine.stats.last_draft_depth)
    plain = [i for i, d in enumerate(depths) if d == 0]
    if clear_win:  # plain steps would have to be 2x cheaper than predicted to matter: none is run
        assert plain == []
        return
    warmup = engine.planner.cost.plain.warmup
    # The prefill step is never a plain probe (the draft would miss the prompts); right after it plain
    # decoding is measured first (through the curve's warm-up).
    assert depths[0] > 0
    assert plain[: warmup + 3] == list(range(1, warmup + 4))
    gaps = np.diff(plain[warmup + 3 :])
    assert len(gaps) >= 3 and (gaps <= 10).all()  # then one every 8 speculative steps (+ tail batches)
    assert engine.planner.cost.plain_observations(4) >= 3
    assert sum(d > 0 for d in depths) > 0.8 * len(depths)


@pytest.mark.parametrize("drafts_pay", [True, False])
def test_warm_up_drafts_the_whole_batch_only_where_speculation_may_pay(drafts_pay) -> None:
    """Until the estimator has its warm-up labels every drafted slot is verified. Where the prior already
    says speculation loses at this load, only a few requests draft (the labels still come, cheaply)."""
    import specverify.engine.llm_engine as engine_module
    from specverify.cost_model import CostModel

    tokens = np.array([1.0, 8.0, 64.0])
    draft_seconds = (0.001 if drafts_pay else 2.0) * tokens  # drafting dear: speculation cannot pay
    cost = CostModel(tokens, 1.0 + 0.001 * tokens, tokens, draft_seconds)
    engine, *_ = make_engine(k=3, max_num_seqs=8, cost_model=cost)
    for i in range(8):
        engine.add_request([i % VOCAB, 1], SamplingParams(temperature=1.0, max_tokens=300, ignore_eos=True))
    drafting_rows, planned = [], []
    while engine.estimator.n_observed_ < engine_module.WARMUP_LABELS and engine.has_unfinished_requests():
        before = engine.stats.drafted_per_position[0] if engine.stats.drafted_per_position else 0
        engine.step()
        assert engine._probing  # warm-up: whole drafts verified
        drafting_rows.append(engine.stats.drafted_per_position[0] - before)
        planned.append(engine.planner.depth)  # what the planner would have done (the prior's view)
    assert engine.estimator.n_observed_ >= engine_module.WARMUP_LABELS  # the warm-up ended
    rows, planned = np.array(drafting_rows), np.array(planned)
    if drafts_pay:
        assert (planned > 0).all() and (rows == 8).all()
    else:  # (the cost model soon learns that toy forwards are fast; until then speculation looks dear)
        assert (planned[:10] == 0).all()
        assert (rows[planned == 0] <= engine_module._PROBE_REQUESTS).all() and rows.min() > 0
        assert (rows[planned > 0] == 8).all()
    assert engine.stats.verified_tokens == engine.stats.drafted_tokens


def test_greedy_and_sampled_requests_train_their_own_estimators(tmp_path) -> None:
    import json

    engine, *_ = make_engine(k=3)
    for i in range(3):
        engine.add_request([i % VOCAB, 1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    run_all(engine)
    assert engine.greedy_estimator.n_observed_ > 0
    assert engine.estimator.n_observed_ == 0  # greedy labels never reach the sampled estimator
    engine.add_request([1, 2], SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
    greedy_before = engine.greedy_estimator.n_observed_
    run_all(engine)
    assert engine.estimator.n_observed_ > 0 and engine.greedy_estimator.n_observed_ == greedy_before
    # Both states survive a save / load; an older single-estimator file warms the sampled one.
    path = tmp_path / "state.json"
    engine.save_estimator_state(str(path))
    fresh, *_ = make_engine(k=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same feature: loads silently
        fresh.load_estimator_state(str(path))
    assert fresh.estimator.coef_[0] == engine.estimator.coef_[0]
    assert fresh.greedy_estimator.n_observed_ == engine.greedy_estimator.n_observed_
    old = tmp_path / "old.json"
    old.write_text(json.dumps(engine.estimator.state_dict()))
    older, *_ = make_engine(k=3)
    with pytest.warns(UserWarning, match="fitted on the feature 'logit_qmax'"):
        older.load_estimator_state(str(old))
    assert older.estimator.n_observed_ == engine.estimator.n_observed_
    assert older.greedy_estimator.n_observed_ == 0


def test_trace_flags_one_token_drafts_and_replaying_it_reproduces_the_engine(tmp_path) -> None:
    from specverify.calibration import calibration_report
    from specverify.trace import read_trace

    path = tmp_path / "trace.jsonl"
    engine, *_ = make_engine(k=3, max_num_seqs=4, record_trace=str(path))
    for i in range(8):
        engine.add_request(
            [i % VOCAB, 1], SamplingParams(temperature=1.0, top_p=0.7, max_tokens=12, seed=i, ignore_eos=True)
        )
    run_all(engine)
    engine.close()
    trace = read_trace(path)
    one = trace["features"]["one_token"]
    assert set(np.unique(one)) == {0.0, 1.0}  # both kinds of draft occurred
    # Top-p alone: one token is kept exactly where the untruncated q_max reaches top_p.
    assert np.array_equal(one == 1.0, trace["features"]["qmax"] >= 0.7)
    # The engine trained on logit(q_max) + the shift: replaying that feature from the trace gives back
    # the engine's own predictions, which plain logit(q_max) does not.
    report = calibration_report(trace)
    lab = trace["labelled"]
    engine_pred = trace["prediction"][lab]
    np.testing.assert_allclose(report["predictions"]["online"], engine_pred, atol=1e-9)
    assert not np.allclose(report["predictions"]["no_bonus"], engine_pred, atol=1e-3)


def test_plan_check_adds_up_the_planners_predictions_against_the_measured_steps(monkeypatch) -> None:
    import specverify.engine.llm_engine as engine_module
    from specverify.cost_model import CostModel

    monkeypatch.setattr(engine_module, "WARMUP_LABELS", 0)  # every step is the planner's own choice
    monkeypatch.setattr(engine_module, "_PROBE_MIN_STREAK", 10**9)
    monkeypatch.setattr(engine_module, "_PLAIN_MIN_OBS", 0)  # no plain-step probes either
    monkeypatch.setattr(engine_module, "_PLAIN_PROBE_EVERY", 10**9)
    tokens = np.array([1.0, 8.0, 64.0])
    # Verification nearly free, drafts cheap: the planner speculates, plainly decoding only at the end.
    cost = CostModel(tokens, 1.0 + 0.001 * tokens, tokens, 0.01 + 0.0001 * tokens)
    engine, *_ = make_engine(k=3, max_num_seqs=4, cost_model=cost)
    for i in range(4):
        engine.add_request([i % VOCAB, 2], SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True))
    want = {kind: engine_module.PlanCheck() for kind in ("speculative", "plain")}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        check = want["speculative" if engine.stats.last_draft_depth else "plain"]
        check.steps += 1
        check.predicted_seconds += engine.planner.expected_seconds
        check.measured_seconds += engine.stats.last_step_seconds
        check.expected_tokens += engine.planner.expected_tokens
        check.tokens += sum(len(out.new_token_ids) for out in outputs)
    got = engine.stats.plan_check
    assert got["speculative"].steps > 0
    assert sum(c.steps for c in got.values()) == engine.stats.steps
    for kind in want:
        for name in ("steps", "tokens"):
            assert getattr(got[kind], name) == getattr(want[kind], name)
        for name in ("predicted_seconds", "measured_seconds", "expected_tokens"):
            assert getattr(got[kind], name) == pytest.approx(getattr(want[kind], name))
    assert got["speculative"].tokens + got["plain"].tokens == engine.stats.output_tokens


def test_the_plans_depth_does_not_cap_drafting(monkeypatch) -> None:
    """The plan's depth only says whether speculation pays: each request drafts on while the per-row
    rule says its next slot pays, up to K, and stops where it says no."""
    from specverify.cost_model import CostModel

    tokens = np.array([1.0, 8.0, 64.0])
    engine, *_ = make_engine(k=4, cost_model=CostModel(tokens, 1.0 + 0.001 * tokens, tokens, 0.01 * tokens))
    engine.estimator.n_observed_ = engine.greedy_estimator.n_observed_ = 10**6  # past the warm-up
    monkeypatch.setattr(engine.planner, "choose_draft_depth", lambda *args, **kwargs: 1)
    engine.planner.threshold = 0.0  # verify whatever is drafted
    stop_after = [4, 2]  # request i drafts this many slots (the first stays active longest)

    def should_continue(survival_so_far, depth_done, *args, **kwargs):
        return np.array([depth_done < stop_after[i] for i in range(len(survival_so_far))])

    monkeypatch.setattr(engine.planner, "should_continue", should_continue)
    for i in range(2):
        engine.add_request([i + 1, 2], SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step()  # prefill and the first speculative step
    drafted = [r.metrics.drafted_per_position for r in engine.scheduler.running]
    assert [len(d) for d in drafted] == [4, 2]
