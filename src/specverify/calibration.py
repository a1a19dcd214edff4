"""How good are acceptance estimates? Metrics, honest scoring schemes, a report, and a rolling monitor.

Metrics: ECE (equal-width bins), AUC (rank-based, ties averaged), Brier, mean prediction vs actual rate,
reliability curves and a PNG reliability diagram.

Scoring schemes for online estimators on a recorded trace of labelled drafts:
- prequential: every prediction is made before its own label (or any later label) is learned, replaying
  the trace step by step as the engine does (predict the whole step, then learn from it);
- held-out: fit on some requests, score on the others (k-fold over request ids).

`calibration_report` compares, overall and per draft position: raw q_max used as a probability, the
engine's own online predictions, the K + 1 online logistic (prequential and held-out), the per-position
2-parameter variant, and the same online logistic on other features. `RollingCalibration` keeps the last
few thousand (prediction, label) pairs for live metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from specverify.estimator import AcceptanceEstimator, PerPositionEstimator
from specverify.features import SINGLE_TOKEN_BONUS, TRUNC_CLAMP, acceptance_feature

DEFAULT_BINS = 15

EstimatorFactory = Callable[[int], Any]  # num_positions -> an object with predict_at / observe_labels


def _pairs(pred: Any, label: Any) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    y = np.asarray(label, dtype=np.float64).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"predictions ({p.size}) and labels ({y.size}) differ in length")
    keep = np.isfinite(p) & np.isfinite(y)
    return np.clip(p[keep], 0.0, 1.0), y[keep]


def ece(pred: Any, label: Any, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error: sum over equal-width bins of (share of samples) * |mean p - mean y|."""
    p, y = _pairs(pred, label)
    if p.size == 0:
        return float("nan")
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    gap = np.abs(np.bincount(idx, p, bins) - np.bincount(idx, y, bins))  # per-bin sums: n * |mean gap|
    return float(gap.sum() / count.sum())


def auc(pred: Any, label: Any) -> float:
    """ROC AUC as the Mann-Whitney statistic with average ranks for ties (NaN if one class is absent)."""
    p, y = _pairs(pred, label)
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(p, return_inverse=True, return_counts=True)
    # Average 1-based rank of each distinct value: the ranks it spans are (before + 1) .. (before + count).
    before = np.cumsum(counts) - counts
    ranks = (before + (counts + 1) / 2.0)[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(pred: Any, label: Any) -> float:
    """Mean squared error of the probabilities."""
    p, y = _pairs(pred, label)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def scores(pred: Any, label: Any, bins: int = DEFAULT_BINS) -> dict[str, float]:
    """AUC, ECE, Brier, mean prediction, actual rate and count of the finite pairs."""
    p, y = _pairs(pred, label)
    empty = p.size == 0
    return {
        "n": int(p.size),
        "auc": auc(p, y),
        "ece": ece(p, y, bins),
        "brier": brier(p, y),
        "mean_pred": float("nan") if empty else float(p.mean()),
        "rate": float("nan") if empty else float(y.mean()),
    }


def reliability_curve(pred: Any, label: Any, bins: int = DEFAULT_BINS) -> dict[str, np.ndarray]:
    """Per equal-width bin: mean prediction, observed acceptance rate, count (empty bins are NaN / 0)."""
    p, y = _pairs(pred, label)
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(idx, p, bins) / count
        rate = np.bincount(idx, y, bins) / count
    return {"edges": np.linspace(0.0, 1.0, bins + 1), "mean_pred": mean_pred, "rate": rate, "count": count}


def reliability_plot(
    curves: Mapping[str, tuple[Any, Any]], path: str, bins: int = DEFAULT_BINS, title: str | None = None
) -> None:
    """Reliability diagram (top) and prediction histogram (bottom) of each (pred, label) pair, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend state
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 7.5))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    top.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect calibration")
    for name, (pred, label) in curves.items():
        c = reliability_curve(pred, label, bins)
        shown = c["count"] > 0
        e = ece(pred, label, bins)
        line = top.plot(
            c["mean_pred"][shown], c["rate"][shown], marker="o", markersize=3, label=f"{name} (ECE {e:.3f})"
        )
        bottom.stairs(c["count"], c["edges"], color=line[0].get_color())
    top.set_ylabel("observed acceptance rate")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.legend(loc="upper left", fontsize=8)
    top.set_title(title or "Acceptance estimates: reliability")
    bottom.set_xlabel("predicted acceptance probability")
    bottom.set_ylabel("labels")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- replaying a trace -------------------------------------------------------------------------------


def _step_groups(
    positions: np.ndarray, request_ids: np.ndarray, steps: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(order, group starts): records in replay order and where each engine step begins.

    With `steps`, records are stably sorted by step. Without, the trace order is the replay order and a
    step of a request ends where the request changes or its position stops increasing.
    """
    n = positions.size
    if steps is not None:
        order = np.argsort(steps, kind="stable")
        s = steps[order]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]]) if n else np.zeros(0, np.int64)
    else:
        order = np.arange(n)
        new = (
            np.r_[True, (request_ids[1:] != request_ids[:-1]) | (positions[1:] <= positions[:-1])]
            if n
            else []
        )
        starts = np.flatnonzero(new)
    return order, starts


