"""Calibration metrics, leak-free scoring, traces, the report and the `calibrate` CLI."""

import gzip
import json

import numpy as np
import pytest

from specverify import calibrate_cli
from specverify.calibration import (
    RollingCalibration,
    auc,
    brier,
    calibration_report,
    ece,
    format_report,
    heldout_predictions,
    prequential_scores,
    reliability_curve,
    reliability_plot,
    report_json,
)
from specverify.estimator import AcceptanceEstimator
from specverify.trace import TraceWriter, read_trace, records_from_step

# ---- metrics ---------------------------------------------------------------------------------------------


def test_ece_hand_computed():
    # bins of width 1/15: 0.1 -> bin 1 (mean p 0.1, rate 0.5), 0.9 -> bin 13 (mean p 0.9, rate 1.0)
    assert ece([0.1, 0.1, 0.9, 0.9], [0, 1, 1, 1]) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    # p = 1.0 falls in the last bin; a perfectly calibrated bin adds nothing
    assert ece([1.0, 1.0, 0.5, 0.5], [1, 1, 1, 0]) == pytest.approx(0.0)
    # two bins: [0, 0.5) and [0.5, 1]
    assert ece([0.2, 0.4, 0.6, 0.8], [0, 1, 1, 1], bins=2) == pytest.approx(0.5 * 0.2 + 0.5 * 0.3)
    assert np.isnan(ece([], []))
    assert ece([0.3, np.nan], [1, 0]) == pytest.approx(0.7)  # NaN predictions are skipped


