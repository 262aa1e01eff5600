"""FastAPI routes over an EngineWorker.

    app = create_app(engine, model_name="smollm2", api_key=None, max_queue=64)
    uvicorn.run(app, host="127.0.0.1", port=8000)

The engine must have a tokenizer (dspark.api.build_engine loads the target's). Handlers never
touch the engine: they validate, submit a Job to the worker thread and await its events.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dspark.errors import DSparkError
from dspark.serve import protocol
from dspark.serve.prometheus import ServerMetrics
from dspark.serve.protocol import EXTENSION, APIError
from dspark.serve.worker import Admitted, Delta, Done, EngineWorker, Failed, Job

log = logging.getLogger("dspark")


class _Gone:
    """Event: the client disconnected."""


GONE = _Gone()
_STATUS_LABEL = {401: "unauthorized", 429: "queue_full"}


def create_app(engine, *, model_name: str = "dspark", api_key: str | None = None, max_queue: int = 64) -> FastAPI:
    if engine.tokenizer is None:
        raise DSparkError("dspark serve needs an engine with a tokenizer (this target has none)")
    metrics = ServerMetrics(engine.gamma)
    worker = EngineWorker(engine, metrics, max_queue)
    created = int(time.time())
    max_context = engine.target.max_length

    @asynccontextmanager
    async def lifespan(_app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    async def check_key(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    app = FastAPI(title="dspark", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(check_key)] if api_key else [])
    app.state.worker, app.state.metrics, app.state.engine = worker, metrics, engine

    # ---- errors: always OpenAI's {"error": {...}} shape ------------------------------------
    @app.exception_handler(APIError)
    async def on_api_error(_request, exc: APIError):
        if not exc.counted:
            exc.counted = True
            metrics.count(_STATUS_LABEL.get(exc.status, "invalid" if exc.status < 500 else "error"))
        # a full queue drains within seconds: say when to retry (the openai client honours it)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(_request, exc: Exception):
        log.exception("dspark serve: unexpected error")
        metrics.count("error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    # ---- routes ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse(APIError(503, "the engine thread is not running").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "dspark",
                "max_model_len": max_context, "speculative": engine.draft is not None}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, protocol.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, protocol.parse_chat)

    # ---- one generation request --------------------------------------------------------------
    async def _generate(request: Request, parse):
        t_received = time.perf_counter()
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its body arrived: nothing to do, nothing to count
            return Response(status_code=499)
        body = protocol.parse_json(raw)
        req = parse(body, model_name=model_name, max_context=max_context)
        job = Job(req, asyncio.get_running_loop(), t_received)
        worker.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            first = await job.events.get()
        except BaseException:
            _release(job, watcher)
            raise
        if not isinstance(first, Admitted):
            _release(job, watcher)
            if isinstance(first, Failed):
                raise first.error
            return Response(status_code=499)  # the client is gone; nobody reads this
        if req.stream:
            return StreamingResponse(_stream(job, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.id})
        try:
            while True:
                ev = await job.events.get()
                if isinstance(ev, Done):
                    job.settled = True
                    return JSONResponse(protocol.response_body(req, job.id, job.created, model_name, ev.text,
                                                               ev.finish_reason, ev.usage, ev.spec))
                if isinstance(ev, Failed):
                    job.settled = True
                    raise ev.error
                if ev is GONE:
                    return Response(status_code=499)
        finally:
            _release(job, watcher)

    async def _stream(job: Job, watcher: asyncio.Task):
        req = job.req

        def out(**kw) -> str:
            return protocol.sse(protocol.chunk(req, job.id, job.created, model_name, **kw))

        try:
            if req.kind == "chat":
                yield out(role=True)
            while True:
                ev = await job.events.get()
                if isinstance(ev, Delta):
                    yield out(text=ev.text)
                elif isinstance(ev, Done):
                    job.settled = True
                    if ev.tail:
                        yield out(text=ev.tail)
                    last = protocol.chunk(req, job.id, job.created, model_name, finish=ev.finish_reason)
                    last[EXTENSION] = ev.spec  # stats reach streaming clients even without include_usage
                    yield protocol.sse(last)
                    if req.include_usage:
                        yield protocol.sse(protocol.usage_chunk(req, job.id, job.created, model_name, ev.usage, ev.spec))
                    yield protocol.SSE_DONE
                    return
                elif isinstance(ev, Failed):
                    # headers are gone already: the error travels as an event, as OpenAI's API does
                    job.settled = True
                    yield protocol.sse(ev.error.body())
                    yield protocol.SSE_DONE
                    return
                elif ev is GONE:
                    return
        finally:
            _release(job, watcher)

    def _release(job: Job, watcher: asyncio.Task) -> None:
        """The handler is done with a job: stop watching, and abort it unless it completed."""
        watcher.cancel()
        if not job.settled:
            job.settled = True
            worker.abort(job)

    async def _watch_disconnect(request: Request, job: Job) -> None:
        # The body is read already, so the next ASGI message can only be the disconnect; this
        # frees the slot at once even while the request waits in the queue emitting nothing.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not job.settled:
            job.settled = True
            worker.abort(job)
            job.events.put_nowait(GONE)

    return app
