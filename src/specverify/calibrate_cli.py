"""`specverify calibrate TRACE`: how well calibrated are acceptance estimates on a recorded trace?"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# Methods drawn in the reliability diagram (when present): the brief's comparison, plus the engine's own.
_PLOTTED = ("raw_qmax", "engine", "online", "heldout")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `calibrate` sub-command on an argparse subparsers object."""
    p = subparsers.add_parser(
        "calibrate",
        help="AUC / ECE / reliability diagram of acceptance estimates on a recorded trace",
        description=(
            "Score acceptance estimates on the labelled drafts of a trace written with --record-trace: "
            "raw q_max used as a probability, the engine's own predictions, the K+1 online logistic "
            "(prequential and on held-out requests), a per-position variant, and other features."
        ),
    )
    p.add_argument("trace", help="trace file (JSONL, .gz allowed)")
    p.add_argument("--plot", metavar="PNG", help="write a reliability diagram here")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    p.add_argument("--bins", type=int, default=15, help="equal-width ECE / reliability bins (default 15)")
    p.add_argument(
        "--estimator",
        metavar="JSON",
        default="{}",
        help="AcceptanceEstimator options for the refits, e.g. '{\"half_life\": 4000}'",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the report table; write the plot / JSON when asked. 0 on success, 1 on bad input."""
    from specverify.calibration import calibration_report, format_report, reliability_plot, report_json
    from specverify.trace import read_trace

    try:
        options = json.loads(args.estimator)
        if not isinstance(options, dict):
            raise ValueError("--estimator must be a JSON object")
        trace = read_trace(args.trace)
        if args.bins < 1:
            raise ValueError("--bins must be at least 1")
        if not trace["labelled"].any():
            raise ValueError(f"{args.trace} holds no labelled drafts")
        report = calibration_report(trace, bins=args.bins, estimator_options=options)
    except (OSError, ValueError) as e:
        print(f"specverify calibrate: error: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report_json(report), f, indent=2)
    if args.plot:
        y = report["label"]
        curves = {
            name: (report["predictions"][name], y) for name in _PLOTTED if name in report["predictions"]
        }
        reliability_plot(curves, args.plot, bins=args.bins)
        print(f"\nreliability diagram: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (the package CLI wires `add_parser` in as a sub-command)."""
    parser = argparse.ArgumentParser(prog="specverify")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
