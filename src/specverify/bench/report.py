"""Benchmark report: terminal table, `results.json`, PNG plots.

results.json schema (stable: fields may be added, never renamed or removed)
---------------------------------------------------------------------------
{
  "schema_version": 1,
  "config": {                         # what was run
    "modes": ["none", "fixed", "adaptive"], "concurrencies": [int, ...],
    "num_prompts": int | null,        # prompts per point, never fewer than concurrency * rounds
                                      # (null: max(concurrency * rounds, min_prompts))
    "min_prompts": int,               # the floor used when num_prompts is null (added)
    "rounds": int,                    # (added) at least concurrency * rounds prompts per point
                                      # (--rounds; 1)
    "closed_rounds": bool,            # (added) closed rounds of `concurrency` prompts instead of one
                                      # pool per point (absent: closed rounds, as files before it ran)
    "max_tokens": int,
    "temperature": float | [float, ...],  # a float when one temperature ran; the list, in sweep order,
                                      # when several did (0: greedy)
    "top_p": float,                   # applies to temperature > 0 only
    "num_speculative_tokens": int,
    "seed": int, "ignore_eos": bool, "warmup_tokens": int, "warmup_prompts": int,
    "warmup_labels": int,             # (added) labels the adaptive estimators learnt untimed before the
                                      # sweep (0: they started cold; absent: files before it, cold)
    "estimator_warmup": {"labels": {"sampled"|"greedy": int}, "batches": int, "seconds": float} | null,
    "dataset": "humaneval" | "mtbench" | "gsm8k" | "mixed",
    "speculative_config": {"method", "model", "suffix_cache_tokens", "num_speculative_tokens", "estimator"},
    "target": str, "draft": str | null, "dtype": str, "device": str, "threads": int,
    "chat_template": bool, "prompt_tokens_mean": float, "setup_s": float, "total_s": float,
    "partial": bool,                  # true while the sweep is still running (rewritten after each
                                      # (temperature, concurrency) point, all its modes done)
    "cost_model": {...}               # the adaptive mode's cost model at the end (CostModel.to_dict())
  },
  "runs": [                           # one per mode at each (temperature, concurrency) point: for each
                                      # temperature, for each concurrency, every mode in config order.
                                      # Within a point the modes ran side by side: the prompts in
                                      # one pool, `concurrency` in flight (closed_rounds: split into
                                      # rounds of `concurrency`, the last may be smaller); in a
                                      # pool or round every mode's engine steps in turn, one step
                                      # each, the order changing each round across the whole sweep
                                      # (forward and reverse, rotated; BenchRunner.round_order). A
                                      # run's counts and seconds are sums over its rounds.
    {
      "mode": "none" | "fixed" | "adaptive",
      "concurrency": int,             # max_num_seqs: requests in flight
      "temperature": float,           # (added) this point's sampling temperature (0: greedy)
      "dataset": str,
      "output_tokens": int,           # generated tokens (the first `num_prompts` prompts)
      "wall_s": float,                # seconds in this mode's own engine calls, from queuing the
                                      # prompts to the last token, prefill included (the other modes'
                                      # steps in between excluded; summed over rounds; engine set-up
                                      # excluded). Files from before step-by-step turns timed whole
                                      # rounds, one mode after another.
      "tokens_per_s": float,          # output_tokens / wall_s
      "drafted_tokens": int, "verified_tokens": int, "accepted_tokens": int,
      "steps": int,                   # engine steps (one target forward each)
      # added fields:
      "num_prompts": int,             # the point's prompts (the same ones, same seeds, in every mode)
      "rounds": int,                  # (added) rounds the run's figures sum: 1 for a pool,
                                      # ceil(num_prompts / concurrency) for closed rounds; absent in
                                      # older files (each mode ran all its prompts in one go, modes
                                      # one after another)
      "request_steps": int,           # sum over steps of requests advanced
      "plan_check": {...} | null,     # (added; adaptive only) per "speculative" / "plain": the steps
                                      # the planner chose (warm-up and probes excluded) and its
                                      # predicted vs measured seconds and tokens: {"steps",
                                      # "predicted_seconds", "measured_seconds", "expected_tokens",
                                      # "tokens"}
      "profile": {...},               # (added) where the run's step time went, seconds summed over
                                      # its steps: "draft_forward", "draft_sampling" (draft
                                      # probabilities, sampling, features), "planning" (planner and
                                      # estimator), "target_forward", "target_sampling" (target
                                      # probabilities, verification), "bookkeeping" (the rest:
                                      # scheduling, KV truncation, emit, detokenising)
      "mean_tokens_per_step": float,  # output_tokens / request_steps: tokens per request per step
      "verified_over_drafted": float | null,
      "acceptance_rate": float | null,            # accepted / verified
      "drafted_per_position": [int], "verified_per_position": [int], "accepted_per_position": [int],
      "acceptance_per_position": [float | null],  # accepted_k / verified_k: of the slot-k drafts
                                                  # verified, the share accepted (all of slots <= k kept)
      "step_s": float, "planning_s": float,
      "planning_overhead": float | null,          # planning_s / step_s
      "finished_by_length": int,                  # requests stopped by max_tokens (the rest hit EOS)
      "prefill_steps": int, "prefill_s": float,   # steps that prefilled a prompt (a request's first
                                                  # tokens came out of them) and their seconds
      "decode_tokens": int, "decode_s": float,    # tokens and seconds of all other steps
      "decode_tokens_per_s": float | null,        # decode_tokens / decode_s: throughput without prefill
      "decode_speedup_vs_none": float | null,     # decode_tokens_per_s / that of mode none, same
                                                  # temperature and concurrency
      "full_tokens": int, "full_s": float,        # (added) tokens and seconds of the decode steps
                                                  # with every lane taken: steady decoding, without
                                                  # the pool's drain
      "full_tokens_per_s": float | null,          # full_tokens / full_s
      "full_speedup_vs_none": float | null,       # full_tokens_per_s / that of mode none, same point
      "speedup_vs_none": float | null,            # tokens_per_s / that of mode none, same temperature
                                                  # and concurrency
      "speedup_vs_fixed": float | null            # tokens_per_s / that of mode fixed, same temperature
                                                  # and concurrency
    }
  ],
  "calibration": {                    # the adaptive mode's estimator (fixed mode's if adaptive did not run),
    "ece": float, "auc": float,       # prequential: each prediction scored before its label was learnt,
    "raw_qmax_ece": float,            # over every timed run of that mode (all temperatures together);
                                      # raw_qmax_* score q_max itself
    "raw_qmax_auc": float,            # as the probability of acceptance
    "labels": int,                    # labelled drafts behind the figures
    "mode": "adaptive" | "fixed"
  },
  "calibration_by_mode": {"fixed": {...same keys...}, "adaptive": {...}},
  "plots": {"throughput": "throughput.png", "acceptance": "acceptance_per_position.png",
            "reliability": "reliability.png" | null}
}
Values that cannot be computed (a ratio without its baseline, ECE with no labels) are null.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from specverify.bench.runner import MODES, BenchRun

SCHEMA_VERSION = 1
RESULTS_FILE = "results.json"
THROUGHPUT_PLOT = "throughput.png"
ACCEPTANCE_PLOT = "acceptance_per_position.png"
RELIABILITY_PLOT = "reliability.png"
MODE_COLORS = {"none": "C0", "fixed": "C1", "adaptive": "C2"}  # the same colour per mode in every panel
LINE_STYLES = ("-", "--", ":", "-.")  # one per temperature, in sweep order


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _clean(value: Any) -> Any:
    """NaN / inf become null so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _point(run: dict[str, Any]) -> tuple[Any, int]:
    """(temperature, concurrency): the runs compared with each other (older runs have no temperature)."""
    return run.get("temperature"), run["concurrency"]


