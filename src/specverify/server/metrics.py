"""Prometheus metrics for `specverify serve`.

Two kinds: counters and histograms the server updates as things happen (HTTP requests, step times,
draft depth and verification budget per step, time to first token), and a collector that turns the
worker's latest engine snapshot into metrics at scrape time (token counts per draft position, queue depth,
estimator coefficients and label count, the latest estimator checkpoint, rolling calibration). Each
server gets its own registry, so several can live in one process (the tests run many).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "specverify"

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_DEPTH_BUCKETS = tuple(float(k) for k in range(0, 17))
_BUDGET_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)


class ServerMetrics:
    """The server's metrics registry; `render()` gives the /metrics body and its content type."""

    def __init__(self, snapshot: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.requests_finished = Counter(
            f"{PREFIX}_requests_finished",
            "Generation requests ended, by reason (stop, length, abort = client left, error)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.step_seconds = Histogram(
            f"{PREFIX}_step_seconds", "Wall time of one engine step", buckets=_STEP_BUCKETS, registry=r
        )
        self.draft_depth = Histogram(
            f"{PREFIX}_draft_depth",
            "Drafting bound per engine step (0: no speculation)",
            buckets=_DEPTH_BUCKETS,
            registry=r,
        )
        self.verify_budget = Histogram(
            f"{PREFIX}_verify_budget",
            "Draft tokens sent to verification per engine step (whole batch)",
            buckets=_BUDGET_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "From request arrival to its last generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        if snapshot is not None:
            r.register(EngineCollector(snapshot))

    def observe_step(self, stats: Any) -> None:
        """Called by the engine thread after each step with the engine's EngineStats."""
        self.step_seconds.observe(stats.last_step_seconds)
        self.draft_depth.observe(stats.last_draft_depth)
        self.verify_budget.observe(stats.last_verify_budget)

    def request_finished(self, reason: str) -> None:
        self.requests_finished.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class EngineCollector(Collector):
    """Reads the worker's latest `EngineSnapshot` at scrape time (never the live engine)."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # families depend on the snapshot (per-position labels); skip eager description

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield _gauge(
            "queue_depth",
            "Sequences accepted and waiting for a running slot (a request with n choices counts n)",
            snap.queue_depth,
        )
        yield _gauge("running_requests", "Requests in the running batch", snap.num_running)
        yield _gauge(
            "in_flight_requests",
            "Sequences accepted and not finished, running + waiting (a request with n choices counts n)",
            snap.in_flight,
        )
        stats = snap.stats
        if stats is not None:
            yield _counter("engine_steps", "Engine steps taken", stats.steps)
            yield _counter(
                "output_tokens", "Tokens generated (all requests, aborted ones included)", stats.output_tokens
            )
            yield _counter(
                "engine_step_seconds", "Total wall time spent in engine steps", stats.step_seconds_total
            )
            yield _counter(
                "planning_seconds", "Time spent estimating and planning", stats.planning_seconds_total
            )
            for name, help_text, value in (
                ("drafted_tokens", "Draft tokens proposed, by draft position", stats.drafted_per_position),
                (
                    "verified_tokens",
                    "Draft tokens sent to the target for verification, by position",
                    stats.verified_per_position,
                ),
                (
                    "accepted_tokens",
                    "Draft tokens accepted by the target, by position",
                    stats.accepted_per_position,
                ),
            ):
                family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=["position"])
                for k, count in enumerate(value):
                    family.add_metric([str(k)], float(count))
                yield family
            yield _counter(
                "preemptions",
                "Running requests preempted to keep the KV caches within budget",
                stats.preemptions,
            )
            yield _gauge(
                "kv_cache_usage_bytes",
                "KV-cache bytes (both models) the running requests are counted at, as of the latest step",
                stats.kv_cache_bytes,
            )
            yield _gauge("kv_cache_budget_bytes", "The KV-cache budget (0: none)", stats.kv_budget_bytes)
            yield _gauge("last_step_seconds", "Wall time of the latest engine step", stats.last_step_seconds)
            yield _gauge("batch_size", "Requests in the latest engine step", stats.last_batch_size)
            yield _gauge(
                "chosen_draft_depth",
                "Drafting bound of the latest step (0: plain; a request stops where its next slot does not pay)",
                stats.last_draft_depth,
            )
            yield _gauge(
                "chosen_verify_budget", "Draft tokens verified in the latest step", stats.last_verify_budget
            )
        # Every estimator figure is labelled with the drafter it learns: each drafter has its own fit.
        drafter = snap.drafter or "none"
        yield _gauge("drafter_info", "The drafter in use (label), 1", 1.0, drafter=drafter)
        if snap.estimator_observed is not None:
            yield _gauge(
                "estimator_observed_labels",
                "Labels the acceptance estimators learned from, those restored from --estimator-state included",
                snap.estimator_observed,
                drafter=drafter,
            )
        if snap.checkpoint_time is not None:
            yield _gauge(
                "estimator_checkpoint_timestamp_seconds",
                "Unix time of the latest write of the estimator state file",
                snap.checkpoint_time,
            )
        slopes = snap.estimator_slopes
        if len(slopes) == 1:
            yield _gauge(
                "estimator_slope",
                "Acceptance estimator: shared slope on logit(q_max)",
                slopes[0],
                drafter=drafter,
            )
        elif slopes:
            family = GaugeMetricFamily(
                f"{PREFIX}_estimator_slope",
                "Acceptance estimator: slope per draft position",
                labels=["drafter", "position"],
            )
            for k, w in enumerate(slopes):
                family.add_metric([drafter, str(k)], w)
            yield family
        if snap.estimator_intercepts:
            family = GaugeMetricFamily(
                f"{PREFIX}_estimator_intercept",
                "Acceptance estimator: intercept per draft position",
                labels=["drafter", "position"],
            )
            for k, b in enumerate(snap.estimator_intercepts):
                family.add_metric([drafter, str(k)], b)
            yield family
        cal = snap.calibration
        if cal:
            family = GaugeMetricFamily(
                f"{PREFIX}_estimator_calibration",
                "Rolling calibration of the acceptance estimator on its latest labels (ece, auc, brier, ...)",
                labels=["drafter", "statistic"],
            )
            for key, value in sorted(cal.items()):
                family.add_metric([drafter, key], value)
            yield family
            if "raw_ece" in cal:
                yield _gauge(
                    "raw_qmax_ece",
                    "Rolling calibration error of raw q_max, for comparison",
                    cal["raw_ece"],
                    drafter=drafter,
                )
            if "ece" in cal:
                yield _gauge(
                    "estimator_ece",
                    "Rolling expected calibration error of the acceptance estimator",
                    cal["ece"],
                    drafter=drafter,
                )


def _gauge(name: str, help_text: str, value: float, **labels: str) -> GaugeMetricFamily:
    if not labels:
        return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=float(value))
    family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=list(labels))
    family.add_metric(list(labels.values()), float(value))
    return family


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=float(value))
