"""FastAPI routes over an EngineWorker.

    app = create_app(engine, model_name="smollm2", api_key=None, max_queue=64, max_body_bytes=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)

The engine must have a tokenizer (dspark.api.build_engine loads the target's). Handlers never
touch the engine: they validate, tokenize (prompts.py), submit a Job to the worker thread and
await its events.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dspark.errors import DSparkError
from dspark.serve import page, protocol
from dspark.serve.hosts import HostGuard
from dspark.serve.prometheus import ServerMetrics
from dspark.serve.prompts import PromptEncoder
from dspark.serve.protocol import EXTENSION, APIError, quote
from dspark.serve.worker import RATE_WINDOW_S, Admitted, Delta, Done, EngineWorker, Failed, Job

log = logging.getLogger("dspark")


class _Gone:
    """Event: the client disconnected."""


GONE = _Gone()
_STATUS_LABEL = {401: "unauthorized", 429: "queue_full"}
MIN_BODY_BYTES = 4 << 20  # the default body limit: 64 bytes per context token, at least 4 MiB
BODY_BYTES_PER_TOKEN = 64  # generous: a token is a few characters, an escaped one 6 bytes of JSON


def default_max_body_bytes(context: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context)


class _InternalErrors:
    """ASGI middleware: an unexpected exception is logged once, with its traceback, and answered
    with a 500 that says "internal error" and a request id to find it in the log. The exception's
    text stays out of the body: it can hold server internals or the request's own input.
    (Starlette's exception handler for Exception would re-raise it to uvicorn: logged twice.)"""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            if started:
                raise  # too late for a 500: uvicorn logs it and closes the connection
            rid = "req-" + uuid.uuid4().hex
            log.exception("dspark serve: internal error, request %s", rid)
            self.metrics.count("error")
            body = APIError(500, f"internal error (request {rid}; the server log has the details)").body()
            await JSONResponse(body, status_code=500, headers={"X-Request-Id": rid})(scope, receive, send)


def _open_path(path: str) -> bool:
    """The routes that answer without the key: liveness and the page (its API calls carry the key)."""
    return path in ("/health", "/") or path.startswith("/static/")


def _require_json(request: Request) -> None:
    """POST bodies must be declared JSON. Without this, a web page could make a browser send a
    cross-origin "simple" request (text/plain, no preflight) to a server on localhost."""
    declared = request.headers.get("content-type")
    if (declared or "").partition(";")[0].strip().lower() != "application/json":
        got = "no Content-Type" if declared is None else f"Content-Type {quote(declared)}"
        raise APIError(
            415,
            f"the request body must be sent as Content-Type: application/json, got {got}",
            code="unsupported_media_type",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes `limit` bytes: at once from Content-Length,
    else (chunked uploads) as soon as the bytes received pass it, without reading further."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"Content-Length is {declared}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"more than {limit} bytes were sent")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int, why: str) -> APIError:
    return APIError(
        413,
        f"the request body is over this server's limit of {limit} bytes ({why}); "
        "the limit is dspark serve's --max-body-bytes",
        code="request_too_large",
    )