def run_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's dict plus the derived fields (ratios to none / fixed at the same temperature and
    concurrency, rates)."""
    by_mode = {(r["mode"], *_point(r)): r for r in runs}

    def versus(r: dict[str, Any], mode: str, key: str) -> float | None:
        """r[key] over `mode`'s at the same point (None where either is missing or zero)."""
        other = by_mode.get((mode, *_point(r)), {}).get(key)
        return _ratio(r[key], other) if other and r.get(key) is not None else None

    rows = []
    for r in runs:
        row = dict(r)
        row["mean_tokens_per_step"] = _ratio(r["output_tokens"], r.get("request_steps", 0))
        row["verified_over_drafted"] = _ratio(r["verified_tokens"], r["drafted_tokens"])
        row["acceptance_rate"] = _ratio(r["accepted_tokens"], r["verified_tokens"])
        row["acceptance_per_position"] = [
            _ratio(a, v)
            for a, v in zip(
                r.get("accepted_per_position", []), r.get("verified_per_position", []), strict=True
            )
        ]
        row["planning_overhead"] = _ratio(r.get("planning_s", 0.0), r.get("step_s", 0.0))
        row["speedup_vs_none"] = versus(r, "none", "tokens_per_s")
        row["speedup_vs_fixed"] = versus(r, "fixed", "tokens_per_s")
        row["decode_speedup_vs_none"] = versus(r, "none", "decode_tokens_per_s")
        row["full_speedup_vs_none"] = versus(r, "none", "full_tokens_per_s")
        rows.append(row)
    return rows


