"""Estimator checkpoints of `specverify serve`: periodic write-then-rename, restore after a crash, and a
state file that cannot be used stopping the server (unless `--estimator-state-reset`).

Toy models and a real uvicorn server in a thread, as in test_server.py.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from test_server import HAS_ESTIMATOR, MODEL, make_engine, serve

from specverify.server.app import SpecverifyServer
from specverify.server.worker import EngineWorker, EstimatorStateError

pytestmark = pytest.mark.skipif(not HAS_ESTIMATOR, reason="needs the acceptance estimator")

OBSERVED = "specverify_estimator_observed_labels"
DRAFTER = (("drafter", "draft_model"),)


def _traffic(served, n: int = 4) -> None:
    """Sampled requests, so the (sampled-request) estimator learns from their drafts."""
    client = served.client()
    for i in range(n):
        client.completions.create(model=MODEL, prompt="t1 t2 t3", max_tokens=20, temperature=1.0, seed=i)


def _labels_in(path: Path) -> int:
    state = json.loads(path.read_text())
    return state["sampled"]["n_observed"] + state["greedy"]["n_observed"]


def test_periodic_checkpoint_is_written_and_restores_after_a_crash(tmp_path) -> None:
    path = tmp_path / "estimator.json"
    with serve(make_engine(), estimator_state=str(path), estimator_checkpoint_interval=0.05) as s:
        _traffic(s)
        live = s.worker.engine
        # Idle now: the next checkpoint holds everything learned, and it is the file a kill -9 would leave.
        s.wait_for(lambda: path.exists() and _labels_in(path) == s.metrics()[(OBSERVED, DRAFTER)] > 0)
        stamp = s.metrics()[("specverify_estimator_checkpoint_timestamp_seconds", ())]
        assert not list(tmp_path.glob("*.tmp-*"))

        # A fresh engine and worker on the same path get the estimator back (the server never shut down).
        fresh = make_engine()
        EngineWorker(fresh, estimator_state=str(path)).restore_estimator()
        assert fresh.estimator.n_observed_ == live.estimator.n_observed_ > 0
        assert fresh.estimator.coef_[0] == live.estimator.coef_[0]
        assert (fresh.estimator.coef_[1] == live.estimator.coef_[1]).all()
        assert json.dumps(fresh.estimator_state()) == json.dumps(live.estimator_state())

        # Nothing learned since: no new write.
        path.unlink()
        time.sleep(0.3)
        assert not path.exists()
        assert s.metrics()[("specverify_estimator_checkpoint_timestamp_seconds", ())] == stamp


def test_a_failed_checkpoint_keeps_the_previous_file_and_the_server(tmp_path, caplog) -> None:
    path = tmp_path / "estimator.json"
    with serve(make_engine(), estimator_state=str(path), estimator_checkpoint_interval=0.05) as s:
        _traffic(s, 2)
        s.wait_for(lambda: path.exists() and _labels_in(path) == s.metrics()[(OBSERVED, DRAFTER)])
        good = path.read_text()
        engine = s.worker.engine
        real_state = engine.estimator_state
        # json.dump writes the first keys, then fails on the object: a partial temporary file.
        engine.estimator_state = lambda: {"sampled": real_state()["sampled"], "broken": object()}
        with caplog.at_level(logging.ERROR, logger="specverify.server"):
            _traffic(s, 2)
            s.wait_for(lambda: "could not write the estimator state" in caplog.text)
        assert path.read_text() == good
        assert not list(tmp_path.glob("*.tmp-*"))
        _traffic(s, 1)  # still serving
        engine.estimator_state = real_state
    assert _labels_in(path) > json.loads(good)["sampled"]["n_observed"]  # the shutdown write worked


def _other_drafter_state() -> str:
    state = make_engine().estimator_state()
    return json.dumps(state | {"drafter": "suffix"})


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"kind": "SpeculationEstimators", "drafter": "draft_model"}',
        "other drafter",
        "directory",
    ],
)
def test_an_unusable_state_file_stops_the_start_with_a_clear_error(tmp_path, content) -> None:
    path = tmp_path / "estimator.json"
    if content == "directory":
        path.mkdir()
    else:
        path.write_text(_other_drafter_state() if content == "other drafter" else content)
    worker = EngineWorker(make_engine(), estimator_state=str(path))
    with pytest.raises(EstimatorStateError) as e:
        worker.start()
    assert str(path) in str(e.value) and "--estimator-state-reset" in str(e.value)
    assert not worker.alive


def test_serve_exits_with_the_error_before_listening(tmp_path, monkeypatch) -> None:
    from types import SimpleNamespace

    from specverify.cli import build_parser
    from specverify.server import cli as serve_cli

    path = tmp_path / "estimator.json"
    path.write_text("{not json")
    engine = make_engine()
    monkeypatch.setattr(
        serve_cli, "llm_from_args", lambda args, **kw: SimpleNamespace(engine=engine, tokenizer=None)
    )
    monkeypatch.setattr(SpecverifyServer, "run", lambda self: pytest.fail("the server started"))
    args = build_parser().parse_args(
        ["serve", "--estimator-state", str(path), "--estimator-checkpoint-interval", "5"]
    )
    assert args.estimator_checkpoint_interval == 5.0 and not args.estimator_state_reset
    with pytest.raises(
        SystemExit, match="cannot restore the estimator state from .*estimator.json: JSONDecodeError"
    ):
        serve_cli.run(args)
    assert build_parser().parse_args(["serve"]).estimator_checkpoint_interval == 60.0
    args.estimator_checkpoint_interval = -1
    with pytest.raises(SystemExit, match="checkpoint-interval"):
        serve_cli.run(args)


def test_reset_starts_cold_and_overwrites_the_file(tmp_path, caplog) -> None:
    path = tmp_path / "estimator.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="specverify.server"):
        with serve(make_engine(), estimator_state=str(path), estimator_state_reset=True) as s:
            assert s.metrics()[(OBSERVED, DRAFTER)] == 0
            _traffic(s, 2)
    assert "starting cold" in caplog.text
    assert _labels_in(path) > 0


def test_a_missing_file_starts_cold(tmp_path, caplog) -> None:
    path = tmp_path / "estimator.json"
    with caplog.at_level(logging.INFO, logger="specverify.server"):
        worker = EngineWorker(make_engine(), estimator_state=str(path))
        worker.restore_estimator()
    assert "no estimator state" in caplog.text and worker.engine.estimator.n_observed_ == 0
