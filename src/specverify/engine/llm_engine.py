"""The step loop: schedule, draft, estimate, plan, verify in one target forward, accept, learn.

One `step()` moves every running request forward by at least one token. With speculation each request
drafts up to K tokens (batched draft forwards), the planner admits a prefix of each request's drafts, the
target verifies all admitted drafts of all requests in ONE flattened forward, and lossless rejection
sampling keeps a prefix plus one correction/bonus token. Both KV caches are then rolled back to what was
kept. Invariant between steps: each cache holds at most `num_tokens - 1` tokens of its request (the last
token is fed by the next step), so a step's feed is always `tokens[cache_length:]`.
"""

from __future__ import annotations

import time
import uuid
import warnings
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from specverify import sampler
from specverify.config import ConfigError, EngineConfig
from specverify.engine.kv_budget import GIB, KVBudget, default_kv_bytes
from specverify.engine.scheduler import Scheduler
from specverify.engine.sequence import PromptGroup, Request, RequestOutput
from specverify.engine.suffix_drafter import SUFFIX_FEATURE_ID
from specverify.features import ACCEPTANCE_FEATURE_ID
from specverify.logprobs import PositionLogprobs, token_logprobs
from specverify.models.base import ModelRunner
from specverify.planner import reached_acceptance
from specverify.sampling_params import SamplingParams

# How many recent draft features stand for "the next step's drafts" when choosing the draft depth.
_FEATURE_MEMORY = 512
# Labels the estimator must have seen before the planner may skip drafting or leave drafts unverified.
WARMUP_LABELS = 200
# With speculation off, a short fully verified probe (this depth, on at most this many requests: those
# whose draft has least to catch up) lets a pessimistic estimate be corrected. Every probed request first
# feeds the draft the tokens it missed, so probes are rationed: the predicted probe time may be at most
# _EXPLORATION_SHARE of the time spent decoding plainly since the last one, and never sooner than
# _PROBE_MIN_STREAK plain steps.
_PROBE_MIN_STREAK = 16
_PROBE_DEPTH = 2
_PROBE_REQUESTS = 4
_EXPLORATION_SHARE = 0.01
# With speculation on, a plain step now and then keeps plain decoding measured at the current load:
# otherwise its cost is only predicted, from the profile and a drift the speculative steps move, and a
# prediction that makes plain decoding look dear would never be checked. One while plain steps near this
# batch size have fewer than _PLAIN_MIN_OBS measurements, then one every _PLAIN_PROBE_EVERY
# speculative steps; never while speculation is predicted to beat plain decoding by _PLAIN_CHECK_MARGIN
# (plain steps would have to be that much cheaper than predicted to change the choice; at concurrency 4
# greedy on `edit`, suffix drafts ran 3x plain and the check's six plain steps cost ~10 % of the round).
_PLAIN_MIN_OBS = 3
_PLAIN_PROBE_EVERY = 64
_PLAIN_CHECK_MARGIN = 1.5
# Prompt tokens per forward when a prompt is scored (prompt logprobs): the forward's logits are
# [chunk, vocabulary] float32, 155 MB at 256 tokens of the default target's 151,936-token vocabulary.
_SCORING_CHUNK = 256


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string begins in `text` (None: none does)."""
    found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    return min(found) if found else None


def _add_fields(into, other) -> None:
    """Add a dataclass's numeric fields into another of its kind."""
    for f in fields(into):
        setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))


class PromptError(ValueError):
    """The prompt is empty, too long for the model, or holds invalid token ids."""


@dataclass
class StepTiming:
    """Measured times of one speculative step, fed back to the cost model."""

    target_tokens: int
    target_seconds: float
    draft_forwards: list[tuple[int, float]]  # (tokens fed, seconds) per draft forward
    context_tokens: int


@dataclass
class PlanCheck:
    """The planner's predictions for the steps it chose against what those steps measured."""

    steps: int = 0
    predicted_seconds: float = 0.0
    measured_seconds: float = 0.0
    expected_tokens: float = 0.0
    tokens: int = 0

    def add(self, other: PlanCheck) -> None:
        _add_fields(self, other)


@dataclass
class StepProfile:
    """Where step time goes, summed over steps (seconds). `bookkeeping` is the rest of each step:
    scheduling, KV truncation, emitting tokens, detokenising."""

    draft_forward: float = 0.0
    draft_sampling: float = 0.0  # draft probabilities, sampling, features
    planning: float = 0.0  # planner and estimator
    target_forward: float = 0.0
    target_sampling: float = 0.0  # target probabilities, verification
    bookkeeping: float = 0.0

    def add(self, other: StepProfile) -> None:
        _add_fields(self, other)