def results_dict(
    bench: BenchRun, extra_config: dict[str, Any] | None = None, plots: dict | None = None
) -> dict:
    """The results.json document (see the module docstring)."""
    config = dict(bench.config)
    config.update(extra_config or {})
    headline = bench.headline
    calibration = dict(bench.calibration.get(headline, {})) if headline else {}
    for key in ("ece", "auc", "raw_qmax_ece", "raw_qmax_auc", "labels"):
        calibration.setdefault(key, None)
    calibration["mode"] = headline
    return _clean(
        {
            "schema_version": SCHEMA_VERSION,
            "config": config,
            "runs": run_rows([r.to_dict() for r in bench.runs]),
            "calibration": calibration,
            "calibration_by_mode": bench.calibration,
            "plots": plots or {},
        }
    )


def write_results(results: dict, output_dir: str | os.PathLike) -> Path:
    path = Path(output_dir) / RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    return path


# ---- terminal table ---------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _temperatures_text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(format(t, "g") for t in value)
    return "?" if value is None else format(value, "g")


def _drafter_text(cfg: dict) -> str:
    method = (cfg.get("speculative_config") or {}).get("method", "draft_model")
    if method == "suffix":
        return "suffix drafter"
    return f"draft {cfg.get('draft', '-')}"


def format_table(results: dict) -> str:
    """A fixed-width table of every point, then the estimator's calibration."""
    header = [
        "T",
        "conc",
        "mode",
        "tok/s",
        "x none",
        "x fixed",
        "decode tok/s",
        "dec x none",
        "full tok/s",
        "full x none",
        "tok/step",
        "ver/draft",
        "acc/ver",
        "plan %",
        "acceptance per position",
    ]
    lines = []
    for r in results["runs"]:
        per_pos = " ".join(_fmt(a, ".2f") for a in r["acceptance_per_position"]) or "-"
        lines.append(
            [
                _fmt(r.get("temperature"), "g"),
                str(r["concurrency"]),
                r["mode"],
                _fmt(r["tokens_per_s"], ".2f"),
                _fmt(r["speedup_vs_none"], ".2f"),
                _fmt(r["speedup_vs_fixed"], ".2f"),
                _fmt(r["decode_tokens_per_s"], ".2f"),
                _fmt(r["decode_speedup_vs_none"], ".2f"),
                _fmt(r.get("full_tokens_per_s"), ".2f"),
                _fmt(r.get("full_speedup_vs_none"), ".2f"),
                _fmt(r["mean_tokens_per_step"], ".2f"),
                _fmt(r["verified_over_drafted"], ".2f"),
                _fmt(r["acceptance_rate"], ".2f"),
                _fmt(None if r["planning_overhead"] is None else 100 * r["planning_overhead"], ".1f"),
                per_pos,
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in lines)) if lines else len(h) for i, h in enumerate(header)]

    def render(cells: list[str]) -> str:
        # Numbers right-aligned, words and the last (free-form) column left-aligned.
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True)):
            out.append(cell.ljust(w) if i in (2, len(cells) - 1) else cell.rjust(w))
        return "  ".join(out).rstrip()

    text = [render(header), render(["-" * w for w in widths])] + [render(row) for row in lines]
    text.append(
        "T: temperature (0: greedy). tok/s: output tokens over the mode's own step time (the modes step in "
        "turn), prefill included; decode tok/s: "
        "steps without prefill only; full tok/s: decode steps with every lane taken (steady decoding, "
        "without the pool's drain, where the slowest requests finish with lanes empty). x none / x fixed: "
        "ratio to that mode at the same temperature and concurrency. tok/step: tokens per request per step. plan %: planner time over step time."
    )
    text.extend(["", *format_profile(results)])
    cfg = results.get("config", {})
    text.insert(
        0,
        (
            f"specverify bench: {cfg.get('target', '?')} / {_drafter_text(cfg)}, dataset {cfg.get('dataset')}, "
            f"max_tokens {cfg.get('max_tokens')}, T={_temperatures_text(cfg.get('temperature'))}, "
            f"top_p={cfg.get('top_p')} (T > 0 only), "
            f"K={cfg.get('num_speculative_tokens')}"
        ),
    )
    warmup = cfg.get("estimator_warmup")
    if warmup:
        labels = ", ".join(f"{kind} {n}" for kind, n in warmup["labels"].items())
        text.append(
            f"estimator warm-up before the sweep (untimed): {labels} labels in {warmup['batches']} batches, "
            f"{warmup['seconds']:.1f} s"
        )
    elif "adaptive" in cfg.get("modes", []):
        text.append("estimator warm-up: none, the adaptive mode's first point paid its exploration")
    for mode, cal in results.get("calibration_by_mode", {}).items():
        text.append(
            f"estimator calibration ({mode} runs, {_fmt(cal.get('labels'), 'd')} labels): "
            f"ECE {_fmt(cal.get('ece'), '.4f')}  AUC {_fmt(cal.get('auc'), '.4f')}  |  raw q_max: "
            f"ECE {_fmt(cal.get('raw_qmax_ece'), '.4f')}  AUC {_fmt(cal.get('raw_qmax_auc'), '.4f')}"
        )
    return "\n".join(text)


