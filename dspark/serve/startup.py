"""The server before its engine exists: listening within seconds, answering 503 while it starts.

Loading a model takes seconds to minutes. A server that only listens once it is loaded looks
dead to a supervisor's liveness probe and to a client all that time (connection refused), and
finds a busy port only at the end. `Starting` is the ASGI app uvicorn serves from the first
second: it runs the load on a thread of its own, answers every request with a 503 that says
what it is doing (Retry-After, a JSON reason), then hands every request to the app the load
returned, whose own lifespan (the engine thread) it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from dspark.serve.protocol import APIError

log = logging.getLogger("dspark")

RETRY_AFTER_S = 2  # a poll every 2 s: the phases last seconds to minutes


class Starting:
    """ASGI app: 503 while `load(set_phase)` runs (on a daemon thread, so a stop during a load is
    not held up by it), then the FastAPI app it returned. `on_failure(exc)` is called on the event
    loop if the load raises; the server should then exit (the error is kept in `error`)."""

    def __init__(self, load: Callable[[Callable[..., None]], FastAPI], on_failure: Callable[[BaseException], None]):
        self._load, self._on_failure = load, on_failure
        self.phase = "starting"
        self.app: FastAPI | None = None
        self.error: BaseException | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None

    @property
    def loading(self) -> bool:
        """The load is still running (the server stopped during it)."""
        return self._thread is not None and self._thread.is_alive()

    def set_phase(self, phase: str, say: bool = True) -> None:
        """Called by the load (any thread): what /health says while it runs; `say`: log it too
        (False for a phase that logged itself, as dspark.progress steps do)."""
        self.phase = phase
        if say:
            log.info("dspark serve: %s", phase)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan_events(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            await self.not_ready()(scope, receive, send)

    def not_ready(self) -> JSONResponse:
        """The same answer for /health and for the API: a probe and a client both learn to wait."""
        if self.error is not None:
            msg = "the server failed to start and is exiting (its log says why)"
        else:
            msg = f"the server is starting ({self.phase}): retry in a few seconds"
        body = {"status": "starting" if self.error is None else "failed", "reason": self.phase}
        body |= APIError(503, msg, code="starting").body()
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    # ---- lifespan: uvicorn starts listening once startup completes, so it completes at once --------
    async def _lifespan_events(self, receive, send) -> None:
        await receive()  # lifespan.startup
        self._task = asyncio.create_task(self._start())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self._stop()
        await send({"type": "lifespan.shutdown.complete"})

    async def _start(self) -> None:
        try:
            app = await self._loaded()
            ctx = app.router.lifespan_context(app)
            await ctx.__aenter__()  # the engine thread and the tokenizer threads
            self._lifespan, self.app = ctx, app
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure ends the server; run() re-raises it
            self.error, self.phase = exc, "failed to start"
            self._on_failure(exc)

    async def _loaded(self) -> FastAPI:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result=None, exc: BaseException | None = None) -> None:
            if not done.done():
                done.set_exception(exc) if exc is not None else done.set_result(result)

        def work() -> None:
            app, error = None, None
            try:
                app = self._load(self.set_phase)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop, which decides
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped meanwhile
                loop.call_soon_threadsafe(settle, app, error)

        self._thread = threading.Thread(target=work, name="dspark-load", daemon=True)
        self._thread.start()
        return await done

    async def _stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a load still running is abandoned (its thread is a daemon)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
