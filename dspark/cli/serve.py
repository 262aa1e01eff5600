"""`dspark serve`: flags, the engine, uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from dspark import envs, progress
from dspark.api import build_engine
from dspark.cli.engine_flags import add_engine_flags, engine_config
from dspark.errors import DSparkError
from dspark.serve.app import create_app
from dspark.serve.hosts import HostGuard, is_loopback, parse_allowed
from dspark.serve.startup import Starting
from dspark.serve.worker import EngineWorker

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
        "with a clean 503 and the process exits 0 (default 30; new requests get 503 at once). "
        "A second signal ends them at once, the same way, and exits 130 (SIGINT) or 143 (SIGTERM)",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="Host header names the server answers to, comma-separated ('*': any); others get HTTP 403. "
        "Default: on a loopback --host, only localhost, 127.0.0.1 and [::1] (a defence against DNS rebinding); "
        "elsewhere any",
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
    if args.allowed_hosts is not None and not args.allowed_hosts.strip(" ,"):
        raise DSparkError("--allowed-hosts is empty: give names (a,b) or '*' for any")


FORCE_GRACE_S = 5.0  # after a second signal: time for the error events to reach their clients


class _Server(uvicorn.Server):
    """uvicorn with dspark's shutdown. uvicorn itself re-raises the signal that stopped it once it
    has drained, so that the default handler ends the process: after SIGTERM that is exit 143,
    which supervisors read as a failure of a clean stop.

    The first signal drains: the worker stops admitting; `drain_timeout` seconds later it ends what
    is still in flight with a 503, so the drain is bounded. A second signal (the user is in a hurry)
    ends what is in flight at once the same way (an error event on a stream, a 503 otherwise: never
    a cut connection) and the exit code says the stop was forced: 128 + the signal. A third stops
    waiting for clients that do not take their error."""

    def __init__(self, config, starting: Starting, drain_timeout: float):
        super().__init__(config)
        self.starting, self.drain_timeout = starting, drain_timeout
        self.signals: list[int] = []
        self.exit_code = 0
        self._timers: list[threading.Timer] = []

    @property
    def worker(self) -> EngineWorker | None:
        app = self.starting.app
        return None if app is None else app.state.worker

    def handle_exit(self, sig, frame) -> None:
        self.signals.append(sig)
        if len(self.signals) == 1:
            self._drain()
        elif len(self.signals) == 2:
            self._force(sig)
        else:
            self.force_exit = True
        self.should_exit = True

    def _drain(self) -> None:
        worker = self.worker
        if worker is None:  # still starting: nothing is in flight
            log.info("dspark serve: stopping before the model finished loading")
            return
        log.info("dspark serve: draining (up to %.0f s for the requests in flight)", self.drain_timeout)
        worker.drain()
        self._after(self.drain_timeout, worker.cut)

    def _force(self, sig: int) -> None:
        self.exit_code = 128 + sig  # what a shell reports for a process the signal ended
        for timer in self._timers:
            timer.cancel()
        worker = self.worker
        log.warning(
            "dspark serve: %s again: ending the requests in flight now (exit %d)",
            signal.Signals(sig).name,
            self.exit_code,
        )
        if worker is None:
            self.force_exit = True
            return
        worker.drain()
        worker.cut("the server is shutting down (stopped by a second signal)")
        self._after(FORCE_GRACE_S, lambda: setattr(self, "force_exit", True))

    def _after(self, seconds: float, fn) -> None:
        timer = threading.Timer(seconds, fn)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

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


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, before the model loads: a busy port fails in seconds, not after a load."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise DSparkError(f"cannot listen on {where}: {exc.strerror or exc} (check --host)") from None
    try:
        # as uvicorn does: a restart reuses the port at once (Linux still refuses a port in use)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = " (another server is on that port? choose --port)" if exc.errno == errno.EADDRINUSE else ""
        raise DSparkError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from None
    return sock


def _loader(args):
    """The load `Starting` runs on its own thread: the engine, then the app serving it."""

    def load(set_phase):
        checks = not args.no_spec and not args.no_check
        set_phase("loading the model" + (" and checking the draft" if checks else ""))
        # its slow steps in turn ("loading target ...", "checking the draft") become the reason
        with progress.listening(lambda start: set_phase(start, say=False)):
            engine = build_engine(engine_config(args))
        for note in engine.notes:
            log.info("dspark serve: %s", note)
        set_phase("starting the engine")
        name = args.model_name or served_name(args.target)
        app = create_app(
            engine, model_name=name, api_key=args.api_key, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes
        )
        log.info(
            "dspark serve: ready: model %r (%s) on http://%s:%d (the page showing each token's origin: "
            "that address in a browser)",
            name,
            "speculative" if engine.draft is not None else ("lookup only" if engine.speculative else "no draft"),
            args.host,
            args.port,
        )
        return app

    return load


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    sock = _bind(args.host, args.port)
    if not is_loopback(args.host) and not args.api_key:
        log.warning("WARNING: listening on %s without --api-key: anyone who can reach it can use it", args.host)
    server: _Server | None = None

    def failed(_exc: BaseException) -> None:
        assert server is not None  # the load starts once the server runs
        server.should_exit = True

    starting = Starting(_loader(args), failed)
    app = HostGuard(starting, parse_allowed(args.allowed_hosts, args.host))
    log.info(
        "dspark serve: listening on http://%s:%d (/health answers 503 until the model is ready)", args.host, args.port
    )
    # uvicorn's own bound: connections still open a little after the drain's 503s are closed
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout + 5)
    server = _Server(config, starting, args.drain_timeout)
    server.run(sockets=[sock])
    if starting.error is not None:
        raise starting.error
    if starting.loading:
        _exit_during_load(server.exit_code)
    return server.exit_code


def _exit_during_load(code: int) -> None:
    """Stopped while the model loads: the interpreter must not finalize under the loading thread
    (torch's and the kernels' native threads abort the process then: exit 134, "terminate called
    without an active exception"), so the process ends here, its output flushed."""
    log.info("dspark serve: stopped before the model finished loading")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
