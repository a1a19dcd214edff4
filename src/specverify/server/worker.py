"""The one thread that drives the engine.

The engine is not thread-safe, so exactly one thread (this worker) ever calls it. HTTP handlers hand
requests over through a thread-safe inbox and receive the engine's outputs on their own asyncio queues,
filled from this thread with `loop.call_soon_threadsafe`. New requests join the running batch between
steps (the engine's scheduler does the continuous batching).

A request with `n` > 1 runs as n samples in the engine (each its own output, `group_id` naming the
request); the worker sends every sample's outputs to the one submission and ends it once all n have
finished.

Admission control lives here too: in-flight work is counted in samples (running plus waiting, as the
engine counts its running slots); once `max_num_seqs + max_queue` are taken `submit` raises `QueueFull`
at once, so the HTTP side can answer 429 instead of letting clients hang.

With an estimator state file, the worker restores the estimator at start (a file it cannot use stops the
server: `EstimatorStateError`), writes it every `checkpoint_interval` seconds between steps when it has
learned something since the last write, and once more at shutdown; every write goes to a temporary file
renamed over the old one, so a crash (even `kill -9`) leaves the previous complete state.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specverify.engine.sequence import RequestOutput
from specverify.sampling_params import SamplingParams

logger = logging.getLogger("specverify.server")

# How long the idle worker blocks on its inbox before it looks at its flags again.
_IDLE_WAIT_S = 0.05
# Metrics snapshots are cheap but not free (the calibration summary scans its window): at most this often.
_SNAPSHOT_INTERVAL_S = 0.2


class QueueFull(Exception):
    """Every running slot and every queue place is taken."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests."""


class EstimatorStateError(Exception):
    """The estimator state file exists but cannot be used; the message names it and the ways out."""


@dataclass
class Failure:
    """Sent in place of a `RequestOutput` when a request ends with an error instead of finishing."""

    message: str
    status: int = 500
    type: str = "server_error"