@dataclass
class EngineStats:
    """Cumulative counters (the server exports them; the benchmark reads them)."""

    steps: int = 0
    output_tokens: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    step_seconds_total: float = 0.0
    planning_seconds_total: float = 0.0
    preemptions: int = 0  # running requests taken out to keep the KV caches within budget
    kv_cache_tokens: int = 0  # cache positions the running requests are counted at (KVBudget)
    kv_cache_bytes: int = 0  # what those positions take in both models
    kv_budget_bytes: int = 0  # the KV budget (0: none)
    profile: StepProfile = field(default_factory=StepProfile)
    last_step_seconds: float = 0.0
    last_batch_size: int = 0
    last_draft_depth: int = 0
    last_verify_budget: int = 0
    # Adaptive steps the planner chose (warm-up and probes excluded), speculative and plain apart: do its
    # predicted seconds and tokens match the measured ones?
    plan_check: dict[str, PlanCheck] = field(
        default_factory=lambda: {"speculative": PlanCheck(), "plain": PlanCheck()}
    )

    def count_slots(self, drafted: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        self.drafted_tokens += int(drafted.sum())
        self.verified_tokens += int(verified.sum())
        self.accepted_tokens += int(accepted.sum())
        depth = int(drafted.max(initial=0))
        for counts, per_request in (
            (self.drafted_per_position, drafted),
            (self.verified_per_position, verified),
            (self.accepted_per_position, accepted),
        ):
            if len(counts) < depth:
                counts.extend([0] * (depth - len(counts)))
            for k in range(depth):
                counts[k] += int((per_request > k).sum())


class LLMEngine:
    """Speculative-decoding engine over two `ModelRunner`s (target and optional draft)."""

    def __init__(
        self,
        target: ModelRunner,
        tokenizer,
        config: EngineConfig | None = None,
        draft: ModelRunner | None = None,
        cost_model=None,
        model_name: str = "target",
    ) -> None:
        self.config = config or EngineConfig()
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.spec = self.config.speculative
        self.suffix = None  # the suffix drafter (method "suffix"), which needs no draft model
        if self.spec is not None and self.spec.method == "suffix":
            from specverify.engine.suffix_drafter import SuffixDrafter

            self.suffix = SuffixDrafter(target.vocab_size, self.spec.suffix_cache_tokens)
            self.draft = None
        elif self.spec is not None and draft is None:
            raise ConfigError("a speculative config needs a draft model runner")
        if self.spec is None:
            self.draft = None
        if self.draft is not None and self.draft.vocab_size != target.vocab_size:
            raise ConfigError(
                f"draft and target vocabularies differ ({self.draft.vocab_size} vs {target.vocab_size} "
                "tokens): speculative decoding needs a draft model with the target's tokenizer"
            )
        limits = [target.max_model_len] + ([self.draft.max_model_len] if self.draft is not None else [])
        if self.config.max_model_len is not None:
            limits.append(self.config.max_model_len)
        self.max_model_len = min(limits)
        self.eos_token_ids = self._eos_ids(tokenizer, target)
        self._shared_prompts: dict[int, int] = {}  # prompt caches of several samples: seq id -> tokens
        self._kv_exhausted: list[Request] = []  # requests ended because they filled the KV budget alone
        self.kv = self._make_kv_budget()
        self.scheduler = Scheduler(
            self.config.max_num_seqs, self.config.max_prefill_tokens, self._kv_fits if self.kv else None
        )
        self.stats = EngineStats()
        self.stats.kv_budget_bytes = self.kv.budget_bytes if self.kv is not None else 0
        self._seed_source = np.random.SeedSequence(self.config.seed)
        self.incremental_text = False  # the server turns this on to stream text deltas
        self.estimator = None  # acceptance estimator for sampled requests (temperature > 0)
        self.greedy_estimator = None  # and for greedy ones: exact-match acceptance relates differently
        self.planner = None
        self.calibration = None
        self.trace = None
        self._recent_features: list[np.ndarray] = []
        self._plain_streak = 0
        self._speculative_streak = 0
        self._plain_seconds = 0.0  # predicted time of the plain steps since the last probe
        self._probing = False
        self._probe_rows: np.ndarray | None = None  # rows drafting in a probe step (None: all)
        self._token_text: dict[int, str] = {}  # decoded single tokens, for log-probability entries
        if self.spec is not None:
            self._init_speculation(cost_model)

    # ---- set-up -------------------------------------------------------------------------------------

    def _init_speculation(self, cost_model) -> None:
        from specverify.calibration import RollingCalibration
        from specverify.estimator import AcceptanceEstimator

        k = self.spec.num_speculative_tokens
        try:
            self.estimator = AcceptanceEstimator(k, **self.spec.estimator)
            self.greedy_estimator = AcceptanceEstimator(k, **self.spec.estimator)
        except TypeError as e:
            raise ConfigError(f"bad estimator options {self.spec.estimator}: {e}") from e
        if self.spec.estimator_state:
            self.load_estimator_state(self.spec.estimator_state)
        self.calibration = RollingCalibration()
        if self.spec.enable_adaptive_verification:
            from specverify.planner import AdaptivePlanner  # looked up here: tests swap in their planners

            if cost_model is None:
                from specverify.cost_model import CostModel
                from specverify.profiling import profile_runners

                profile = profile_runners(self.target, self.draft, tokens_per_seq=k + 1)
                cost_model = CostModel.from_profile(profile)
            self.planner = AdaptivePlanner(cost_model, k)
        if self.config.record_trace:
            from specverify.trace import TraceWriter

            self.trace = TraceWriter(self.config.record_trace, drafter=self.drafter)

    @property
    def drafter(self) -> str | None:
        """The speculative method ("draft_model" or "suffix"); None without speculation."""
        return None if self.spec is None else self.spec.method

    @property
    def feature_id(self) -> str:
        """The estimator's input, as saved states name it: each drafter has its own."""
        return SUFFIX_FEATURE_ID if self.suffix is not None else ACCEPTANCE_FEATURE_ID

    def estimator_state(self) -> dict:
        """Both acceptance estimators' states (sampled and greedy requests), JSON-ready."""
        if self.greedy_estimator is None:  # an estimator set from outside (tests, tools): just its own
            return self.estimator.state_dict()
        return {
            "kind": "SpeculationEstimators",
            "drafter": self.drafter,
            "feature": self.feature_id,
            "sampled": self.estimator.state_dict(),
            "greedy": self.greedy_estimator.state_dict(),
        }

    def load_estimator_dict(self, state: dict) -> None:
        """Warm start from `estimator_state()`; a single estimator's state (older files) warms the
        sampled-request estimator only. A state fitted on another feature still loads (it is close, and
        the fit follows new labels within its half-life) but says so; one of another drafter is refused."""
        combined = isinstance(state, dict) and state.get("kind") == "SpeculationEstimators"
        # States saved before there were several drafters came from the draft model.
        drafter = state.get("drafter", "draft_model") if combined else "draft_model"
        if drafter != self.drafter:
            raise ConfigError(
                f"the estimator state was fitted on {drafter!r} drafts, this engine drafts with "
                f"{self.drafter!r}: each drafter needs its own estimator state"
            )
        if combined:
            self.estimator.load_state_dict(state["sampled"])
            self.greedy_estimator.load_state_dict(state["greedy"])
            feature = state.get("feature", "logit_qmax")
        else:
            self.estimator.load_state_dict(state)
            feature = "logit_qmax"
        if feature != self.feature_id:
            warnings.warn(
                f"the estimator state was fitted on the feature {feature!r}, this engine uses "
                f"{self.feature_id!r}: its predictions are off until it has re-fitted on new labels",
                stacklevel=2,
            )

    def load_estimator_state(self, path: str) -> None:
        import json

        with open(path) as f:
            self.load_estimator_dict(json.load(f))

    def save_estimator_state(self, path: str) -> None:
        """Write `estimator_state()` as JSON beside `path`, flush it to disk, then rename it over `path`:
        a crash (even `kill -9`) mid-write leaves the previous complete file."""
        import contextlib
        import json
        import os

        if self.estimator is None:
            return
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(self.estimator_state(), f)
                f.flush()
                os.fsync(f.fileno())  # the rename must never publish a file whose data is not on disk
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def speculation_state(self) -> dict | None:
        """What this engine has learned about its drafts, to carry into another engine over the same
        pair (as a long-running server keeps it): the estimator's state, the recent draft features
        that stand for the next steps' drafts when a depth is chosen, and the planner's realised-gain
        sums. None without speculation."""
        if self.estimator is None:
            return None
        k = self.spec.num_speculative_tokens
        recent = np.concatenate(self._recent_features) if self._recent_features else np.zeros((0, k))
        state = {"estimator": self.estimator_state(), "recent_features": recent.tolist()}
        if self.planner is not None:
            state["planner_gain"] = self.planner.gain_state()
        return state

    def load_speculation_state(self, state: dict) -> None:
        """Warm start from `speculation_state()`."""
        if self.estimator is None:
            raise ConfigError("this engine does not speculate: there is no speculation state to load")
        self.load_estimator_dict(state["estimator"])
        self._recent_features = []
        recent = np.asarray(state.get("recent_features", []), dtype=np.float64)
        if recent.size:  # rows of draft features per position (NaN: not drafted); the newest are kept
            rows = recent.reshape(len(recent), -1)
            from_row_on = np.cumsum(np.isfinite(rows)[::-1].sum(axis=1))[::-1]  # features from row i on
            enough = np.flatnonzero(from_row_on >= _FEATURE_MEMORY)
            self._remember_features(rows[enough[-1] if enough.size else 0 :])
        if self.planner is not None and "planner_gain" in state:
            self.planner.load_gain_state(state["planner_gain"])

    @staticmethod
    def _eos_ids(tokenizer, target) -> set[int]:
        ids = set(getattr(target, "eos_token_ids", ()) or ())
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        return ids

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        ids = list(prompt_token_ids)
        if not ids:
            raise PromptError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt has {len(ids)} tokens but the model accepts at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len}, leaving room for one generated token)"
            )
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.target.vocab_size]
        if bad:
            raise PromptError(f"prompt token ids out of range [0, {self.target.vocab_size}): {bad[:5]}")
        if self.kv is not None and not self.kv.fits_alone(len(ids)):
            raise PromptError(
                f"the prompt has {len(ids)} tokens, whose KV cache ({self.kv.describe(self.kv.tokens(len(ids)))}"
                f") would not fit in the KV cache budget ({self.kv.describe(self.kv.budget_tokens)}); send a "
                "shorter prompt or give the server more kv_cache_memory"
            )
        for token in list(params.logit_bias) + list(params.banned_token_ids):
            if not 0 <= int(token) < self.target.vocab_size:
                raise ValueError(f"token id {token} in logit_bias/banned_token_ids is out of the vocabulary")
        seed = (
            params.seed
            if params.seed is not None
            else int(self._seed_source.spawn(1)[0].generate_state(1)[0])
        )
        request_id = request_id or uuid.uuid4().hex
        group = PromptGroup(request_id) if params.n > 1 else None
        for index in range(params.n):
            # Sample 0 keeps the request's seed, so n = 1 draws as before; the others get their own.
            sample_seed = (
                seed if index == 0 else int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
            )
            request = Request(
                request_id=request_id if group is None else f"{request_id}-{index}",
                prompt_token_ids=ids,
                params=params,
                generator=torch.Generator().manual_seed(sample_seed),
                arrival_time=time.perf_counter(),
                group=group,
                index=index,
                logprobs=[] if params.logprobs is not None else None,
            )
            if group is not None:
                group.waiting.add(request.seq_id)
            self.scheduler.add(request)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Abort a request: all its samples when it asked for several."""
        for request in [*self.scheduler.waiting, *self.scheduler.running]:
            if request.group_id == request_id and self.scheduler.remove(request.request_id) is not None:
                request.finished, request.finish_reason = True, "abort"
                self._release(request)

    def has_unfinished_requests(self) -> bool:
        return len(self.scheduler) > 0

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.scheduler.schedule()
        start = time.perf_counter()
        outputs = []
        if self.kv is not None:
            self._preempt_over_budget()
            outputs += [self._emit(r, [], None) for r in self._kv_exhausted]
            self._kv_exhausted.clear()
            self.stats.kv_cache_tokens = self.kv.in_use(self.scheduler.running, self._shared_prompts.values())
            self.stats.kv_cache_bytes = self.stats.kv_cache_tokens * self.kv.bytes_per_token
        scheduled = list(self.scheduler.running)
        if not scheduled:
            return outputs
        busy = self._prefill_phase(scheduled)
        ready = [r for r in scheduled if id(r) not in busy]
        # max_tokens = 0: prefilled (and scored) only, they finish here without decoding.
        outputs += [self._emit(r, [], None) for r in ready if r.params.max_tokens == 0]
        running = [r for r in ready if r.params.max_tokens > 0]
        if not running:  # only prefill chunks this step: their time still counts (the profile has it)
            self.scheduler.finish([r for r in scheduled if r.finished])
            self.stats.step_seconds_total += time.perf_counter() - start
            return outputs
        # Which requests decode greedily: they use the greedy estimator (computed once per step).
        greedy = self._greedy_rows(running)
        depth = self._draft_depth(running, greedy)
        if depth == 0:
            new_tokens, new_logprobs = self._plain_step(running)
        else:
            new_tokens, new_logprobs = self._speculative_step(running, depth, greedy)
        outputs += [
            self._emit(request, tokens, entries)
            for request, tokens, entries in zip(running, new_tokens, new_logprobs, strict=True)
        ]
        self.scheduler.finish([r for r in scheduled if r.finished])
        elapsed = time.perf_counter() - start
        stats = self.stats
        profile = stats.profile
        profile.planning = stats.planning_seconds_total
        measured = sum(getattr(profile, f.name) for f in fields(profile) if f.name != "bookkeeping")
        stats.steps += 1
        stats.step_seconds_total += elapsed
        profile.bookkeeping = stats.step_seconds_total - measured
        stats.last_step_seconds = elapsed
        stats.last_batch_size = len(running)
        stats.last_draft_depth = depth
        if self.planner is not None and not self._probing:
            emitted = sum(map(len, new_tokens))
            check = stats.plan_check["speculative" if depth else "plain"]
            check.steps += 1
            check.predicted_seconds += self.planner.expected_seconds
            check.measured_seconds += elapsed
            check.expected_tokens += self.planner.expected_tokens
            check.tokens += emitted
            if depth:
                self.planner.observe_tokens(emitted)
        return outputs

    def _draft_depth(self, running: list[Request], greedy: np.ndarray) -> int:
        self._probe_rows = None
        if self.spec is None:
            return 0
        k = self.spec.num_speculative_tokens
        if self.planner is None:
            return k
        start = time.perf_counter()
        context = sum(r.num_tokens for r in running)
        draft_lags = np.array([self._draft_lag(r) for r in running])
        target_feed = sum(r.num_tokens - self.target.cache_length(r.seq_id) for r in running)
        depth = int(
            self.planner.choose_draft_depth(
                len(running),
                self._expected_acceptance(float(greedy.mean())),
                context,
                target_feed_tokens=target_feed,
                draft_feed_tokens=int(draft_lags.sum()),
                remaining_tokens=float(np.mean([r.remaining for r in running])),
                steady_requests=min(self.config.max_num_seqs, len(running) + self.num_waiting),
            )
        )
        # Exploration: full drafts until the estimator knows the pair, then a short probe now and then
        # while speculation is off, so a pessimistic estimate or a changed workload can still be seen.
        # Both depend only on counters and earlier steps, never on drafts: losslessness is untouched.
        self._probing = any(
            est.n_observed_ < WARMUP_LABELS
            for est, present in ((self.estimator, (~greedy).any()), (self.greedy_estimator, greedy.any()))
            if present
        )
        if self._probing:
            if depth == 0:
                # Where even the prior says speculation does not pay (high load), the warm-up's labels
                # come from the few requests whose draft has least to catch up (drafting the whole batch
                # made a cold greedy run at concurrency 16 lose 12 % to plain decoding, mostly there).
                self._probe_rows = self._least_lagging(draft_lags)
            self.stats.planning_seconds_total += time.perf_counter() - start
            return k
        if depth > 0:
            self._plain_streak, self._plain_seconds = 0, 0.0
            self._speculative_streak += 1
            # Never on a step that prefills: the draft would miss the prompts, and their catch-up then
            # kept a whole c4 round plain where speculation ran 1.5x plain in the steady state.
            plain_rate = len(running) / max(float(self.planner.cost.plain_time(len(running))), 1e-12)
            if (
                target_feed == len(running)
                and self.planner.expected_rate < _PLAIN_CHECK_MARGIN * plain_rate
                and (
                    self._speculative_streak > _PLAIN_PROBE_EVERY
                    or self.planner.cost.plain_observations(len(running)) < _PLAIN_MIN_OBS
                )
            ):
                self._speculative_streak = 0
                self._probing = True
                self.stats.planning_seconds_total += time.perf_counter() - start
                return 0
        else:
            self._plain_streak += 1
            self._plain_seconds += float(self.planner.cost.plain_time(len(running)))
        if self._plain_streak > _PROBE_MIN_STREAK:
            rows = self._least_lagging(draft_lags)
            if (
                self._probe_seconds(len(running), draft_lags[rows])
                <= _EXPLORATION_SHARE * self._plain_seconds
            ):
                self._plain_streak, self._plain_seconds = 0, 0.0
                # No probe where even better drafts could not pay at this load: it would only cost.
                if self.planner.could_pay(len(running), context):
                    self._probing, self._probe_rows = True, rows
                    depth = min(_PROBE_DEPTH, k)
        if depth > 0 and not self._probing:
            # The plan said speculation pays; how deep each request drafts is the per-row rule's call (capped
            # at the plan's depth, T=1 at one request ran 0.95x fixed K=5, 0.99x uncapped).
            depth = k
        self.stats.planning_seconds_total += time.perf_counter() - start
        return depth

    def _draft_lag(self, request: Request) -> int:
        """Tokens the drafter must read before it drafts for `request` (the suffix drafter reads for free)."""
        return 0 if self.draft is None else request.num_tokens - self.draft.cache_length(request.seq_id)

    @staticmethod
    def _least_lagging(draft_lags: np.ndarray) -> np.ndarray:
        """Rows of the requests whose draft has least to catch up: who drafts in a probe or warm-up."""
        return np.argsort(draft_lags, kind="stable")[:_PROBE_REQUESTS]

    def _probe_seconds(self, num_requests: int, lags: np.ndarray) -> float:
        """Predicted extra time of a probe step over a plain one: the probed requests' draft catch-up,
        the probe's other draft forwards, and the verification of its drafts."""
        cost, n, d = self.planner.cost, len(lags), min(_PROBE_DEPTH, self.spec.num_speculative_tokens)
        drafting = cost.draft_time(int(lags.sum())) + (d - 1) * cost.draft_time(n)
        return float(drafting + cost.target_time(num_requests + n * d) - cost.plain_time(num_requests))

    def _expected_acceptance(self, greedy_fraction: float = 0.0) -> np.ndarray:
        """Mean predicted acceptance per position over recent drafts, each slot weighted by the chance it
        was reached (`planner.reached_acceptance`), mixing the greedy and sampled estimators as the batch
        does. None seen: the estimators' value at x = 0 (NaN positions are filled by the planner)."""
        k = self.spec.num_speculative_tokens
        rows = np.concatenate(self._recent_features) if self._recent_features else np.zeros((1, k))
        sampled = reached_acceptance(self.estimator.predict(rows))
        if greedy_fraction <= 0.0:
            return sampled
        greedy = reached_acceptance(self.greedy_estimator.predict(rows))
        return (1.0 - greedy_fraction) * sampled + greedy_fraction * greedy

    @staticmethod
    def _greedy_rows(requests: list[Request]) -> np.ndarray:
        return np.array([r.params.temperature == 0 for r in requests], dtype=bool)

    def _predict(self, features: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """Acceptance probabilities [R, K], each row from its sampling regime's estimator."""
        out = np.empty(features.shape)
        for est, rows in ((self.estimator, ~greedy), (self.greedy_estimator, greedy)):
            if rows.any():
                out[rows] = est.predict(features[rows])
        return out

    def _remember_features(self, features: np.ndarray) -> None:
        """Keep this step's drafted rows ([R, depth], NaN = not drafted), padded to K positions, until
        _FEATURE_MEMORY newer features stand for the next steps' drafts."""
        k = self.spec.num_speculative_tokens
        rows = features[np.isfinite(features).any(axis=1), :k]
        if not rows.size:
            return
        if rows.shape[1] < k:
            rows = np.concatenate([rows, np.full((rows.shape[0], k - rows.shape[1]), np.nan)], axis=1)
        self._recent_features.append(rows)
        counts = [int(np.isfinite(f).sum()) for f in self._recent_features]
        total = sum(counts)
        while total - counts[0] >= _FEATURE_MEMORY:
            total -= counts.pop(0)
            self._recent_features.pop(0)

    def _uniforms(self, requests: list[Request], n: int) -> torch.Tensor:
        return torch.stack([torch.rand(n, generator=r.generator) for r in requests])

    def _feeds(self, runner: ModelRunner, requests: list[Request]) -> list[list[int]]:
        return [r.tokens[runner.cache_length(r.seq_id) :] for r in requests]

    def _plain_step(self, running: list[Request]) -> tuple[list[list[int]], list]:
        params = [r.params for r in running]
        feeds = self._feeds(self.target, running)
        profile = self.stats.profile
        start = time.perf_counter()
        logits = self.target.forward([r.seq_id for r in running], feeds, [1] * len(running))
        forwarded = time.perf_counter()
        probs = sampler.probabilities(sampler.apply_target_transforms(logits, params), params)
        tokens = [[t] for t in sampler.sample(probs, self._uniforms(running, 1)[:, 0]).tolist()]
        done = time.perf_counter()
        profile.target_forward += forwarded - start
        profile.target_sampling += done - forwarded
        if self.planner is not None:
            # Plain steps keep their own cost curve fresh (speculation may be off at this load).
            self.planner.cost.observe_plain(sum(map(len, feeds)), done - start)
            self.planner.end_plain_step(len(running))
        return tokens, self._emitted_logprobs(running, logits, list(range(len(running))), tokens)

    def _speculative_step(
        self, running: list[Request], depth: int, greedy: np.ndarray
    ) -> tuple[list[list[int]], list]:
        r_count = len(running)
        profile = self.stats.profile
        # Never draft past what the request may still emit, nor past the context window.
        caps = np.array(
            [max(0, min(depth, r.remaining - 1, self.max_model_len - r.num_tokens)) for r in running]
        )
        if self._probe_rows is not None:  # a probe drafts for a few requests; the others decode plainly
            probed = np.zeros(r_count, dtype=bool)
            probed[self._probe_rows] = True
            caps[~probed] = 0
        draft_tokens = torch.zeros(r_count, depth, dtype=torch.long)
        # Slot (r, k)'s draft distribution is row draft_row[r, k] of the slots' rows stacked in order.
        draft_dists: list[sampler.SparseRows] = []
        draft_row = torch.zeros(r_count, depth, dtype=torch.long)
        features = np.full((r_count, depth), np.nan)
        raw_qmax = np.full((r_count, depth), np.nan)
        survival = np.ones((r_count, depth))
        drafted = np.zeros(r_count, dtype=np.int64)
        keep_going = np.ones(r_count, dtype=bool)
        trace_features: dict[str, np.ndarray] | None = None
        draft_timings: list[tuple[int, float]] = []
        subset = getattr(self.draft, "logit_token_ids", None)  # a draft LM head over part of the vocabulary
        # Slots where the drafter had nothing to propose (suffix: no context matched): zero survival.
        nothing = np.zeros((r_count, depth), dtype=bool)
        if self.suffix is not None:
            start = time.perf_counter()
            self.suffix.sync(running)
            profile.draft_sampling += time.perf_counter() - start
        for k in range(depth):
            draft_start = time.perf_counter()
            active = np.flatnonzero((caps > k) & keep_going)
            if active.size == 0:
                break
            if self.suffix is not None:
                slot = self.suffix.draft_slot(
                    [running[i] for i in active],
                    [draft_tokens[i, :k].tolist() for i in active],
                    greedy[active],
                )
                nothing[active[~slot.matched], k:] = True
                keep_going[active[~slot.matched]] = False
                active = active[slot.matched]
                q, trace_values = slot.q, slot.trace
                features[active, k], raw_qmax[active, k] = slot.features, slot.qmax
                drawn = torch.tensor(slot.drawn, dtype=torch.long)
                forwarded = draft_start  # no forward: all of it is drafting work
            else:
                reqs = [running[i] for i in active]
                if k == 0:
                    feeds = self._feeds(self.draft, reqs)
                else:
                    feeds = [[int(draft_tokens[i, k - 1])] for i in active]
                logits = self.draft.forward([r.seq_id for r in reqs], feeds, [1] * len(reqs))
                forwarded = time.perf_counter()
                params = [r.params for r in reqs]
                q = sampler.probabilities(logits, params)
                if subset is not None:
                    q = q.map_tokens(subset, self.target.vocab_size)
                features[active, k], raw_qmax[active, k], one_token = self._slot_features(logits, params, q)
                if self.trace is not None:
                    trace_values = self._trace_values(logits, params, one_token)
                drawn = sampler.sample(q, self._uniforms(reqs, 1)[:, 0])
            if active.size:
                idx = torch.from_numpy(active)
                draft_tokens[idx, k] = drawn
                draft_row[idx, k] = torch.arange(len(active)) + int(drafted.sum())  # rows stacked so far
                draft_dists.append(q)
                drafted[active] += 1
                if self.trace is not None:
                    trace_features = self._store_trace(
                        trace_features, trace_values, active, k, r_count, depth
                    )
            profile.draft_forward += forwarded - draft_start
            profile.draft_sampling += time.perf_counter() - forwarded
            if self.planner is not None and active.size:
                # Only distributions up to slot k (and so tokens before k) decide whether to draft k + 1.
                start = time.perf_counter()
                p = self._predict(features[active, : k + 1], greedy[active])[:, k]
                survival[active, k] = (survival[active, k - 1] if k else 1.0) * p
                if not self._probing:  # warm-up and probes draft their whole depth: uncensored labels
                    keep_going[active] = self.planner.should_continue(
                        survival[active, k], k + 1, last_acceptance=p
                    )
                self.stats.planning_seconds_total += time.perf_counter() - start
            if self.draft is not None:
                draft_timings.append((sum(map(len, feeds)), time.perf_counter() - draft_start))
        survival[np.arange(depth)[None, :] >= drafted[:, None]] = 0.0

        num_verified = self._admit(survival, drafted)
        target_feeds = [
            self._feeds(self.target, [r])[0] + draft_tokens[i, : num_verified[i]].tolist()
            for i, r in enumerate(running)
        ]
        verify_start = time.perf_counter()
        logits = self.target.forward([r.seq_id for r in running], target_feeds, (num_verified + 1).tolist())
        forwarded = time.perf_counter()
        row_params = [r.params for r, n in zip(running, num_verified, strict=True) for _ in range(n + 1)]
        target = sampler.probabilities(sampler.apply_target_transforms(logits, row_params), row_params)
        # Position j of request r is row first[r] + j of the target's rows.
        first = torch.from_numpy(np.concatenate([[0], np.cumsum(num_verified + 1)[:-1]]))
        target_row = first[:, None] + torch.arange(depth + 1)[None, :]
        uniforms = self._uniforms(running, depth + 1)
        accepted, final = sampler.verify(
            draft_tokens,
            sampler.SparseRows.cat(draft_dists, self.target.vocab_size),
            draft_row,
            target,
            target_row,
            torch.from_numpy(num_verified),
            uniforms[:, :depth],
            uniforms[:, depth],
        )
        accepted_np = accepted.numpy()
        verified_at = time.perf_counter()
        profile.target_forward += forwarded - verify_start
        profile.target_sampling += verified_at - forwarded
        timing = StepTiming(
            target_tokens=sum(len(f) for f in target_feeds),
            target_seconds=verified_at - verify_start,
            draft_forwards=draft_timings,
            context_tokens=sum(r.num_tokens for r in running),
        )
        self._learn(
            running,
            greedy,
            features,
            raw_qmax,
            survival,
            nothing,
            drafted,
            num_verified,
            accepted_np,
            trace_features,
            timing,
        )

        new_tokens = []
        for i, request in enumerate(running):
            a = int(accepted_np[i])
            kept = request.num_tokens + a
            self.target.truncate(request.seq_id, kept)
            if self.draft is not None and self.draft.cache_length(request.seq_id) > kept:
                self.draft.truncate(request.seq_id, kept)
            new_tokens.append(draft_tokens[i, :a].tolist() + [int(final[i])])
            request.metrics.add(int(drafted[i]), int(num_verified[i]), a)
        # Every kept token's log-probabilities come from the row of the forward that verified it.
        return new_tokens, self._emitted_logprobs(running, logits, first.tolist(), new_tokens)

    def _slot_features(
        self, logits: torch.Tensor, params: list[SamplingParams], q: sampler.SparseRows
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(estimator feature, raw q_max, keeps one token) per row of one draft slot.

        The feature is logit(q_max) of the draft model at the request's temperature (greedy: 1) before
        top-p, shifted where `q`, the distribution the draft token is drawn from, keeps one token
        (features.acceptance_feature). It looks at distributions only, never at the token drawn from
        them (losslessness, §5).
        """
        from specverify.features import acceptance_feature, keeps_one_token, logit_qmax

        temps = logits.new_tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        x = logit_qmax(logits.float() / temps[:, None], temperature=1.0, scratch=True)
        x = x.double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
        one_token = keeps_one_token(q).numpy()
        return acceptance_feature(x, one_token), 1.0 / (1.0 + np.exp(-x)), one_token

    @staticmethod
    def _trace_values(logits, params, one_token) -> dict[str, np.ndarray]:
        """Every trace feature of one slot of the draft model's rows."""
        from specverify.features import all_features

        values = all_features(
            logits,
            temperature=[p.temperature for p in params],
            top_p=[p.top_p for p in params],
            top_k=[p.top_k for p in params],
        )
        values = {
            name: v.double().cpu().numpy() if isinstance(v, torch.Tensor) else v for name, v in values.items()
        }
        values["one_token"] = one_token.astype(np.float64)
        return values

    @staticmethod
    def _store_trace(acc, values, active, k, r_count, depth) -> dict[str, np.ndarray]:
        """Put one slot's trace features (rows `active`, slot k) into the step's [R, depth] arrays."""
        if acc is None:
            acc = {name: np.full((r_count, depth), np.nan) for name in values}
        for name, v in values.items():
            acc[name][active, k] = v
        return acc

    def _admit(self, survival: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        if self.planner is None or self._probing:
            # Warm-up and probes verify whole drafts: labels trimmed by a still-uninformed estimator
            # would be censored, and a pessimistic prior could then never learn it was wrong.
            verified = drafted.copy()
        else:
            start = time.perf_counter()
            verified = np.minimum(np.asarray(self.planner.admit(survival), dtype=np.int64), drafted)
            self.stats.planning_seconds_total += time.perf_counter() - start
        self.stats.last_verify_budget = int(verified.sum())
        return verified

    def _learn(
        self,
        running,
        greedy,
        features,
        raw_qmax,
        survival,
        nothing,
        drafted,
        verified,
        accepted,
        trace_features,
        timing,
    ) -> None:
        start = time.perf_counter()
        self.stats.count_slots(drafted, verified, accepted)
        predictions = self._predict(features, greedy)
        trains = np.array([not r.params.alters_target for r in running])
        depth = features.shape[1]
        slots = np.arange(depth)[None, :]
        labelled = (slots < verified[:, None]) & (slots <= accepted[:, None]) & trains[:, None]
        labels = (slots < accepted[:, None]).astype(np.float64)
        self.calibration.update(predictions[labelled], labels[labelled], raw_qmax[labelled])
        for est, rows in ((self.estimator, trains & ~greedy), (self.greedy_estimator, trains & greedy)):
            if rows.any():
                est.observe(features[rows], verified[rows], accepted[rows])
        self._remember_features(features)
        if self.planner is not None:
            # The survivals computed while drafting (0 beyond each request's drafted depth).
            self.planner.end_step(
                survival,
                verified,
                nothing_to_draft=nothing,
                target_tokens=timing.target_tokens,
                target_seconds=timing.target_seconds,
                draft_forwards=timing.draft_forwards,
                context_tokens=timing.context_tokens,
            )
        self.stats.planning_seconds_total += time.perf_counter() - start
        if self.trace is not None:
            self.trace.write_step(
                request_ids=[r.request_id for r in running],
                step=self.stats.steps,
                features=trace_features,
                predictions=predictions,
                num_drafted=drafted,
                num_verified=verified,
                num_accepted=accepted,
                trains=trains,
            )

    # ---- output -------------------------------------------------------------------------------------

    def _emit(
        self, request: Request, tokens: list[int], entries: list[PositionLogprobs] | None
    ) -> RequestOutput:
        appended = []
        if request.params.max_tokens == 0:
            request.finished, request.finish_reason = True, "length"
        for at, token in enumerate(tokens):
            request.output_token_ids.append(token)
            appended.append(token)
            if request.logprobs is not None:
                request.logprobs.append(entries[at])
            if token in self.eos_token_ids and not request.params.ignore_eos:
                request.finished, request.finish_reason = True, "stop"
            elif token in request.params.stop_token_ids:
                request.finished, request.finish_reason = True, "stop"
            elif request.remaining <= 0 or request.num_tokens >= self.max_model_len:
                request.finished, request.finish_reason = True, "length"
            if request.finished:
                break
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        if request.params.stop or request.finished or self.incremental_text:
            dropped = self._update_text(request, len(appended))
            if dropped:
                del appended[len(appended) - dropped :]
        self.stats.output_tokens += len(appended)
        if request.finished:
            self._release(request)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            new_token_ids=appended,
            text=request.text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            metrics=request.metrics,
            group_id=request.group_id,
            index=request.index,
            logprobs=None if request.logprobs is None else list(request.logprobs),
            prompt_logprobs=request.prompt_logprobs,
        )

    def _update_text(self, request: Request, appended: int) -> int:
        """Decode the output; at a stop string, cut the text there and end the request. Returns how many
        of the `appended` new tokens were dropped: plain decoding stops at the first token whose text
        holds a stop string, so drafts accepted after it in the same step are not output either."""
        ids, stops = request.output_token_ids, request.params.stop
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = _first_stop(text, stops)
        dropped = 0
        if cut is not None:
            for length in range(len(ids) - appended + 1, len(ids)):
                shorter = self.tokenizer.decode(ids[:length], skip_special_tokens=True)
                if _first_stop(shorter, stops) is not None:
                    dropped = len(ids) - length
                    del ids[length:]
                    if request.logprobs is not None:
                        del request.logprobs[length:]
                    text, cut = shorter, _first_stop(shorter, stops)
                    break
            text = text[:cut]
            request.finished, request.finish_reason = True, "stop"
        request.text = text
        return dropped

    def _free_caches(self, seq_id: int) -> None:
        """Free a sequence's KV caches in both models."""
        self.target.release(seq_id)
        if self.draft is not None:
            self.draft.release(seq_id)

    def _release(self, request: Request) -> None:
        self._free_caches(request.seq_id)
        if self.suffix is not None:
            self.suffix.release(request)
        if request.group is not None:
            self._leave_group(request)

    # ---- prompts prefilled before their first step: scored prompts, prompts of several samples ------

    def _prefill_phase(self, scheduled: list[Request]) -> set[int]:
        """Prefill, in chunks of at most `max_prefill_tokens` per step (all requests together), what must
        be prefilled apart from the step's decoding: a prompt that scores its tokens (prompt logprobs,
        chunks of 256 at most), the prompt of several samples (fed once into the group's cache, which each
        sample copies), and any context longer than one chunk (a long prompt; a preempted request's
        tokens). The last token is always left to the step, as for every request. Returns the ids of the
        requests still prefilling: they skip this step's decoding while the others decode."""
        budget = self.config.max_prefill_tokens or self.max_model_len
        busy: set[int] = set()
        for request in scheduled:
            fed, done = self._prefill_request(request, budget)
            budget -= fed
            if not done:
                busy.add(id(request))
        return busy

    def _prefill_request(self, request: Request, budget: int) -> tuple[int, bool]:
        """Feed one chunk (at most `budget` tokens) of what `request` must prefill first; (tokens fed,
        whether it may decode this step)."""
        params, group = request.params, request.group
        if group is not None and not request.prepared:
            fed = 0
            if not group.prefilled:
                self._shared_prompts[group.seq_id] = request.num_tokens
                fed, group.prefilled = self._feed_prompt(group.seq_id, request, budget, group_cache=True)
                if not group.prefilled:
                    return fed, False
            request.prompt_logprobs, request.prepared = group.prompt_logprobs, True
            length = min(self.target.cache_length(group.seq_id), request.num_tokens - 1)
            if params.max_tokens > 0 and length > 0:
                self.target.fork(group.seq_id, request.seq_id, length)
                if self.draft is not None and self.draft.cache_length(group.seq_id) >= length:
                    self.draft.fork(group.seq_id, request.seq_id, length)
            self._leave_group(request)
            return fed, True
        if not request.prepared and params.prompt_logprobs is not None:
            fed, request.prepared = self._feed_prompt(request.seq_id, request, budget)
            return fed, request.prepared
        request.prepared = True
        missing = request.num_tokens - 1 - self.target.cache_length(request.seq_id)
        if self.config.max_prefill_tokens is None or missing <= self.config.max_prefill_tokens:
            return 0, True  # short enough to go with the step's own forward, as it always did
        return self._feed_prompt(request.seq_id, request, budget)

    def _feed_prompt(
        self, seq_id: int, request: Request, budget: int, group_cache: bool = False
    ) -> tuple[int, bool]:
        """Feed the next chunk (at most `budget` tokens) of the request's tokens but its last to sequence
        `seq_id` of the target, and of the draft where the draft's cache keeps up; score the chunk's
        tokens when the request asks for prompt logprobs (into the group's entries for a group cache).
        Returns (tokens fed, whether everything but the last token is now cached)."""
        params = request.params
        tokens = request.prompt_token_ids if group_cache else request.tokens
        scoring = params.prompt_logprobs is not None
        done, goal = self.target.cache_length(seq_id), len(tokens) - 1
        if done == 0 and hasattr(self.target, "reserve"):
            self.target.reserve(seq_id, goal + 1)  # one allocation for the whole prompt
        chunk = min(budget, _SCORING_CHUNK) if scoring else budget
        piece = tokens[done : min(goal, done + chunk)]
        if not piece:
            return 0, done >= goal
        profile = self.stats.profile
        start = time.perf_counter()
        logits = self.target.forward([seq_id], [piece], [len(piece) if scoring else 0])
        profile.target_forward += time.perf_counter() - start
        if scoring:
            start = time.perf_counter()
            owner = request.group if group_cache else request
            if done == 0 or owner.prompt_logprobs is None:
                owner.prompt_logprobs = [None]  # position 0 has none; a restart scores afresh
            n = len(piece)
            owner.prompt_logprobs += self._logprob_entries(
                logits, range(n), [params] * n, tokens[done + 1 : done + 1 + n], [params.prompt_logprobs] * n
            )
            profile.target_sampling += time.perf_counter() - start
        if self.draft is not None and self.draft.cache_length(seq_id) == done:
            start = time.perf_counter()
            if done == 0 and hasattr(self.draft, "reserve"):
                self.draft.reserve(seq_id, goal + 1)
            self.draft.forward([seq_id], [piece], [0])
            profile.draft_forward += time.perf_counter() - start
        return len(piece), done + len(piece) >= goal

    def _leave_group(self, request: Request) -> None:
        """`request` no longer needs its group's prompt cache; the last one to leave frees it."""
        group = request.group
        group.waiting.discard(request.seq_id)
        if not group.waiting:
            self._shared_prompts.pop(group.seq_id, None)
            self._free_caches(group.seq_id)

    # ---- the KV budget ------------------------------------------------------------------------------

    def _make_kv_budget(self) -> KVBudget | None:
        """The KV budget over both runners (None where a runner does not say what a token takes)."""
        runners = [self.target] + ([self.draft] if self.draft is not None else [])
        per_token = [getattr(r, "kv_bytes_per_token", 0) for r in runners]
        if not all(per_token):
            return None
        memory = self.config.kv_cache_memory
        budget = default_kv_bytes(self.target.device) if memory is None else int(memory * GIB)
        growth = 1 + (self.spec.num_speculative_tokens if self.spec is not None else 0)
        block = max(getattr(r, "kv_block_tokens", 1) for r in runners)
        return KVBudget(budget, sum(per_token), block, growth, self.max_model_len)

    def _kv_fits(self, running: list[Request], candidate: Request) -> bool:
        """May `candidate` join the running batch within the KV budget?"""
        used = self.kv.in_use([*running, candidate], self._shared_prompts.values())
        return used <= self.kv.budget_tokens

    def _preempt_over_budget(self) -> None:
        """While the running requests' next step would take the KV caches over budget, preempt the newest
        (its caches are freed; it goes back to the queue's front and is recomputed from its tokens when
        it resumes: its output does not change). A request alone over budget has filled all the budget
        gives it: it ends with finish reason "length"."""
        running = self.scheduler.running
        while self.kv.in_use(running, self._shared_prompts.values()) > self.kv.budget_tokens:
            if len(running) == 1 and not self.kv.fits_alone(running[0].num_tokens):
                request = running[0]
                request.finished, request.finish_reason = True, "length"
                self._kv_exhausted.append(request)
                self.scheduler.finish([request])
                break
            if len(running) == 1:
                break  # over only with the shared prompt caches of waiting samples: they free up soon
            victim = running[-1]
            self.scheduler.preempt(victim)
            self._free_caches(victim.seq_id)  # its suffix counts stay: they are its tokens'
            self.stats.preemptions += 1

    # ---- log-probabilities --------------------------------------------------------------------------

    def _emitted_logprobs(
        self, running: list[Request], logits: torch.Tensor, first_rows: list[int], new_tokens: list[list[int]]
    ) -> list[list[PositionLogprobs] | None]:
        """Per request, the entries of its new tokens (the j-th from row first_rows[i] + j of the step's
        target logits); None for requests that do not ask. Costs nothing when no request asks."""
        asking = [i for i, r in enumerate(running) if r.params.logprobs is not None]
        out: list[list[PositionLogprobs] | None] = [None] * len(running)
        if not asking:
            return out
        start = time.perf_counter()
        rows = [first_rows[i] + j for i in asking for j in range(len(new_tokens[i]))]
        tokens = [t for i in asking for t in new_tokens[i]]
        params = [running[i].params for i in asking for _ in new_tokens[i]]
        entries = self._logprob_entries(logits, rows, params, tokens, [p.logprobs for p in params])
        at = 0
        for i in asking:
            out[i], at = entries[at : at + len(new_tokens[i])], at + len(new_tokens[i])
        self.stats.profile.target_sampling += time.perf_counter() - start
        return out

    def _logprob_entries(
        self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams], tokens: list[int], top_n
    ) -> list[PositionLogprobs]:
        """Entries of `tokens[i]` and its best alternatives from raw logits row `rows[i]` (logprobs.py)."""
        return token_logprobs(
            logits, rows, params, tokens, top_n, self.config.logprobs_mode, self._decode_token
        )

    def _decode_token(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None