_PROFILE_COLUMNS = {
    "draft_forward": "draft fwd",
    "draft_sampling": "draft sample",
    "planning": "plan",
    "target_forward": "target fwd",
    "target_sampling": "target sample+verify",
    "bookkeeping": "bookkeeping",
}


def format_profile(results: dict) -> list[str]:
    """Where each run's step time went: ms per step in each phase, then the phase's share."""
    header = ["T", "conc", "mode", "ms/step", *_PROFILE_COLUMNS.values()]
    rows = []
    for r in results["runs"]:
        profile, steps = r.get("profile") or {}, r.get("steps") or 0
        if not profile or not steps:
            continue
        total = sum(profile.values()) or 1.0
        cells = [
            f"{1000 * profile.get(name, 0.0) / steps:.1f} ({100 * profile.get(name, 0.0) / total:.0f}%)"
            for name in _PROFILE_COLUMNS
        ]
        rows.append(
            [
                _fmt(r.get("temperature"), "g"),
                str(r["concurrency"]),
                r["mode"],
                f"{1000 * total / steps:.1f}",
                *cells,
            ]
        )
    if not rows:
        return []
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, ["-" * w for w in widths], *rows]
    ]
    lines.append(
        "step profile: ms per step in each phase (share of step time); bookkeeping is the rest of the step."
    )
    return lines


# ---- plots ------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def _temperatures(runs: list[dict[str, Any]]) -> list[Any]:
    """The temperatures of the runs in the order they ran (None for runs recorded without one)."""
    return list(dict.fromkeys(r.get("temperature") for r in runs))