def _pairwise_auc(p, y):
    pos, neg = p[y == 1], p[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (pos.size * neg.size)


def test_auc_hand_computed_and_against_pairwise_reference_with_ties():
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert auc([0.9, 0.1], [1, 0]) == 1.0 and auc([0.1, 0.9], [1, 0]) == 0.0
    assert np.isnan(auc([0.2, 0.3], [1, 1]))
    rng = np.random.default_rng(0)
    p = np.round(rng.random(400), 1)  # many ties
    y = (rng.random(400) < p).astype(float)
    assert auc(p, y) == pytest.approx(_pairwise_auc(p, y), abs=1e-12)


def test_brier_and_reliability_curve():
    assert brier([0.0, 1.0, 0.5], [0, 1, 1]) == pytest.approx(0.25 / 3)
    c = reliability_curve([0.05, 0.1, 0.95], [0, 1, 1], bins=10)
    assert c["count"].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert c["rate"][1] == 1.0 and np.isnan(c["rate"][5]) and c["mean_pred"][9] == pytest.approx(0.95)


def test_rolling_calibration_keeps_the_last_window():
    roll = RollingCalibration(window=100)
    assert roll.labels == 0 and np.isnan(roll.ece())
    rng = np.random.default_rng(1)
    p = rng.random(250)
    y = (rng.random(250) < p).astype(float)
    raw = np.clip(p + 0.2, 0, 1)
    for lo in range(0, 250, 30):
        roll.update(p[lo : lo + 30], y[lo : lo + 30], raw[lo : lo + 30])
    assert roll.labels == 100 and roll.total == 250
    assert roll.ece() == pytest.approx(ece(p[-100:], y[-100:]))
    assert roll.auc() == pytest.approx(auc(p[-100:], y[-100:]))
    assert roll.raw_ece() == pytest.approx(ece(raw[-100:], y[-100:]))
    assert roll.raw_auc() == pytest.approx(auc(raw[-100:], y[-100:]))
    assert roll.summary()["labels"] == 100
    roll.update(np.r_[p, p][:300], np.r_[y, y][:300])  # more than a window, no raw q_max
    assert roll.labels == 100 and np.isnan(roll.raw_ece())


# ---- scoring without peeking ------------------------------------------------------------------------------


class _Spy:
    """An 'estimator' that remembers everything it was taught and fails if asked about anything it saw."""

    def __init__(self, num_positions):
        self.seen = set()
        self.max_seen = -np.inf

    def predict_at(self, x, positions):
        x = np.asarray(x)
        assert not (set(x.tolist()) & self.seen), "scored a record whose label was already learned"
        return np.full(x.size, 0.5)

    def observe_labels(self, x, positions, labels):
        self.seen |= set(np.asarray(x).tolist())
        self.max_seen = max(self.max_seen, max(x, default=-np.inf))


def test_prequential_scores_never_peek_at_the_label_or_the_future():
    # feature = the record's global order, so the spy can also check no later step was learned first
    steps = np.repeat(np.arange(50), 6)
    x = np.arange(steps.size, dtype=float)
    pos = np.tile([0, 1, 2, 0, 1, 0], 50)
    req = np.tile(["a", "a", "a", "b", "b", "c"], 50)
    spies = []

    def factory(k):
        spies.append(_Spy(k))
        return spies[-1]

    order = np.random.default_rng(2).permutation(x.size)  # input order must not matter with steps
    prequential_scores(x[order], pos[order], np.ones(x.size), req[order], factory, steps=steps[order])

    class Ordered(_Spy):
        def predict_at(self, xs, positions):
            assert self.max_seen < min(xs), "a later step was learned before this one was scored"
            return super().predict_at(xs, positions)

    prequential_scores(x, pos, np.ones(x.size), req, Ordered, steps=steps)
    prequential_scores(x, pos, np.ones(x.size), req, Ordered)  # without steps: trace order


def test_prequential_memoriser_gets_no_free_auc():
    # Labels are coin flips independent of the feature; a memorising model scores AUC 1 if it can peek.
    class Memoriser:
        def __init__(self, k):
            self.memory = {}

        def predict_at(self, x, positions):
            return np.array([self.memory.get(v, 0.5) for v in np.asarray(x).tolist()])

        def observe_labels(self, x, positions, labels):
            self.memory.update(zip(np.asarray(x).tolist(), np.asarray(labels).tolist(), strict=True))

    rng = np.random.default_rng(3)
    n = 2000
    x = rng.permutation(n).astype(float)
    y = (rng.random(n) < 0.5).astype(float)
    p = prequential_scores(x, np.zeros(n, int), y, np.arange(n), Memoriser, steps=np.arange(n))
    assert auc(p, y) == pytest.approx(0.5)


def test_heldout_predictions_come_from_other_requests():
    req = np.repeat(np.arange(20), 10)
    x = req.astype(float) * 100 + np.arange(req.size)  # features unique per request
    pred = heldout_predictions(x, np.zeros(x.size, int), np.ones(x.size), req, _Spy, folds=3)
    assert np.all(pred == 0.5)


# ---- traces ---------------------------------------------------------------------------------------------------


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _write_synthetic_trace(path, steps=150, r=8, k=4, seed=0):
    """A trace like the engine's: raw q_max over-confident, truth sigmoid(0.6 x - 0.4), censored labels."""
    rng = np.random.default_rng(seed)
    est = AcceptanceEstimator(k)
    with TraceWriter(path) as w:
        for step in range(steps):
            x = rng.normal(2.0, 3.0, size=(r, k))
            feats = {
                "logit_qmax": x,
                "logit_qmax_trunc": np.clip(x + 1.0, -10, 10),
                "margin_top2": np.maximum(x + 2.0, 0.0),
                "entropy": np.log1p(np.exp(-x)),
                "qmax": _sigmoid(x),
            }
            drafted = rng.integers(1, k + 1, size=r)
            for name in feats:
                feats[name][np.arange(k)[None, :] >= drafted[:, None]] = np.nan
            accept = rng.random((r, k)) < _sigmoid(0.6 * x - 0.4)
            verified = np.minimum(drafted, rng.integers(0, k + 1, size=r))
            accepted = np.minimum(np.where(~accept, np.arange(k), k).min(1), verified)
            pred = est.predict(feats["logit_qmax"])
            w.write_step(
                request_ids=[f"req-{(step // 10) * r + i}" for i in range(r)],
                step=step,
                features=feats,
                predictions=pred,
                num_drafted=drafted,
                num_verified=verified,
                num_accepted=accepted,
                trains=np.arange(r) != 0,
            )
            est.observe(feats["logit_qmax"], verified, accepted)
    return path


def test_records_follow_the_censoring_rule_and_round_trip(tmp_path):
    recs = records_from_step(
        ["r0", "r1", "r2"],
        7,
        {"logit_qmax": np.array([[1.0, 2.0, 3.0], [4.0, np.nan, np.nan], [0.5, 0.5, 0.5]])},
        np.array([[0.6, 0.5, 0.4], [0.9, np.nan, np.nan], [0.5, 0.5, 0.5]]),
        num_drafted=[3, 1, 3],
        num_verified=[3, 1, 1],
        num_accepted=[1, 1, 0],
        trains=[True, False, True],
    )
    got = [(r["request"], r["position"], r["verified"], r["accepted"]) for r in recs]
    assert got == [
        ("r0", 0, True, True),
        ("r0", 1, True, False),
        ("r0", 2, True, None),  # after the first rejection: censored
        ("r1", 0, True, True),
        ("r2", 0, True, False),
        ("r2", 1, False, None),  # not verified
        ("r2", 2, False, None),
    ]
    assert recs[3]["trains"] is False and recs[0]["features"] == {"logit_qmax": 1.0}
    for suffix in ("trace.jsonl", "trace.jsonl.gz"):
        path = tmp_path / suffix
        with TraceWriter(path) as w:
            w.write_records(recs[:4])
        with TraceWriter(path) as w:  # appends
            w.write_records(recs[4:])
        if suffix.endswith(".gz"):
            with gzip.open(path, "rt") as f:
                assert len(f.read().splitlines()) == 7
        t = read_trace(path)
        assert t["labelled"].tolist() == [True, True, False, True, True, False, False]
        assert t["accepted"].tolist() == [True, False, False, True, False, False, False]
        assert t["step"].tolist() == [7] * 7 and t["position"].tolist() == [0, 1, 2, 0, 0, 1, 2]
        assert t["features"]["logit_qmax"][3] == 4.0 and t["prediction"][0] == 0.6
    # a run killed mid-write leaves a partial last line: skipped
    with open(tmp_path / "cut.jsonl", "w") as f:
        f.write(json.dumps(recs[0]) + "\n" + json.dumps(recs[1])[:20])
    assert read_trace(tmp_path / "cut.jsonl")["step"].size == 1


def test_calibration_report_on_a_synthetic_trace(tmp_path):
    trace = read_trace(_write_synthetic_trace(tmp_path / "t.jsonl"))
    report = calibration_report(trace)
    m = report["methods"]
    for name in (
        "raw_qmax",
        "engine",
        "online",
        "heldout",
        "per_position",
        "trunc10",
        "margin_top2",
        "neg_entropy",
    ):
        assert name in m and len(m[name]["per_position"]) == 4
    # raw q_max ranks well but is over-confident; the fitted logistic is calibrated
    assert m["raw_qmax"]["overall"]["mean_pred"] > m["raw_qmax"]["overall"]["rate"] + 0.05
    assert m["online"]["overall"]["ece"] < m["raw_qmax"]["overall"]["ece"] / 2
    assert m["heldout"]["overall"]["ece"] < 0.06
    assert abs(m["raw_qmax"]["overall"]["auc"] - m["online"]["overall"]["auc"]) < 0.02
    text = format_report(report)
    assert "heldout" in text and "ECE per draft position" in text
    json.dumps(report_json(report))  # serialisable, NaN-free


def test_reliability_plot_writes_png(tmp_path):
    rng = np.random.default_rng(5)
    p = rng.random(300)
    y = (rng.random(300) < p).astype(float)
    out = tmp_path / "r.png"
    reliability_plot({"a": (p, y), "b": (np.sqrt(p), y)}, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_cli_writes_table_png_and_json(tmp_path, capsys):
    trace = _write_synthetic_trace(tmp_path / "t.jsonl.gz", steps=60)
    png, js = tmp_path / "rel.png", tmp_path / "rep.json"
    assert calibrate_cli.main(["calibrate", str(trace), "--plot", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "raw_qmax" in out and "online" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "online" in json.loads(js.read_text())["methods"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert calibrate_cli.main(["calibrate", str(empty)]) == 1
    assert calibrate_cli.main(["calibrate", str(trace), "--estimator", '{"bogus": 1}']) == 1
