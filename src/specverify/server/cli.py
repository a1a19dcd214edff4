"""`specverify serve`: load the models, build the app, run uvicorn until a signal stops it."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from specverify.cli import add_model_arguments, llm_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `serve` subcommand."""
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming) with Prometheus /metrics",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="model name clients must use (default: the target's name)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests that may wait for a running slot; beyond that the server answers 429 (default: 256)",
    )
    p.add_argument(
        "--estimator-state",
        metavar="PATH",
        help="restore the acceptance estimator from PATH at start (if it exists; a file that cannot be read "
        "stops the server) and save it there periodically and at shutdown",
    )
    p.add_argument(
        "--estimator-checkpoint-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --estimator-state, also save it every SECONDS when it has learned something, so a crash "
        "loses at most that much (0: only at shutdown; default: 60)",
    )
    p.add_argument(
        "--estimator-state-reset",
        action="store_true",
        help="start with a cold estimator even if --estimator-state exists; the file is overwritten later",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after a shutdown signal before they end with an error",
    )
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests that give none")
    p.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "processed_logprobs"],
        help="which distribution logprobs report: the target's raw log-softmax (default, as vLLM's) or the "
        "processed one each token was sampled from (after logit bias, temperature, top-k, top-p)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the server until it is told to stop; returns the process exit code."""
    if args.max_queue < 0:
        raise SystemExit("error: --max-queue must be >= 0")
    if not 0 <= args.port <= 65535:
        raise SystemExit("error: --port must be in [0, 65535]")
    if args.shutdown_timeout < 0:
        raise SystemExit("error: --shutdown-timeout must be >= 0")
    if args.estimator_checkpoint_interval < 0:
        raise SystemExit("error: --estimator-checkpoint-interval must be >= 0")
    if args.estimator_state and not os.path.isdir(os.path.dirname(os.path.abspath(args.estimator_state))):
        raise SystemExit(f"error: the directory of --estimator-state {args.estimator_state} does not exist")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from specverify.server.app import SpecverifyServer, create_app
    from specverify.server.worker import EstimatorStateError

    llm = llm_from_args(args, seed=args.seed, logprobs_mode=args.logprobs_mode)
    app = create_app(
        llm.engine,
        llm.tokenizer,
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        estimator_state=args.estimator_state,
        shutdown_timeout=args.shutdown_timeout,
        estimator_checkpoint_interval=args.estimator_checkpoint_interval,
        estimator_state_reset=args.estimator_state_reset,
        # Clients often name the model by what was passed to --model (vLLM's default name): accept that too.
        model_aliases=(args.model, Path(args.model).name, Path(args.model).stem) if args.model else (),
    )
    try:
        app.state.ctx.worker.restore_estimator()  # before listening: a broken file stops the server here
    except EstimatorStateError as e:
        raise SystemExit(f"error: {e}") from e
    server = SpecverifyServer(app, host=args.host, port=args.port, log_level=args.log_level)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a clean shutdown
        pass
    return 0