def _flat_inputs(features: Any, positions: Any, labels: Any, request_ids: Any):
    x = np.asarray(features, dtype=np.float64).reshape(-1)
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    req = np.asarray(request_ids).reshape(-1)
    if not (x.size == pos.size == y.size == req.size):
        raise ValueError("features, positions, labels and request_ids must have the same length")
    return x, pos, y, req


def prequential_scores(
    features: Any,
    positions: Any,
    labels: Any,
    request_ids: Any,
    estimator_factory: EstimatorFactory,
    *,
    steps: Any = None,
    trains: Any = None,
) -> np.ndarray:
    """Predictions for every labelled record, each made before its label is learned.

    Records are replayed step by step (see `_step_groups`): the whole step is predicted, then learned
    from, like the engine. `trains` (bool [N]) limits learning to those records; all are scored.
    Returns the predictions [N] in the input order.
    """
    x, pos, y, req = _flat_inputs(features, positions, labels, request_ids)
    learn = np.ones(x.size, bool) if trains is None else np.asarray(trains, bool).reshape(-1)
    est = estimator_factory(int(pos.max()) + 1 if pos.size else 1)
    order, starts = _step_groups(pos, req, None if steps is None else np.asarray(steps).reshape(-1))
    pred = np.full(x.size, np.nan)
    bounds = np.r_[starts, x.size]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        idx = order[lo:hi]
        pred[idx] = est.predict_at(x[idx], pos[idx])
        idx = idx[learn[idx]]
        est.observe_labels(x[idx], pos[idx], y[idx])
    return pred


def heldout_predictions(
    features: Any,
    positions: Any,
    labels: Any,
    request_ids: Any,
    estimator_factory: EstimatorFactory,
    *,
    steps: Any = None,
    trains: Any = None,
    folds: int = 2,
    seed: int = 0,
) -> np.ndarray:
    """Predictions for every record from an estimator fitted (online, in step order) on other requests.

    Request ids are split at random into `folds` groups; each group is scored by the final fit on the rest.
    """
    x, pos, y, req = _flat_inputs(features, positions, labels, request_ids)
    learn = np.ones(x.size, bool) if trains is None else np.asarray(trains, bool).reshape(-1)
    names, which = np.unique(req, return_inverse=True)
    fold_of_request = np.random.default_rng(seed).permutation(names.size) % max(folds, 1)
    fold = fold_of_request[which]
    num_positions = int(pos.max()) + 1 if pos.size else 1
    order, starts = _step_groups(pos, req, None if steps is None else np.asarray(steps).reshape(-1))
    bounds = np.r_[starts, x.size]
    pred = np.full(x.size, np.nan)
    for f in range(max(folds, 1)):
        est = estimator_factory(num_positions)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            idx = order[lo:hi]
            idx = idx[(fold[idx] != f) & learn[idx]]
            if idx.size:
                est.observe_labels(x[idx], pos[idx], y[idx])
        test = fold == f
        if test.any():
            pred[test] = est.predict_at(x[test], pos[test])
    return pred


# ---- the report ---------------------------------------------------------------------------------------

# Features tried with the K + 1 online logistic: (report name, trace feature, transform, description).
# The slope is constrained >= 0, so entropy (higher means less acceptance) enters negated.
_FEATURE_VARIANTS = (
    (
        "trunc10",
        "logit_qmax_trunc",
        lambda v: np.clip(v, -10.0, 10.0),
        "online K+1 on logit(q_max) after top-p/top-k, clamp 10",
    ),
    ("margin_top2", "margin_top2", lambda v: v, "online K+1 on log(q1/q2)"),
    ("neg_entropy", "entropy", lambda v: -v, "online K+1 on -entropy"),
    # Suffix drafts: how long the matched context was, how often it was seen.
    ("match_length", "match_length", np.log2, "online K+1 on log2(match length) (suffix drafter)"),
    ("count_total", "count_total", np.log, "online K+1 on log(continuation count) (suffix drafter)"),
)