@dataclass
class Submission:
    """One request as the HTTP side hands it over; `outputs` lives on `loop`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    stream: bool = True  # False: only each sample's first output (time to first token) and final one are sent
    unfinished: int = 0  # samples still generating, set when the engine takes the request


@dataclass
class EngineSnapshot:
    """A copy of what /metrics shows, taken by the worker so no other thread reads the engine."""

    stats: Any = None  # EngineStats (deep copy)
    in_flight: int = 0
    num_running: int = 0
    estimator_slopes: list[float] = field(default_factory=list)  # one (shared) or one per position
    estimator_intercepts: list[float] = field(default_factory=list)
    calibration: dict[str, float] = field(default_factory=dict)
    drafter: str | None = None  # the speculative method the estimator belongs to (None: no speculation)
    estimator_observed: int | None = None  # labels the estimator(s) learned from, restored ones included
    checkpoint_time: float | None = None  # Unix time of the latest estimator state write

    @property
    def queue_depth(self) -> int:
        """Requests accepted but not yet in the running batch."""
        return max(self.in_flight - self.num_running, 0)


def calibration_summary(calibration: Any) -> dict[str, float]:
    """Finite numbers from a RollingCalibration, read defensively (any failure gives fewer keys)."""
    if calibration is None:
        return {}
    raw: Any = None
    for name in ("summary", "metrics", "report", "as_dict"):
        method = getattr(calibration, name, None)
        if callable(method):
            try:
                raw = method()
                break
            except Exception:  # a window with too few labels may refuse; show nothing rather than fail
                return {}
    if raw is not None and not isinstance(raw, dict):
        raw = getattr(raw, "__dict__", None) or {}
    if raw is None:
        raw = {}
        for name in ("ece", "raw_ece", "auc", "brier", "count", "n", "mean_prediction", "mean_label"):
            value = getattr(calibration, name, None)
            try:
                raw[name] = value() if callable(value) else value
            except Exception:
                continue
    out: dict[str, float] = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[str(key)] = float(value)
    return out


class EngineWorker:
    """Owns the engine from `start()` to `shutdown()`; every engine call happens on its thread."""

    def __init__(
        self,
        engine: Any,
        max_queue: int = 256,
        estimator_state: str | None = None,
        metrics: Any = None,
        checkpoint_interval: float = 60.0,
        reset_estimator_state: bool = False,
    ) -> None:
        """`checkpoint_interval`: seconds between estimator state writes (0: only at shutdown).
        `reset_estimator_state`: start cold even when `estimator_state` exists (it is overwritten later)."""
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0, got {checkpoint_interval}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_num_seqs = int(engine.config.max_num_seqs)
        self.capacity = self.max_num_seqs + max_queue
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.target.vocab_size)
        self.estimator_state = estimator_state
        self.metrics = metrics
        self.checkpoint_interval = checkpoint_interval
        self.reset_estimator_state = reset_estimator_state
        self._restored = False
        self._checkpoint_due = 0.0  # monotonic time of the next periodic write
        self._checkpoint_labels: int | None = None  # labels learned at the latest write (or restore)
        self._checkpoint_time: float | None = None
        # The HTTP side diffs the decoded text to stream deltas, so the engine decodes every step.
        engine.incremental_text = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # reentrant: safe from a signal handler
        self._lock = threading.Lock()
        self._in_flight = 0
        self._accepting = True
        self._stop = False
        self._drain_deadline: float | None = None
        self._submissions: dict[str, Submission] = {}  # worker thread only
        self._thread: threading.Thread | None = None
        self._snapshot = EngineSnapshot()
        self._snapshot_time = 0.0
        self.failed_steps = 0

    # ---- life cycle (called from the server's thread) ---------------------------------------------

    def start(self) -> None:
        """Restore the estimator (see `restore_estimator`) and start the engine thread."""
        if self._thread is not None:
            return
        self.restore_estimator()
        self._checkpoint_due = time.monotonic() + self.checkpoint_interval
        self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="specverify-engine", daemon=True)
        self._thread.start()

    def begin_drain(self, timeout: float) -> None:
        """Take no new requests; let running ones finish for `timeout` s, then end them with an error.

        Called from a signal handler too, so it takes no lock: plain assignments and a reentrant put.
        """
        self._accepting = False
        self._inbox.put(("drain", time.monotonic() + max(timeout, 0.0)))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drain (see `begin_drain`), stop the thread, save the estimator state, close the engine."""
        if self._drain_deadline is None:
            self.begin_drain(timeout)
        self._stop = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            # A step in progress always completes; allow it some time beyond the drain deadline.
            self._thread.join(timeout + 60.0)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop in time; estimator state not saved")
            self._thread = None

    def restore_estimator(self) -> None:
        """Load the estimator state file if there is one; raises EstimatorStateError if it is unusable.

        Called before the engine thread starts (nothing else touches the engine yet), at most once; the
        CLI calls it before the server listens, so a broken file stops `serve` with a plain message.
        """
        if self._restored:
            return
        self._restored = True
        path = self.estimator_state
        self._checkpoint_labels = self._observed_labels()
        if not path:
            return
        if self.engine.estimator is None:
            logger.warning("--estimator-state %s ignored: the engine runs without speculation", path)
        elif self.reset_estimator_state:
            logger.warning(
                "estimator state reset: starting cold; %s will be overwritten by its next write", path
            )
        elif not os.path.exists(path):
            logger.info("no estimator state at %s yet: starting cold", path)
        else:
            try:
                self.engine.load_estimator_state(path)
            except Exception as e:  # any failure means the file cannot be trusted: never start cold silently
                raise EstimatorStateError(
                    f"cannot restore the estimator state from {path}: {type(e).__name__}: {e}. Fix or remove "
                    "the file, or pass --estimator-state-reset to start cold and overwrite it"
                ) from e
            self._checkpoint_labels = self._observed_labels()
            logger.info("estimator state restored from %s (%s labels)", path, self._checkpoint_labels)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def snapshot(self) -> EngineSnapshot:
        return dataclasses.replace(self._snapshot, in_flight=self._in_flight)

    # ---- the HTTP side's calls --------------------------------------------------------------------

    def submit(self, submission: Submission) -> None:
        """Queue a request for the engine; raises QueueFull or ShuttingDown instead of blocking."""
        with self._lock:
            if not self.accepting:
                raise ShuttingDown("the server is shutting down")
            if self._in_flight >= self.capacity:
                raise QueueFull(
                    f"the server is at capacity ({self.max_num_seqs} running and {self.max_queue} queued requests)"
                )
            # Counted as its n samples; admitted while any room is left, so a large n is never refused outright.
            self._in_flight += submission.params.n
            # Inside the lock: a drain that starts now cannot strand this request in the inbox.
            self._inbox.put(("add", submission))

    def abort(self, request_id: str) -> None:
        """Stop generating for a request whose client went away (a no-op once it has finished)."""
        self._inbox.put(("abort", request_id))

    # ---- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._read_inbox(block=not engine.has_unfinished_requests())
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    self._fail_all(
                        Failure("the server shut down before the request finished", 503, "server_shutdown")
                    )
                if self._stop and not self._submissions:
                    break
                if engine.has_unfinished_requests():
                    self._step()
                self._maybe_checkpoint()
                self._maybe_snapshot()
        except Exception:  # pragma: no cover - the loop itself failing is a bug; do not hang clients
            logger.exception("the engine thread crashed")
            self._accepting = False
            self._fail_all(Failure("the engine thread crashed", 500))
        finally:
            self._reject_leftovers()
            self._take_snapshot()
            self._finish()

    def _read_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._add(payload)
        elif kind == "abort":
            submission = self._submissions.get(payload)
            if submission is not None:
                self.engine.abort_request(payload)
                self._end(submission, None, "abort")
        elif kind == "drain":
            deadline = payload if self._drain_deadline is None else min(self._drain_deadline, payload)
            self._drain_deadline = deadline

    def _add(self, submission: Submission) -> None:
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self._end(submission, Failure("the server is shutting down", 503, "server_shutdown"), "error")
            return
        try:
            self.engine.add_request(submission.prompt_token_ids, submission.params, submission.request_id)
        except ValueError as e:  # PromptError and sampling checks the HTTP side could not foresee
            self._end(submission, Failure(str(e), 400, "invalid_request_error"), "error")
            return
        submission.unfinished = submission.params.n
        self._submissions[submission.request_id] = submission

    def _step(self) -> None:
        try:
            outputs: list[RequestOutput] = self.engine.step()
        except Exception as e:
            # The batch's state is unknown after a failed step: end every request in it with an error and
            # keep serving new ones.
            self.failed_steps += 1
            logger.exception("engine step failed")
            self._fail_all(Failure(f"the engine failed: {type(e).__name__}: {e}", 500))
            return
        if self.metrics is not None:
            self.metrics.observe_step(self.engine.stats)
        for out in outputs:
            self._route(out)

    def _route(self, out: RequestOutput) -> None:
        """Send one sample's output to its submission; the submission ends with its last sample."""
        submission = self._submissions.get(out.group_id or out.request_id)
        if submission is None:
            return
        if out.finished:
            submission.unfinished -= 1
            if submission.unfinished == 0:
                self._end(submission, out, out.finish_reason or "stop")
                return
        elif not submission.stream and len(out.output_token_ids) != len(out.new_token_ids):
            return  # non-streamed requests get only each sample's first output (time to first token) and last
        if not self._deliver(submission, out):  # the client's event loop is gone: nobody will read it
            self.engine.abort_request(submission.request_id)  # all its samples
            self._end(submission, None, "abort")

    def _fail_all(self, failure: Failure) -> None:
        for request_id, submission in list(self._submissions.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
            self._end(submission, failure, "error")

    def _end(self, submission: Submission, item: RequestOutput | Failure | None, reason: str) -> None:
        """Forget a request, then send its last item. Counting first means a client that has its answer
        already sees the server's capacity freed."""
        self._submissions.pop(submission.request_id, None)
        with self._lock:
            self._in_flight -= submission.params.n
        if self.metrics is not None:
            self.metrics.request_finished(reason)
        if item is not None:
            self._deliver(submission, item)

    @staticmethod
    def _deliver(submission: Submission, item: RequestOutput | Failure) -> bool:
        try:
            submission.loop.call_soon_threadsafe(submission.outputs.put_nowait, item)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _maybe_snapshot(self) -> None:
        now = time.monotonic()
        if now - self._snapshot_time >= _SNAPSHOT_INTERVAL_S or not self.engine.has_unfinished_requests():
            self._take_snapshot(now)

    def _take_snapshot(self, now: float | None = None) -> None:
        engine = self.engine
        snap = EngineSnapshot(
            stats=copy.deepcopy(engine.stats), num_running=engine.num_running, drafter=engine.drafter
        )
        estimator = engine.estimator
        if estimator is not None:
            try:
                slope, intercepts = estimator.coef_
                snap.estimator_slopes = [float(w) for w in np.atleast_1d(slope)]
                snap.estimator_intercepts = [float(b) for b in np.atleast_1d(intercepts)]
            except Exception:  # an estimator without a fit yet: show no coefficients
                pass
        snap.calibration = calibration_summary(engine.calibration)
        snap.estimator_observed = self._observed_labels()
        snap.checkpoint_time = self._checkpoint_time
        snap.in_flight = self._in_flight
        self._snapshot = snap
        self._snapshot_time = time.monotonic() if now is None else now

    def _reject_leftovers(self) -> None:
        with self._lock:
            self._accepting = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._end(payload, Failure("the server is shutting down", 503, "server_shutdown"), "error")

    def _observed_labels(self) -> int | None:
        """Labels both estimators (sampled and greedy requests) learned from; None without a count."""
        estimators = [getattr(self.engine, name, None) for name in ("estimator", "greedy_estimator")]
        counts = [getattr(est, "n_observed_", None) for est in estimators if est is not None]
        return sum(counts) if counts and None not in counts else None

    def _maybe_checkpoint(self) -> None:
        """The periodic estimator write, between steps; skipped while nothing new was learned."""
        if not self.checkpoint_interval or not self.estimator_state or self.engine.estimator is None:
            return
        now = time.monotonic()
        if now < self._checkpoint_due:
            return
        self._checkpoint_due = now + self.checkpoint_interval
        if self._observed_labels() != self._checkpoint_labels:
            self._write_estimator_state("checkpoint", logging.DEBUG)

    def _write_estimator_state(self, what: str, level: int) -> None:
        """Write the state file (the engine writes beside it and renames, so a crash mid-write never
        leaves a broken file). A failure is logged, never raised: losing a checkpoint must not stop the
        server."""
        path = self.estimator_state
        labels = self._observed_labels()
        try:
            self.engine.save_estimator_state(path)
        except Exception:
            logger.exception("could not write the estimator state (%s) to %s", what, path)
            return
        self._checkpoint_labels = labels
        self._checkpoint_time = time.time()
        logger.log(level, "estimator state %s written to %s (%s labels)", what, path, labels)

    def _finish(self) -> None:
        """Last acts of the engine thread: persist the estimator, close the engine."""
        if self.estimator_state and self.engine.estimator is not None:
            self._write_estimator_state("at shutdown", logging.INFO)
        try:
            self.engine.close()
        except Exception:
            logger.exception("engine.close() failed")
