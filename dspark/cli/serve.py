"""`dspark serve`: flags, the engine, uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import threading
from pathlib import Path

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from dspark import envs
from dspark.api import build_engine
from dspark.cli.engine_flags import add_engine_flags, engine_config
from dspark.errors import DSparkError
from dspark.serve.app import create_app

log = logging.getLogger("dspark")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="require 'Authorization: Bearer KEY' on every request (default: $DSPARK_API_KEY)",
    )
    p.add_argument(
        "--model-name", default=None, help="model id clients send and /v1/models lists (default: the target)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests allowed to wait for a batch slot; beyond that: HTTP 429 (default 64)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted; beyond that: HTTP 413 "
        "(default: 64 bytes per token of the model's context, at least 4 MiB)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds after SIGTERM/SIGINT that requests in flight may take to finish; then each ends "
        "with a clean 503 and the process exits 0 (default 30; new requests get 503 at once)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def served_name(target: str) -> str:
    return Path(target).name if os.sep in target or Path(target).is_dir() else target


def _check_flags(args) -> None:
    """Before anything loads: a typo must not cost a model load."""
    if args.max_batch < 1:
        raise DSparkError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise DSparkError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.port < 65536:
        raise DSparkError(f"--port must be in 1..65535, got {args.port}")
    if args.drain_timeout < 0:
        raise DSparkError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise DSparkError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")


class _Server(uvicorn.Server):
    """uvicorn, ending the process normally after a graceful shutdown. uvicorn itself re-raises
    the signal that stopped it once it has drained, so that the default handler ends the
    process: after SIGTERM that is exit 143, which supervisors read as a failure.

    On the first signal the worker stops admitting; `drain_timeout` seconds later it ends what is
    still in flight with a 503, so the drain is bounded and no client is cut off mid-answer."""

    def __init__(self, config, worker, drain_timeout: float):
        super().__init__(config)
        self.worker, self.drain_timeout = worker, drain_timeout
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._timer is None:
            log.info("dspark serve: draining (up to %.0f s for the requests in flight)", self.drain_timeout)
            self.worker.drain()
            self._timer = threading.Timer(self.drain_timeout, self.worker.cut)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = build_engine(engine_config(args))
    for note in engine.notes:
        log.info("dspark serve: %s", note)
    name = args.model_name or served_name(args.target)
    app = create_app(
        engine, model_name=name, api_key=args.api_key, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes
    )
    if not _is_loopback(args.host) and not args.api_key:
        log.warning("WARNING: listening on %s without --api-key: anyone who can reach it can use it", args.host)
    log.info(
        "dspark serve: model %r (%s) on http://%s:%d (the page showing each token's origin: that address in a browser)",
        name,
        "speculative" if engine.draft is not None else "no draft",
        args.host,
        args.port,
    )
    # uvicorn's own bound: connections still open a little after the drain's 503s are closed
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout + 5
    )
    server = _Server(config, app.state.worker, args.drain_timeout)
    server.run()
    if not server.started:  # uvicorn logged why (the port is taken, say)
        raise DSparkError(f"the server did not start on {args.host}:{args.port}")
    return 0
