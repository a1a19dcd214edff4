"""`specverify bench` with a per-step log of the adaptive engines' planner and cost model (diagnostics).

    .venv/bin/python scripts/bench_steplog.py STEPLOG.jsonl [any `specverify bench` options]

The benchmark runs unchanged (same figures, same results.json); after every adaptive step one JSON line
records the batch size, the chosen depth, whether it was a warm-up / probe step, the measured and
predicted seconds and tokens, the cost model's plain and target predictions at this batch size, its
shared drift and per-curve levels, the planner's value of time and gain factor, the slots verified,
the planner's inputs (tokens each model had to consume first, the batch once waiting requests join) with
the predicted draft catch-up and prefill, each per-slot draft-on decision ([slot, survivals, last
acceptances, drafts on]), and every forward the cost model was fed ([curve, tokens,
seconds]).
Use it to see why the planner chose what it did where a point of the sweep disappoints.
"""

from __future__ import annotations

import json
import sys
import time

from specverify import cli
from specverify.cost_model import CostModel
from specverify.engine.llm_engine import LLMEngine
from specverify.planner import AdaptivePlanner


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    log = open(sys.argv[1], "w")  # noqa: SIM115 - open for the whole run
    step = LLMEngine.step
    choose = AdaptivePlanner.choose_draft_depth
    keep_on = AdaptivePlanner.should_continue
    observe_draft = CostModel.observe_draft
    observe_target = CostModel.observe_target
    observe_plain = CostModel.observe_plain
    inputs: dict = {}  # the planner's last inputs and this step's measured forwards

    def logged_choose(planner: AdaptivePlanner, num_requests: int, *args, **kwargs):
        inputs.clear()
        inputs.update(
            target_feed=kwargs.get("target_feed_tokens"),
            draft_feed=kwargs.get("draft_feed_tokens"),
            steady_requests=kwargs.get("steady_requests"),
            forwards=[],
        )
        cost = planner.cost
        if inputs["draft_feed"] is not None:
            catchup = cost.draft_time(inputs["draft_feed"]) - cost.draft_time(num_requests)
            inputs["catchup_predicted"] = round(float(catchup), 4)
        if inputs["target_feed"] is not None:
            prefill = cost.plain_time(inputs["target_feed"]) - cost.plain_time(num_requests)
            inputs["prefill_predicted"] = round(float(prefill), 4)
        return choose(planner, num_requests, *args, **kwargs)

    def logged_continue(planner: AdaptivePlanner, survival_so_far, depth_done: int, *args, **kwargs):
        goes_on = keep_on(planner, survival_so_far, depth_done, *args, **kwargs)
        last = kwargs.get("last_acceptance")
        inputs.setdefault("slots", []).append(
            [
                depth_done,
                [round(float(x), 3) for x in survival_so_far],
                None if last is None else [round(float(x), 3) for x in last],
                [bool(x) for x in goes_on],
            ]
        )
        return goes_on

    def logged(kind: str, original):
        def observe(cost: CostModel, tokens: int, seconds: float, *args):
            inputs.setdefault("forwards", []).append([kind, int(tokens), round(float(seconds), 4)])
            return original(cost, tokens, seconds, *args)

        return observe

    def logged_step(engine: LLMEngine):
        if engine.planner is None:
            return step(engine)
        start = time.perf_counter()
        outputs = step(engine)
        seconds = time.perf_counter() - start
        cost, planner, n = engine.planner.cost, engine.planner, engine.stats.last_batch_size
        row = {
            "requests": n,
            "depth": engine.stats.last_draft_depth,
            "probe": engine._probing,
            "seconds": round(seconds, 4),
            "predicted_seconds": round(planner.expected_seconds, 4),
            "expected_tokens": round(planner.expected_tokens, 2),
            "tokens": sum(len(o.new_token_ids) for o in outputs),
            "plain_predicted": round(float(cost.plain_time(n)), 4),
            "target_predicted": round(float(cost.target_time(n)), 4),
            "drift": round(cost.drift.value, 3),
            "level_target": round(cost.target.g, 3),
            "level_plain": round(cost.plain.g, 3),
            "level_draft": None if cost.draft is None else round(cost.draft.g, 3),
            "value_of_time": round(planner.value_of_time, 2),
            "gain_factor": round(planner.gain_factor, 3),
            "verified": engine.stats.last_verify_budget,
            **inputs,
        }
        inputs.clear()
        log.write(json.dumps(row) + "\n")
        log.flush()
        return outputs

    LLMEngine.step = logged_step
    AdaptivePlanner.choose_draft_depth = logged_choose
    AdaptivePlanner.should_continue = logged_continue
    CostModel.observe_draft = logged("draft", observe_draft)
    CostModel.observe_target = logged("target", observe_target)
    CostModel.observe_plain = logged("plain", observe_plain)
    try:
        return cli.main(["bench", *sys.argv[2:]])
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
