"""Run no speculation / fixed-K / adaptive verification side by side over a concurrency sweep.

All modes share ONE set of loaded models. The sweep goes for each temperature, for each concurrency (a
point), and within a point the modes run side by side at two grains. By default the point's prompts
form one pool: every mode has its own engine with all of them queued and `concurrency` running at once,
a finished request's place going to the next queued one, as a server under `concurrency` steady clients
(and as the llama.cpp peer tool measures). With `closed_rounds` they are split into rounds of
`concurrency` prompts instead (the last may be smaller), each a closed batch that lasts as long as its
slowest request: where speculation speeds requests unevenly, the fast ones leave and the round's tail
runs at fewer rows (suffix drafter, `mixed`, T=1, c4, 16 prompts: adaptive 0.97x plain in rounds, 1.23x
in a pool). Each pool or round is run by the engines taking turns STEP BY STEP (one step of each mode
that still has work, then the next), so a slow spell of the machine (its speed drifts by 15-25 % over a
minute or two, and identical work measured back to back differs by up to a quarter) hits every mode
within the same second. A mode's time is the sum of its own engine calls (queuing the prompts and every
step), never another mode's. The mode order changes every round (a pool is one round) and continues
across points (none,fixed,adaptive; adaptive,fixed,none; fixed,adaptive,none; fixed,none,adaptive; ...;
see `round_order`), so no mode always steps first or always right after the same other mode.

Every mode gets the same prompts with the same per-prompt seeds (seed by the prompt's index in the
point). A mode's result at a point (a run) sums its rounds. The adaptive mode's estimator (and every
mode's calibration record) is carried from round to round and point to point across every temperature,
as in one long-running server; one cost model serves every adaptive engine and keeps refining itself. A
short untimed warm-up generation per mode (at the first temperature) runs before the sweep, then the
adaptive mode generates (untimed) until its estimators have `warmup_labels` labels each, as a server
started from a saved estimator state would (`warmup_labels=0`: the first point pays the exploration).

What stepping in turn cannot pair is a single long step: a prefill of many prompts takes seconds, and
the machine's speed changes within them. So the engines admit at most `max_prefill_tokens` prompt tokens
per step (the engine's own default), and a round's prompts are prefilled over several short steps that
take turns like the decode steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from specverify.calibration import RollingCalibration, scores
from specverify.config import ConfigError, EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import WARMUP_LABELS, EngineStats, LLMEngine, PlanCheck, StepProfile
from specverify.sampling_params import SamplingParams

MODES = ("none", "fixed", "adaptive")
# The estimator warm-up's batches: at most this many per estimator, of at most this many tokens a request.
_WARMUP_BATCHES = 8
_WARMUP_BATCH_TOKENS = 64
_WARMUP_SEED_INDEX = 1_000_000


@dataclass
class BenchConfig:
    """What one benchmark run does (it goes into results.json as `config`)."""

    modes: list[str] = field(default_factory=lambda: list(MODES))
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    # Prompts per point; never fewer than concurrency * rounds (None: max(concurrency * rounds,
    # min_prompts)).
    num_prompts: int | None = None
    max_tokens: int = 64
    # One temperature (0: greedy) or a list swept in turn; a one-element list becomes a float.
    temperature: float | list[float] = 1.0
    top_p: float = 0.95
    num_speculative_tokens: int = 5
    seed: int = 0
    ignore_eos: bool = False
    warmup_tokens: int = 8
    warmup_prompts: int = 2
    # Labels each adaptive estimator (sampled, greedy: those the sweep's temperatures use) has learnt in
    # the untimed warm-up, as a server started from a saved estimator state has them (0: start cold and
    # pay the exploration in the first timed point).
    warmup_labels: int = WARMUP_LABELS
    # Prompt tokens that join an engine's batch per step (EngineConfig.max_prefill_tokens): a round's
    # prompts are prefilled over several short steps, which stepping in turn pairs like decode steps.
    max_prefill_tokens: int | None = 512
    kv_cache_memory: float | None = None  # GiB per engine (EngineConfig.kv_cache_memory); None: default
    # Without num_prompts, a point gets at least this many prompts (one prompt alone is too noisy).
    min_prompts: int = 4
    # At least `concurrency * rounds` prompts per point: at a high concurrency, where the prompt floor
    # alone gives each client one request, more requests per client (or more closed rounds).
    rounds: int = 1
    # Closed batches of `concurrency` prompts per point instead of one pool of them all (see above).
    closed_rounds: bool = False

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"unknown modes {bad}; choose from {', '.join(MODES)}")
        if len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"modes repeat: {self.modes}")
        if not self.concurrencies or any(not isinstance(c, int) or c < 1 for c in self.concurrencies):
            raise ConfigError(f"concurrencies must be positive integers, got {self.concurrencies}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not isinstance(self.min_prompts, int) or self.min_prompts < 1:
            raise ConfigError(f"min_prompts must be an integer >= 1, got {self.min_prompts!r}")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ConfigError(f"rounds must be an integer >= 1, got {self.rounds!r}")
        if isinstance(self.temperature, list | tuple):
            temps = list(self.temperature)
            if not temps:
                raise ConfigError("temperature: give at least one value")
            if len(set(temps)) != len(temps):
                raise ConfigError(f"temperatures repeat: {temps}")
            # One value stays a plain float, as results.json has always had it.
            self.temperature = temps[0] if len(temps) == 1 else temps
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.warmup_tokens < 0:
            raise ConfigError(f"warmup_tokens must be >= 0 (0: no warm-up), got {self.warmup_tokens}")
        if self.warmup_labels < 0:
            raise ConfigError(f"warmup_labels must be >= 0 (0: a cold estimator), got {self.warmup_labels}")
        # Reuse SamplingParams' checks so a bad value fails before any model work.
        for t in self.temperatures:
            SamplingParams(temperature=t, top_p=self.top_p, max_tokens=self.max_tokens)

    @property
    def temperatures(self) -> list[float]:
        """The temperatures swept, in order (one for a plain float)."""
        return list(self.temperature) if isinstance(self.temperature, list) else [self.temperature]

    def prompts_for(self, concurrency: int) -> int:
        """Prompts per point at this concurrency."""
        floor = concurrency * self.rounds
        if self.num_prompts is not None:
            return max(self.num_prompts, floor)
        return max(self.min_prompts, floor)

    def rounds_for(self, concurrency: int) -> int:
        """Rounds per point at this concurrency: one pool, or closed rounds (the last one may hold fewer
        than `concurrency`)."""
        return -(-self.prompts_for(concurrency) // concurrency) if self.closed_rounds else 1


@dataclass
class RunResult:
    """One mode at one (temperature, concurrency) point, summed over its rounds. Field names are part of
    the results.json schema."""

    mode: str
    concurrency: int
    temperature: float
    dataset: str
    num_prompts: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    drafted_tokens: int
    verified_tokens: int
    accepted_tokens: int
    steps: int
    request_steps: int  # sum over steps of the requests advanced: tokens per request-step = output / this
    step_s: float
    planning_s: float
    drafted_per_position: list[int]
    verified_per_position: list[int]
    accepted_per_position: list[int]
    finished_by_length: int
    # Steps that prefilled a prompt, and the pure decode steps, timed apart (decode excludes prefill).
    prefill_steps: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_tokens_per_s: float | None = None
    # Decode steps with every lane taken: a server's steady decoding at this concurrency, without the
    # pool's drain (its slowest requests finishing with lanes empty) and without prefill, which costs
    # every mode the same per prompt but falls inside or outside this window by when lanes free up.
    full_tokens: int = 0
    full_s: float = 0.0
    full_tokens_per_s: float | None = None
    rounds: int = 1  # rounds this run's figures sum (1: one pool)
    # Adaptive only: the planner's predicted vs measured seconds and tokens of the steps it chose,
    # {"speculative" | "plain": {steps, predicted_seconds, measured_seconds, expected_tokens, tokens}}.
    plan_check: dict[str, dict[str, float]] | None = None
    # Where the mode's step time went, seconds summed over its steps (EngineStats.profile's fields).
    profile: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Counts:
    request_steps: int = 0
    by_length: int = 0
    prefill_steps: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    full_tokens: int = 0
    full_s: float = 0.0


@dataclass
class _Round:
    """One mode's share of one round: its engine's counters, the runner's step counts, the wall time."""

    stats: EngineStats
    counts: _Counts
    wall_s: float


