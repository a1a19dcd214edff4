"""JSONL traces of drafted slots: the features, the engine's prediction, and the label the target gave.

One record per drafted slot (labelled or not):
`{"request": str, "step": int, "position": int, "features": {name: float|null}, "prediction": float|null,
"verified": bool, "accepted": bool|null, "trains": bool, "drafter": str}`. `accepted` is the label under the censoring
rule (slot k of a request that verified n and accepted a: labelled iff k < n and k <= a, accepted iff
k < a) and null for censored slots. `trains` is False for requests that must not train the estimator.
Paths ending in .gz are gzip-compressed; appending to an existing trace adds to it.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

import numpy as np


def _finite_or_none(values: list[float]) -> list[float | None]:
    return [v if v == v and abs(v) != float("inf") else None for v in values]


def records_from_step(
    request_ids: Sequence[Any],
    step: int,
    features: Mapping[str, Any] | None,
    predictions: Any,
    num_drafted: Any,
    num_verified: Any,
    num_accepted: Any,
    trains: Any,
) -> list[dict[str, Any]]:
    """One record per drafted slot of one engine step.

    request_ids [R]; features {name: [R, D]} (or None); predictions [R, D] (or None); num_drafted,
    num_verified, num_accepted, trains [R]. Slots k < num_drafted[r] are written.
    """
    drafted = np.asarray(num_drafted, np.int64).reshape(-1)
    verified = np.asarray(num_verified, np.int64).reshape(-1)
    accepted = np.asarray(num_accepted, np.int64).reshape(-1)
    trains_arr = np.broadcast_to(np.asarray(trains, bool).reshape(-1), drafted.shape)
    if not (len(request_ids) == drafted.size == verified.size == accepted.size):
        raise ValueError(
            "request_ids, num_drafted, num_verified and num_accepted must have one entry per request"
        )
    depth = int(drafted.max()) if drafted.size else 0
    rows, cols = np.nonzero(np.arange(depth)[None, :] < drafted[:, None])
    if rows.size == 0:
        return []

    def column(a: Any) -> list[float | None]:
        a = np.asarray(a, np.float64)
        return _finite_or_none(a[rows, cols].tolist())

    feats = {name: column(v) for name, v in (features or {}).items()}
    preds = column(predictions) if predictions is not None else [None] * rows.size
    is_verified = (cols < verified[rows]).tolist()
    labelled = (cols < verified[rows]) & (cols <= accepted[rows])
    label = np.where(labelled, cols < accepted[rows], False).tolist()
    labelled = labelled.tolist()
    ids = [str(request_ids[r]) for r in rows.tolist()]
    train = trains_arr[rows].tolist()
    return [
        {
            "request": ids[i],
            "step": int(step),
            "position": c,
            "features": {name: values[i] for name, values in feats.items()},
            "prediction": preds[i],
            "verified": is_verified[i],
            "accepted": label[i] if labelled[i] else None,
            "trains": train[i],
        }
        for i, c in enumerate(cols.tolist())
    ]


class TraceWriter:
    """Appends trace records to a JSONL file (gzip when the path ends in .gz). A context manager."""

    def __init__(self, path: str | os.PathLike[str], drafter: str = "draft_model"):
        self.path = os.fspath(path)
        self.drafter = drafter  # each record names it: features of different drafters do not mix
        opener = gzip.open if self.path.endswith(".gz") else open
        self._file: IO[str] | None = opener(self.path, "at", encoding="utf-8")
        self.records_written = 0

    def write(self, record: Mapping[str, Any]) -> None:
        self.write_records([record])

    def write_records(self, records: Iterable[Mapping[str, Any]]) -> None:
        if self._file is None:
            raise ValueError(f"trace {self.path} is closed")
        lines = [json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n" for r in records]
        self._file.write("".join(lines))
        self.records_written += len(lines)

    def write_step(
        self,
        *,
        request_ids: Sequence[Any],
        step: int,
        features: Mapping[str, Any] | None,
        predictions: Any,
        num_drafted: Any,
        num_verified: Any,
        num_accepted: Any,
        trains: Any,
    ) -> int:
        """Write every drafted slot of one engine step (see records_from_step); returns the record count."""
        records = records_from_step(
            request_ids, step, features, predictions, num_drafted, num_verified, num_accepted, trains
        )
        for record in records:
            record["drafter"] = self.drafter
        self.write_records(records)
        return len(records)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lines(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    lines = []
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            for line in f:
                lines.append(line)
        except EOFError:  # a gzip trace cut off mid-write: keep what decompresses
            pass
    return lines


def read_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a trace as arrays: request (str), step, position (int64), prediction (float64, NaN for null),
    verified, labelled, accepted (bool; False where not labelled), trains (bool), and
    features: {name: float64 array, NaN where missing}; `drafters`: the drafters its records name
    (records from before traces named one came from the draft model). A malformed last line (a run killed mid-write)
    is skipped; a malformed line elsewhere raises ValueError.
    """
    path = os.fspath(path)
    lines = [line for line in _lines(path) if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON: {e}") from e
    names = sorted({name for r in records for name in (r.get("features") or {})})

    def floats(values: Iterable[Any]) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)

    accepted = [r.get("accepted") for r in records]
    return {
        "request": np.array([str(r["request"]) for r in records], dtype=object),
        "step": np.array([r["step"] for r in records], dtype=np.int64),
        "position": np.array([r["position"] for r in records], dtype=np.int64),
        "prediction": floats(r.get("prediction") for r in records),
        "verified": np.array([bool(r.get("verified")) for r in records], dtype=bool),
        "labelled": np.array([a is not None for a in accepted], dtype=bool),
        "accepted": np.array([bool(a) for a in accepted], dtype=bool),
        "trains": np.array([bool(r.get("trains", True)) for r in records], dtype=bool),
        "features": {name: floats((r.get("features") or {}).get(name) for r in records) for name in names},
        "drafters": sorted({str(r.get("drafter", "draft_model")) for r in records}),
    }