def plot_throughput(results: dict, path: str | os.PathLike) -> Path:
    """Throughput and speed-up over concurrency: one line per (mode, temperature); colour is the mode,
    line style the temperature."""
    plt = _pyplot()
    runs = results["runs"]
    temps = _temperatures(runs)
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        for i, t in enumerate(temps):
            points = sorted(
                (r["concurrency"], r["tokens_per_s"], r["speedup_vs_none"])
                for r in runs
                if r["mode"] == mode and r.get("temperature") == t
            )
            if not points:
                continue
            cs = [p[0] for p in points]
            style = {"color": MODE_COLORS[mode], "ls": LINE_STYLES[i % len(LINE_STYLES)], "marker": "o"}
            label = mode if len(temps) == 1 else f"{mode} T={_temperatures_text(t)}"
            ax.plot(cs, [p[1] for p in points], label=label, **style)
            if mode != "none" and any(p[2] is not None for p in points):
                ys = [math.nan if p[2] is None else p[2] for p in points]
                ax_ratio.plot(cs, ys, label=label, **style)
    concurrencies = sorted({r["concurrency"] for r in runs})
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xticks(concurrencies, [str(c) for c in concurrencies])
        a.minorticks_off()
        a.set_xlabel("concurrency (requests in flight)")
        a.grid(True, alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    suffix = f" (T={_temperatures_text(temps[0])})" if len(temps) == 1 and temps[0] is not None else ""
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput" + suffix)
    ax_ratio.axhline(1.0, color="grey", lw=1, ls="--")
    ax_ratio.set_ylabel("ratio to no speculation (same T)")
    ax_ratio.set_title("speed-up over no speculation" + suffix)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_acceptance(results: dict, path: str | os.PathLike) -> Path:
    """Per speculative mode: acceptance per draft position, one line per (concurrency, temperature)."""
    plt = _pyplot()
    temps = _temperatures(results["runs"])
    modes = [m for m in MODES if m != "none" and any(r["mode"] == m for r in results["runs"])]
    fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(5.5 * max(1, len(modes)), 4), squeeze=False)
    if not modes:
        axes[0][0].text(0.5, 0.5, "no speculative mode ran", ha="center", va="center")
        axes[0][0].set_axis_off()
    for ax, mode in zip(axes[0], modes, strict=False):
        for r in results["runs"]:
            if r["mode"] != mode or not r["acceptance_per_position"]:
                continue
            ys = [math.nan if a is None else a for a in r["acceptance_per_position"]]
            i = temps.index(r.get("temperature"))
            label = f"c={r['concurrency']}"
            if len(temps) > 1:
                label += f" T={_temperatures_text(r.get('temperature'))}"
            ax.plot(range(1, len(ys) + 1), ys, marker="o", ls=LINE_STYLES[i % len(LINE_STYLES)], label=label)
        depth = max(
            (len(r["acceptance_per_position"]) for r in results["runs"] if r["mode"] == mode), default=0
        )
        ax.set_xticks(range(1, depth + 1))
        one_t = f", T={_temperatures_text(temps[0])}" if len(temps) == 1 and temps[0] is not None else ""
        ax.set_title(f"{mode}{one_t}: accepted / verified per draft position")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_reliability(bench: BenchRun, path: str | os.PathLike) -> Path | None:
    """Reliability diagram of the headline mode's estimator next to raw q_max (None: no labels)."""
    from specverify.calibration import reliability_plot

    record = bench.records.get(bench.headline) if bench.headline else None
    if record is None:
        return None
    pred, label, raw = record.arrays()
    if label.size == 0:
        return None
    curves = {f"estimator ({bench.headline})": (pred, label)}
    if np.isfinite(raw).any():
        curves["raw q_max"] = (raw, label)
    reliability_plot(
        curves, str(path), title=f"Acceptance estimates, {bench.headline} runs ({label.size} labels)"
    )
    return Path(path)


def write_report(bench: BenchRun, output_dir: str | os.PathLike, extra_config: dict | None = None) -> dict:
    """Write results.json and the plots into `output_dir`; returns the results document."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    draft = results_dict(bench, extra_config)
    plots: dict[str, str | None] = {
        "throughput": plot_throughput(draft, out / THROUGHPUT_PLOT).name,
        "acceptance": plot_acceptance(draft, out / ACCEPTANCE_PLOT).name,
    }
    reliability = plot_reliability(bench, out / RELIABILITY_PLOT)
    plots["reliability"] = reliability.name if reliability else None
    results = results_dict(bench, extra_config, plots)
    write_results(results, out)
    return results