def _sum_positions(lists: Sequence[Sequence[int]]) -> list[int]:
    """Per-position counts summed slot by slot (a round that drafted less deep has a shorter list)."""
    total = [0] * max((len(x) for x in lists), default=0)
    for counts in lists:
        for k, n in enumerate(counts):
            total[k] += int(n)
    return total


def _sum_profiles(stats: Sequence[EngineStats]) -> dict[str, float]:
    total = StepProfile()
    for st in stats:
        total.add(st.profile)
    return asdict(total)


def _sum_plan_checks(stats: Sequence[EngineStats]) -> dict[str, dict[str, float]]:
    total = {kind: PlanCheck() for kind in ("speculative", "plain")}
    for st in stats:
        for kind, check in st.plan_check.items():
            total[kind].add(check)
    return {kind: asdict(check) for kind, check in total.items()}


@dataclass
class BenchRun:
    """Everything the report needs: the config, one result per point in run order, calibration."""

    config: dict[str, Any]
    runs: list[RunResult]
    calibration: dict[str, dict[str, Any]]  # by mode (fixed / adaptive): BenchCalibration.summary()
    records: dict[str, BenchCalibration] = field(default_factory=dict)  # by mode, for the reliability plot
    headline: str | None = None  # the mode whose calibration results.json reports: adaptive, else fixed