def create_app(
    engine,
    *,
    model_name: str = "dspark",
    api_key: str | None = None,
    max_queue: int = 64,
    max_body_bytes: int | None = None,
    allowed_hosts: tuple[str, ...] | None = None,
) -> FastAPI:
    """max_body_bytes: the largest request body accepted (413 beyond); None: default_max_body_bytes.
    allowed_hosts: the Host names answered (hosts.HostGuard; dspark serve's --allowed-hosts); None: any."""
    if engine.tokenizer is None:
        raise DSparkError("dspark serve needs an engine with a tokenizer (this target has none)")
    max_context = engine.target.max_length
    max_body = default_max_body_bytes(max_context) if max_body_bytes is None else max_body_bytes
    if max_body < 1:
        raise DSparkError(f"max_body_bytes must be >= 1, got {max_body}")
    metrics = ServerMetrics(engine.gamma, engine.lookup.limit if engine.lookup is not None else 0)
    worker = EngineWorker(engine, metrics, max_queue)
    encoder = PromptEncoder(engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        worker.start()
        encoder.start()
        try:
            yield
        finally:
            encoder.close()
            await asyncio.to_thread(worker.stop)

    async def check_key(request: Request) -> None:
        assert api_key is not None  # the check is installed only with a key
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    # every route but /health: liveness reveals nothing but "ok", and probes rarely carry keys
    keyed = [Depends(check_key)] if api_key else []
    app = FastAPI(title="dspark", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_InternalErrors, metrics=metrics)
    app.add_middleware(HostGuard, allowed=allowed_hosts)  # added last: the outermost, before the key
    app.state.worker, app.state.metrics, app.state.engine = worker, metrics, engine
    app.state.max_body_bytes, app.state.encoder = max_body, encoder

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
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        # an unknown route or method needs the key like any other: the key comes first, and a
        # client without it learns nothing, not even which routes exist
        if api_key and exc.status_code in (404, 405) and not _open_path(request.url.path):
            try:
                await check_key(request)
            except APIError as err:
                return await on_api_error(request, err)
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    # ---- routes ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse(APIError(503, "the engine thread is not running").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def index():
        # the page itself holds nothing secret (no key, no data): its API calls carry the key
        return HTMLResponse(page.html(), headers=page.HEADERS)

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in page.FILES:
            raise APIError(404, f"no such file: {quote(name)}", code="not_found")
        return Response(page.read(name), media_type=page.FILES[name], headers=page.HEADERS)

    @app.get("/v1/dspark/stats", dependencies=keyed)
    async def stats():
        snap = dict(worker.stats)
        at = snap.pop("rate_at")
        if at is None or time.perf_counter() - at > RATE_WINDOW_S:  # idle: nothing generated lately
            snap["tokens_per_s"] = 0.0
        return {"model": model_name, **snap}

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "dspark",
            "max_model_len": max_context,
            "speculative": engine.speculative,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics", dependencies=keyed)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request):
        return await _generate(request, protocol.parse_completion)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request):
        return await _generate(request, protocol.parse_chat)

    # ---- one generation request --------------------------------------------------------------
    async def _generate(request: Request, parse):
        t_received = time.perf_counter()
        _require_json(request)
        try:
            raw = await _read_body(request, max_body)
        except ClientDisconnect:  # gone before its body arrived: nothing to do, nothing to count
            return Response(status_code=499)
        body = protocol.parse_json(raw)
        req = parse(body, model_name=model_name, max_context=max_context)
        prompt_ids, max_tokens = await encoder.encode(req)  # off the event loop and the engine thread
        job = Job(req, asyncio.get_running_loop(), t_received, prompt_ids, max_tokens)
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
            return StreamingResponse(
                _stream(job, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": job.id},
            )
        try:
            while True:
                ev = await job.events.get()
                if isinstance(ev, Done):
                    job.settled = True
                    return JSONResponse(
                        protocol.response_body(
                            req, job.id, job.created, model_name, ev.text, ev.finish_reason, ev.usage, ev.spec, ev.marks
                        )
                    )
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
                    yield out(text=ev.text, marks=ev.marks)
                elif isinstance(ev, Done):
                    job.settled = True
                    if ev.tail or ev.tail_marks:
                        yield out(text=ev.tail, marks=ev.tail_marks)
                    last = protocol.chunk(req, job.id, job.created, model_name, finish=ev.finish_reason)
                    last[EXTENSION] = ev.spec  # stats reach streaming clients even without include_usage
                    yield protocol.sse(last)
                    if req.include_usage:
                        yield protocol.sse(
                            protocol.usage_chunk(req, job.id, job.created, model_name, ev.usage, ev.spec)
                        )
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