def _engine_feature(feats: Mapping[str, np.ndarray]) -> tuple[np.ndarray, str]:
    """The engine's estimator input rebuilt from a trace's features, and how to call it.

    Traces record the one-token flag ("one_token"); older ones only hold the truncated log-odds, which
    hit their clamp where one token is kept (and, rarely, for a non-one-hot row that peaked)."""
    x = feats["logit_qmax"]
    if "one_token" in feats:
        one = np.nan_to_num(feats["one_token"]) > 0
        return acceptance_feature(x, one), f"logit(q_max) + {SINGLE_TOKEN_BONUS:g} if one token kept"
    if "logit_qmax_trunc" in feats:
        one = feats["logit_qmax_trunc"] >= TRUNC_CLAMP
        return acceptance_feature(x, one), (
            f"logit(q_max) + {SINGLE_TOKEN_BONUS:g} if one token kept (flag from the truncated feature)"
        )
    return x, "logit(q_max)"


def _by_position(pred: np.ndarray, label: np.ndarray, pos: np.ndarray, k: int, bins: int) -> list[dict]:
    return [scores(pred[pos == j], label[pos == j], bins) for j in range(k)]


def calibration_report(
    trace: Mapping[str, Any] | str,
    *,
    bins: int = DEFAULT_BINS,
    estimator_options: Mapping[str, Any] | None = None,
    folds: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Compare acceptance estimates on the labelled records of a trace (`read_trace` output or a path).

    Returns {"labels", "num_positions", "rate", "methods": {name: {"description", "overall",
    "per_position"}}, "predictions": {name: array aligned with "label"}, "label", "position"}. The last
    three are arrays for plotting; `report_json` drops them.
    """
    if isinstance(trace, str):
        from specverify.trace import read_trace

        trace = read_trace(trace)
    lab = np.asarray(trace["labelled"], bool)
    feats = {name: np.asarray(v, np.float64)[lab] for name, v in trace["features"].items()}
    y = np.asarray(trace["accepted"], np.float64)[lab]
    pos = np.asarray(trace["position"], np.int64)[lab]
    req = np.asarray(trace["request"])[lab]
    steps = np.asarray(trace["step"], np.int64)[lab]
    trains = np.asarray(trace["trains"], bool)[lab]
    k = int(pos.max()) + 1 if pos.size else 0
    options = dict(estimator_options or {})

    def shared(n: int) -> AcceptanceEstimator:
        return AcceptanceEstimator.from_config(n, options)

    def per_position(n: int) -> PerPositionEstimator:
        return PerPositionEstimator.from_config(n, options)

    def online(x: np.ndarray, factory: EstimatorFactory) -> np.ndarray:
        return prequential_scores(x, pos, y, req, factory, steps=steps, trains=trains)

    methods: dict[str, tuple[str, np.ndarray]] = {}
    if "qmax" in feats:
        methods["raw_qmax"] = ("raw q_max used as a probability", feats["qmax"])
    elif "logit_qmax" in feats:
        methods["raw_qmax"] = ("raw q_max used as a probability", 1.0 / (1.0 + np.exp(-feats["logit_qmax"])))
    prediction = np.asarray(trace.get("prediction", np.full(lab.size, np.nan)), np.float64)[lab]
    if np.isfinite(prediction).any():
        methods["engine"] = ("the engine's own online predictions, as recorded", prediction)
    drafters = list(trace.get("drafters", ["draft_model"]))
    if len(drafters) > 1:
        raise ValueError(
            f"the trace mixes drafts of {drafters}: their features differ, so score one drafter's trace at a time"
        )
    if "logit_qmax" in feats and k:
        x, name = _engine_feature(feats)
        methods["online"] = (f"online K+1 logistic on {name}, prequential", online(x, shared))
        heldout = heldout_predictions(
            x, pos, y, req, shared, steps=steps, trains=trains, folds=folds, seed=seed
        )
        methods["heldout"] = (f"K+1 logistic on {name}, {folds}-fold held-out requests", heldout)
        methods["per_position"] = (
            f"online 2K (slope per position) on {name}, prequential",
            online(x, per_position),
        )
        if name != "logit(q_max)":
            methods["no_bonus"] = (
                "online K+1 on logit(q_max) without the one-token shift, prequential",
                online(feats["logit_qmax"], shared),
            )
    for name, source, transform, description in _FEATURE_VARIANTS:
        if source in feats and k:
            methods[name] = (description + ", prequential", online(transform(feats[source]), shared))
    return {
        "drafter": drafters[0] if drafters else "draft_model",
        "labels": int(y.size),
        "num_positions": k,
        "rate": float(y.mean()) if y.size else float("nan"),
        "methods": {
            name: {
                "description": description,
                "overall": scores(p, y, bins),
                "per_position": _by_position(p, y, pos, k, bins),
            }
            for name, (description, p) in methods.items()
        },
        "predictions": {name: p for name, (_, p) in methods.items()},
        "label": y,
        "position": pos,
    }


def report_json(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report without its per-label arrays, NaN as None: ready for json.dump."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {key: clean(item) for key, item in v.items()}
        if isinstance(v, list | tuple):
            return [clean(item) for item in v]
        if isinstance(v, float | np.floating):
            return float(v) if np.isfinite(v) else None
        if isinstance(v, np.integer):
            return int(v)
        return v

    return clean({key: v for key, v in report.items() if key not in ("predictions", "label", "position")})


def format_report(report: Mapping[str, Any]) -> str:
    """Text tables: overall metrics per method, then ECE and AUC per draft position."""
    methods = report["methods"]
    lines = [
        f"{report.get('drafter', 'draft_model')} drafts: {report['labels']} labelled, "
        f"{report['num_positions']} positions, acceptance rate {report['rate']:.4f}",
        "",
    ]
    width = max([len(name) for name in methods] + [6])
    lines.append(
        f"{'method':<{width}}  {'AUC':>6}  {'ECE':>6}  {'Brier':>6}  {'mean p':>6}  {'rate':>6}  {'n':>8}"
    )
    for name, m in methods.items():
        o = m["overall"]
        lines.append(
            f"{name:<{width}}  {o['auc']:6.4f}  {o['ece']:6.4f}  {o['brier']:6.4f}  {o['mean_pred']:6.4f}  {o['rate']:6.4f}  {o['n']:8d}"
        )
    k = report["num_positions"]
    for metric in ("ece", "auc"):
        lines += ["", f"{metric.upper()} per draft position"]
        lines.append(f"{'method':<{width}}  " + "  ".join(f"{'k=' + str(j):>6}" for j in range(k)))
        for name, m in methods.items():
            lines.append(f"{name:<{width}}  " + "  ".join(f"{p[metric]:6.4f}" for p in m["per_position"]))
    lines += [""] + [f"{name:<{width}}  {m['description']}" for name, m in methods.items()]
    return "\n".join(lines)


# ---- live monitoring ----------------------------------------------------------------------------------


class RollingCalibration:
    """The last `window` (prediction, label, raw q_max) triples, for live ECE / AUC (Prometheus, bench)."""

    def __init__(self, window: int = 2000, bins: int = DEFAULT_BINS):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        self.window, self.bins = window, bins
        self._pred = np.full(window, np.nan)
        self._label = np.full(window, np.nan)
        self._raw = np.full(window, np.nan)
        self._next = 0
        self.total = 0  # labels ever seen

    def update(self, pred: Any, label: Any, raw_qmax: Any = None) -> None:
        """Add one step's labelled slots (arrays of equal length; raw_qmax optional)."""
        p = np.asarray(pred, np.float64).reshape(-1)
        y = np.asarray(label, np.float64).reshape(-1)
        r = np.full(p.size, np.nan) if raw_qmax is None else np.asarray(raw_qmax, np.float64).reshape(-1)
        if not (p.size == y.size == r.size):
            raise ValueError("pred, label and raw_qmax must have the same length")
        if p.size > self.window:
            p, y, r = p[-self.window :], y[-self.window :], r[-self.window :]
        slots = (self._next + np.arange(p.size)) % self.window
        self._pred[slots], self._label[slots], self._raw[slots] = p, y, r
        self._next = int((self._next + p.size) % self.window)
        self.total += int(np.asarray(pred).size)

    @property
    def labels(self) -> int:
        """Labels currently in the window."""
        return min(self.total, self.window)

    def ece(self) -> float:
        return ece(self._pred, self._label, self.bins)

    def auc(self) -> float:
        return auc(self._pred, self._label)

    def raw_ece(self) -> float:
        return ece(self._raw, self._label, self.bins)

    def raw_auc(self) -> float:
        return auc(self._raw, self._label)

    def summary(self) -> dict[str, float | int]:
        """Windowed metrics of the estimator and of raw q_max, plus mean prediction and actual rate."""
        s = scores(self._pred, self._label, self.bins)
        return {
            "labels": self.labels,
            "total_labels": self.total,
            "ece": s["ece"],
            "auc": s["auc"],
            "brier": s["brier"],
            "mean_pred": s["mean_pred"],
            "rate": s["rate"],
            "raw_ece": self.raw_ece(),
            "raw_auc": self.raw_auc(),
        }