class BenchCalibration(RollingCalibration):
    """Every labelled draft of one mode's timed runs (no window), for the report and reliability plot.

    The engine feeds it through `update` like its own RollingCalibration; predictions are scored as made,
    before the estimator learns their labels (prequential).
    """

    def __init__(self) -> None:
        super().__init__()
        self._all: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def update(self, pred: Any, label: Any, raw_qmax: Any = None) -> None:
        super().update(pred, label, raw_qmax)
        p = np.asarray(pred, np.float64).reshape(-1)
        r = np.full(p.size, np.nan) if raw_qmax is None else np.asarray(raw_qmax, np.float64).reshape(-1)
        self._all.append((p.copy(), np.asarray(label, np.float64).reshape(-1).copy(), r.copy()))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(predictions, labels, raw q_max) of every labelled draft seen."""
        if not self._all:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        return tuple(np.concatenate(parts) for parts in zip(*self._all, strict=True))

    def summary(self) -> dict[str, Any]:
        pred, label, raw = self.arrays()
        est, raw_scores = scores(pred, label), scores(raw, label)
        return {
            "ece": _plain(est["ece"]),
            "auc": _plain(est["auc"]),
            "raw_qmax_ece": _plain(raw_scores["ece"]),
            "raw_qmax_auc": _plain(raw_scores["auc"]),
            "labels": int(label.size),
            "brier": _plain(est["brier"]),
            "mean_pred": _plain(est["mean_pred"]),
            "raw_qmax_mean": _plain(raw_scores["mean_pred"]),
            "rate": _plain(est["rate"]),
        }


def _plain(value: float) -> float | None:
    """NaN (e.g. AUC with one class only) becomes None, so results.json stays strict JSON."""
    value = float(value)
    return value if math.isfinite(value) else None


class BenchRunner:
    """Builds one engine per (mode, round) over shared runners and measures it."""

    def __init__(
        self,
        target,
        tokenizer,
        draft,
        config: BenchConfig,
        *,
        dataset: str = "custom",
        speculative: SpeculativeConfig | None = None,
        cost_model: Any = None,
        progress: bool = True,
        engine_factory: Callable[..., LLMEngine] = LLMEngine,
    ) -> None:
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        if speculative is not None:
            # The speculative config decides K; the reported config must say the same.
            config = replace(config, num_speculative_tokens=speculative.num_speculative_tokens)
        self.config = config
        self.dataset = dataset
        self.progress = progress
        self.cost_model = cost_model
        self.engine_factory = engine_factory
        base = speculative or SpeculativeConfig(num_speculative_tokens=config.num_speculative_tokens)
        self.base_spec = base
        if draft is None and base.method == "draft_model" and any(m != "none" for m in config.modes):
            raise ConfigError("modes 'fixed' and 'adaptive' need a draft model (or the suffix drafter)")
        self._estimator_state: dict[str, dict] = {}
        # What the untimed estimator warm-up did (labels per estimator, batches, seconds); None: none ran.
        self.estimator_warmup: dict[str, Any] | None = None
        self._calibration: dict[str, BenchCalibration] = {}
        self._rounds_run = 0  # rounds so far over the whole sweep: the mode order changes with it
        # Every timed (temperature, concurrency, round index within the point, mode), in the order run.
        self.schedule: list[tuple[float, int, int, str]] = []

    # ---- engines ------------------------------------------------------------------------------------

    def spec_for(self, mode: str) -> SpeculativeConfig | None:
        if mode == "none":
            return None
        return replace(
            self.base_spec,
            enable_adaptive_verification=mode == "adaptive",
            estimator=dict(self.base_spec.estimator),
        )

    def make_engine(self, mode: str, concurrency: int) -> LLMEngine:
        config = EngineConfig(
            max_num_seqs=concurrency,
            max_prefill_tokens=self.config.max_prefill_tokens,
            kv_cache_memory=self.config.kv_cache_memory,
            seed=self.config.seed,
            speculative=self.spec_for(mode),
        )
        engine = self.engine_factory(
            self.target,
            self.tokenizer,
            config,
            draft=self.draft if mode != "none" else None,
            cost_model=self.cost_model if mode == "adaptive" else None,
        )
        # One estimator (and the recent draft features the planner reads) per mode stays warm across
        # the sweep, as it would in a long-running server.
        if engine.estimator is not None and mode in self._estimator_state:
            engine.load_speculation_state(self._estimator_state[mode])
        return engine

    def _keep_estimator(self, mode: str, engine: LLMEngine) -> None:
        if engine.estimator is not None:
            self._estimator_state[mode] = engine.speculation_state()

    # ---- generation ---------------------------------------------------------------------------------

    def _params(self, index: int, max_tokens: int, temperature: float) -> SamplingParams:
        # The same seed for prompt i in every mode, so each mode samples the same way where it can.
        return SamplingParams(
            temperature=temperature,
            top_p=self.config.top_p,
            max_tokens=max_tokens,
            seed=self.config.seed * 1_000_003 + index,
            ignore_eos=self.config.ignore_eos,
        )

    def _queue(
        self,
        engine: LLMEngine,
        prompts: Sequence[list[int]],
        max_tokens: int,
        temperature: float,
        first_index: int,
    ) -> None:
        """Queue every prompt; `first_index` is the index of `prompts[0]` in its point, which seeds it."""
        for i, ids in enumerate(prompts, start=first_index):
            engine.add_request(ids, self._params(i, max_tokens, temperature))

    @staticmethod
    def _step(engine: LLMEngine, counts: _Counts, bar: Any = None, lanes: int = 0) -> float:
        """One engine step, counted into `counts` (prefill and decode steps timed apart, and the decode
        steps with all `lanes` taken); its seconds."""
        full = lanes > 0 and engine.num_running + engine.num_waiting >= lanes
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        counts.request_steps += len(outputs)
        tokens = sum(len(out.new_token_ids) for out in outputs)
        # A request's first emission means its prompt was prefilled in this step.
        if any(len(out.output_token_ids) == len(out.new_token_ids) for out in outputs):
            counts.prefill_steps += 1
            counts.prefill_s += elapsed
        else:
            counts.decode_tokens += tokens
            counts.decode_s += elapsed
            if full:
                counts.full_tokens += tokens
                counts.full_s += elapsed
        counts.by_length += sum(out.finished and out.finish_reason == "length" for out in outputs)
        if bar is not None:
            bar.update(tokens)
        return elapsed

    def warm_up(self, prompts: Sequence[list[int]]) -> None:
        """Untimed, before the sweep: a short generation per mode (lazy allocations and kernel choices
        happen here), then the adaptive mode's estimators fed until they know the pair."""
        if self.config.warmup_tokens and self.config.warmup_prompts:
            shortest = sorted(prompts, key=len)[: self.config.warmup_prompts]
            for mode in self.config.modes:
                self._generate_untimed(
                    mode, shortest, self.config.warmup_tokens, self.config.temperatures[0], 0
                )
        if "adaptive" in self.config.modes and self.config.warmup_labels:
            self._warm_estimators(prompts)

    def _generate_untimed(
        self, mode: str, prompts: Sequence[list[int]], max_tokens: int, temperature: float, first_index: int
    ) -> LLMEngine:
        """Generate `prompts` on a fresh engine of `mode`, untimed, keeping what its estimator learnt
        (calibration is scored on the timed runs only); the engine, closed."""
        engine = self.make_engine(mode, len(prompts))
        try:
            self._queue(engine, prompts, max_tokens, temperature, first_index)
            while engine.has_unfinished_requests():
                self._step(engine, _Counts())
            self._keep_estimator(mode, engine)
        finally:
            engine.close()
        return engine

    def _warm_estimators(self, prompts: Sequence[list[int]]) -> None:
        """Generate (untimed, a few requests at a time, cycling through the prompts from the shortest)
        until the adaptive mode's sampled and greedy estimators, those the sweep uses, each have
        `warmup_labels` labels or `_WARMUP_BATCHES` batches ran. Cold, every sweep paid the estimator's
        exploration at its first point (full drafts verified until 200 labels: 11-19 % of that point at
        c8, where speculation does not pay), which a server pays once in its life."""
        start = time.perf_counter()
        by_length = sorted(prompts, key=len)
        width = max(self.config.warmup_prompts, 2)
        max_tokens = min(self.config.max_tokens, _WARMUP_BATCH_TOKENS)
        temperatures = {t > 0: t for t in reversed(self.config.temperatures)}  # the first of each kind
        labels: dict[str, int] = {}
        batch = 0
        for sampled, temperature in sorted(temperatures.items(), reverse=True):
            kind = "sampled" if sampled else "greedy"
            for _ in range(_WARMUP_BATCHES):
                chosen = [by_length[(batch * width + i) % len(by_length)] for i in range(width)]
                # Seeds apart from the timed runs' (prompt i of a point has seed index i).
                seeds = _WARMUP_SEED_INDEX + batch * width
                engine = self._generate_untimed("adaptive", chosen, max_tokens, temperature, seeds)
                batch += 1
                estimator = engine.estimator if sampled else engine.greedy_estimator
                if estimator is None:  # an engine given one estimator from outside serves both kinds
                    estimator = engine.estimator
                labels[kind] = estimator.n_observed_
                if labels[kind] >= self.config.warmup_labels:
                    break
        self.estimator_warmup = {"labels": labels, "batches": batch, "seconds": time.perf_counter() - start}

    def round_order(self, round_number: int) -> list[str]:
        """The modes in the order they step in the sweep's `round_number`-th round (0-based).

        Even rounds step in the configured order, odd ones in reverse, and each pair of rounds is
        rotated by one more than the last: every mode steps first equally often, and, as steps go round
        in a cycle, every mode follows each other mode equally often (a step can run slower after a
        particular mode's step; a fixed cycle would always charge that to the same mode)."""
        modes = list(self.config.modes)
        if round_number % 2:
            modes.reverse()
        shift = (round_number // 2) % len(modes)
        return modes[shift:] + modes[:shift]

    def _run_round(
        self,
        order: Sequence[str],
        concurrency: int,
        prompts: Sequence[list[int]],
        first_index: int,
        temperature: float,
        bar: Any = None,
    ) -> dict[str, _Round]:
        """Every mode's share of one round: one fresh engine per mode (continuing the mode's estimator),
        stepped in turn, one step each, in `order`, until all are done."""
        engines: dict[str, LLMEngine] = {}
        try:
            for mode in order:
                engine = engines[mode] = self.make_engine(mode, concurrency)
                if engine.calibration is not None:
                    # One record per mode over all its timed rounds, like one long-running server.
                    engine.calibration = self._calibration.setdefault(mode, BenchCalibration())
            counts = {mode: _Counts() for mode in order}
            seconds = dict.fromkeys(order, 0.0)
            for mode in order:
                start = time.perf_counter()
                self._queue(engines[mode], prompts, self.config.max_tokens, temperature, first_index)
                seconds[mode] += time.perf_counter() - start
            live = list(order)
            while live:
                for mode in live:
                    seconds[mode] += self._step(engines[mode], counts[mode], bar, concurrency)
                live = [m for m in live if engines[m].has_unfinished_requests()]
            for mode in order:
                self._keep_estimator(mode, engines[mode])
        finally:
            for engine in engines.values():
                engine.close()
        return {mode: _Round(engines[mode].stats, counts[mode], seconds[mode]) for mode in order}

    def run_point(
        self,
        concurrency: int,
        prompts: Sequence[list[int]],
        bar: Any = None,
        temperature: float | None = None,
    ) -> list[RunResult]:
        """Every mode over `prompts`, `concurrency` at a time, in one pool or in closed rounds of
        `concurrency`, the modes stepping in turn; one result per mode (in the configured order), each
        summing its rounds (temperature None: the first configured)."""
        if temperature is None:
            temperature = self.config.temperatures[0]
        size = concurrency if self.config.closed_rounds else max(len(prompts), 1)
        chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        done: dict[str, list[_Round]] = {mode: [] for mode in self.config.modes}
        for r, chunk in enumerate(chunks):
            order = self.round_order(self._rounds_run)
            self._rounds_run += 1
            if bar is not None:
                part = f"round {r + 1}/{len(chunks)}" if self.config.closed_rounds else "pool"
                bar.set_description(f"  T={temperature:g} c={concurrency} {part}")
            self.schedule.extend((float(temperature), concurrency, r, mode) for mode in order)
            shares = self._run_round(order, concurrency, chunk, r * size, temperature, bar)
            for mode in order:
                done[mode].append(shares[mode])
        return [
            self._result(mode, concurrency, temperature, len(prompts), done[mode])
            for mode in self.config.modes
        ]

    def _result(
        self, mode: str, concurrency: int, temperature: float, num_prompts: int, rounds: list[_Round]
    ) -> RunResult:
        """One run: the mode's rounds at a point, summed."""

        def total(get: Callable[[_Round], Any]) -> Any:
            return sum(get(r) for r in rounds)

        output_tokens = int(total(lambda r: r.stats.output_tokens))
        wall = float(total(lambda r: r.wall_s))
        decode_tokens = int(total(lambda r: r.counts.decode_tokens))
        decode_s = float(total(lambda r: r.counts.decode_s))
        full_tokens = int(total(lambda r: r.counts.full_tokens))
        full_s = float(total(lambda r: r.counts.full_s))
        return RunResult(
            mode=mode,
            concurrency=concurrency,
            temperature=float(temperature),
            dataset=self.dataset,
            num_prompts=num_prompts,
            output_tokens=output_tokens,
            wall_s=wall,
            tokens_per_s=output_tokens / wall if wall > 0 else 0.0,
            drafted_tokens=int(total(lambda r: r.stats.drafted_tokens)),
            verified_tokens=int(total(lambda r: r.stats.verified_tokens)),
            accepted_tokens=int(total(lambda r: r.stats.accepted_tokens)),
            steps=int(total(lambda r: r.stats.steps)),
            request_steps=int(total(lambda r: r.counts.request_steps)),
            step_s=float(total(lambda r: r.stats.step_seconds_total)),
            planning_s=float(total(lambda r: r.stats.planning_seconds_total)),
            drafted_per_position=_sum_positions([r.stats.drafted_per_position for r in rounds]),
            verified_per_position=_sum_positions([r.stats.verified_per_position for r in rounds]),
            accepted_per_position=_sum_positions([r.stats.accepted_per_position for r in rounds]),
            finished_by_length=int(total(lambda r: r.counts.by_length)),
            prefill_steps=int(total(lambda r: r.counts.prefill_steps)),
            prefill_s=float(total(lambda r: r.counts.prefill_s)),
            decode_tokens=decode_tokens,
            decode_s=decode_s,
            decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else None,
            full_tokens=full_tokens,
            full_s=full_s,
            full_tokens_per_s=full_tokens / full_s if full_s > 0 else None,
            rounds=len(rounds),
            plan_check=_sum_plan_checks([r.stats for r in rounds]) if mode == "adaptive" else None,
            profile=_sum_profiles([r.stats for r in rounds]),
        )

    def run(
        self, prompts: Sequence[list[int]], on_result: Callable[[BenchRun], None] | None = None
    ) -> BenchRun:
        """Warm up, then for each temperature, for each concurrency, run every mode side by side on the
        first `prompts_for(c)` prompts, stepping in turn (the same prompts and seeds for every mode).

        `on_result` gets the results so far after every point (the CLI saves them as it goes)."""
        cfg = self.config
        needed = max(cfg.prompts_for(c) for c in cfg.concurrencies)
        if len(prompts) < needed:
            raise ValueError(f"the sweep needs {needed} prompts per point but only {len(prompts)} were given")
        self.warm_up(prompts)
        runs: list[RunResult] = []
        points = [(t, c) for t in cfg.temperatures for c in cfg.concurrencies]
        with tqdm(total=len(points), desc="bench", unit="point", disable=not self.progress) as outer:
            for t, c in points:
                subset = prompts[: cfg.prompts_for(c)]
                outer.set_description(f"bench T={t:g} c={c}")
                with tqdm(
                    total=len(subset) * cfg.max_tokens * len(cfg.modes),
                    desc=f"  T={t:g} c={c}",
                    unit="tok",
                    leave=False,
                    disable=not self.progress,
                ) as bar:
                    results = self.run_point(c, subset, bar, temperature=t)
                runs.extend(results)
                outer.set_postfix_str(" ".join(f"{r.mode} {r.tokens_per_s:.1f}" for r in results) + " tok/s")
                outer.update(1)
                if on_result is not None:
                    on_result(self.snapshot(runs))
        return self.snapshot(runs)

    def snapshot(self, runs: list[RunResult]) -> BenchRun:
        """The results so far (the whole run once `run` returns)."""
        calibration = {mode: record.summary() for mode, record in self._calibration.items()}
        headline = next((m for m in ("adaptive", "fixed") if m in self._calibration), None)
        config = asdict(self.config)
        config["dataset"] = self.dataset
        config["estimator_warmup"] = self.estimator_warmup
        config["speculative_config"] = {
            "method": self.base_spec.method,
            "model": self.base_spec.model,
            "suffix_cache_tokens": self.base_spec.suffix_cache_tokens,
            "num_speculative_tokens": self.base_spec.num_speculative_tokens,
            "estimator": dict(self.base_spec.estimator),
        }
        return BenchRun(
            config=config,
            runs=list(runs),
            calibration=calibration,
            records=dict(self._calibration),
            headline=headline,
        )
