"""`dspark serve` under hostile or careless input: text that is not Unicode, bodies too large
to read, prompts too long to tokenize, echoed values, wrong Content-Types, internal errors.

Every answer must be a 4xx (or an opaque 500) in OpenAI's {"error": {...}} shape, and a request
refused for its size must be refused before it reaches the engine thread: the worker's own
counter of submitted jobs proves it. Servers run in this process as in tests/test_serve.py.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from urllib.parse import urlparse

import httpx
import pytest
from dspark.serve import prompts, protocol
from dspark.serve.app import create_app, default_max_body_bytes

from tests.test_serve import CONTEXT, KEY, LiveServer, metric, tiny_engine

NAME = "smollm2"  # the served name, so the requests below are exactly what a user of `dspark serve` sends
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(create_app(tiny_engine(max_batch=2), model_name=NAME))
    yield s
    s.close()


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def tracebacks(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.exc_info]


@pytest.fixture
def logs():
    """Every log record, dspark's and uvicorn's (uvicorn's logger does not propagate to the root)."""
    h = Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for lg in loggers:
        lg.addHandler(h)
    yield h
    for lg in loggers:
        lg.removeHandler(h)


def submitted(s: LiveServer) -> int:
    return s.app.state.worker.submitted


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def still_serving(s: LiveServer) -> None:
    body = {"model": NAME, "prompt": "still there?", "max_tokens": 2, "temperature": 0}
    r = s.http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---- lone surrogates ------------------------------------------------------------------------------
SURROGATES = [
    (
        "chat/completions",
        rb'{"model":"smollm2","messages":[{"role":"user","content":"\ud800"}],"max_tokens":8}',
        "messages[0].content",
    ),
    ("completions", rb'{"model":"smollm2","prompt":"\udfff"}', "prompt"),
    ("completions", rb'{"model":"smollm2","prompt":["ok \udfff"]}', "prompt"),
    (
        "chat/completions",
        rb'{"model":"smollm2","messages":[{"role":"user","content":"hi"},{"role":"user",'
        rb'"content":[{"type":"text","text":"a\udc00b"}]}],"max_tokens":8}',
        "messages[1].content[0].text",
    ),
    ("completions", rb'{"model":"smollm2","prompt":"hi","stop":"\ud800"}', "stop"),
    ("completions", rb'{"model":"smollm2","prompt":"hi","stop":["ok","\ud800x"]}', "stop[1]"),
    ("completions", rb'{"model":"\ud800","prompt":"hi"}', "model"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATES, ids=[p for *_, p in SURROGATES])
def test_lone_surrogate_is_a_400_naming_the_field(srv, logs, path, raw, param):
    n0 = submitted(srv)
    err = error_of(srv.http.post(f"/v1/{path}", content=raw, headers=JSON), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"] == f"{param} is not valid Unicode text (lone surrogate)"
    assert submitted(srv) == n0 and logs.tracebacks() == []
    still_serving(srv)


def test_a_surrogate_pair_is_text(srv):
    raw = rb'{"model":"smollm2","messages":[{"role":"user","content":"\ud83d\ude00"}],"max_tokens":2}'
    assert srv.http.post("/v1/chat/completions", content=raw, headers=JSON).status_code == 200


# ---- 500: opaque, logged once ------------------------------------------------------------------------
def test_internal_error_is_opaque_and_logged_once(srv, logs, monkeypatch):
    def broken(*_a, **_kw):
        raise RuntimeError("secret server detail")

    monkeypatch.setattr(protocol, "parse_completion", broken)
    r = srv.http.post("/v1/completions", json={"model": NAME, "prompt": "hi"})
    err = error_of(r, 500)
    rid = r.headers["x-request-id"]
    assert err["type"] == "server_error" and err["message"].startswith(f"internal error (request {rid};")
    assert "secret" not in r.text and "RuntimeError" not in r.text
    tracebacks = logs.tracebacks()
    assert len(tracebacks) == 1 and rid in tracebacks[0].getMessage()
    assert "secret server detail" in str(tracebacks[0].exc_info[1])
    monkeypatch.undo()
    still_serving(srv)


# ---- body size -----------------------------------------------------------------------------------
def test_default_body_limit_follows_the_context(srv):
    assert srv.app.state.max_body_bytes == default_max_body_bytes(CONTEXT) == 4 << 20
    assert default_max_body_bytes(1 << 17) == 64 << 17  # 128k tokens: 8 MiB


def _raw_http(url: str, head: str, body: bytes = b"") -> tuple[int, dict]:
    """One request over a plain socket: the status and the JSON body of the answer."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed: {data!r}"
            data += chunk
    return int(data.split(maxsplit=2)[1]), json.loads(data.partition(b"\r\n\r\n")[2])


def _length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].decode().lower().split("\r\n")
    return next(int(h.split(":")[1]) for h in head if h.startswith("content-length:"))


def test_content_length_over_the_limit_is_refused_unread(srv):
    """The header alone decides: the 413 comes back though not one byte of the body was sent."""
    n0 = submitted(srv)
    declared = srv.app.state.max_body_bytes + 1
    status, body = _raw_http(
        srv.url,
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {declared}",
    )
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(declared) in body["error"]["message"] and "--max-body-bytes" in body["error"]["message"]
    assert submitted(srv) == n0
    # and a real one, sent whole by a client that writes its body before it reads
    big = json.dumps({"model": NAME, "prompt": "x" * declared})
    err = error_of(srv.http.post("/v1/completions", content=big, headers=JSON), 413)
    assert err["type"] == "invalid_request_error" and submitted(srv) == n0
    still_serving(srv)


def test_chunked_upload_is_cut_at_the_limit_while_others_are_served(srv):
    """A chunked body has no Content-Length: it is refused once the bytes received pass the limit.
    While it uploads, a small chat is answered: it finishes before the big body's last chunk is
    even sent (the upload waits for it), so reading a big body cannot have delayed it."""
    n0, limit = submitted(srv), srv.app.state.max_body_bytes
    small_done, waited = threading.Event(), []

    def upload():
        yield b'{"model": "smollm2", "prompt": "'
        waited.append(small_done.wait(60))
        for _ in range(limit // (1 << 16) + 2):
            yield b"x" * (1 << 16)
        yield b'"}'

    big: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: big.append(httpx.post(srv.url + "/v1/completions", content=upload(), headers=JSON, timeout=60))
    )
    t.start()
    small = srv.http.post(
        "/v1/chat/completions",
        json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0},
    )
    small_done.set()
    t.join(60)
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] >= 1
    assert waited == [True]
    err = error_of(big[0], 413)
    assert err["code"] == "request_too_large" and f"more than {limit} bytes" in err["message"]
    assert submitted(srv) == n0 + 1  # the small chat only


# ---- long prompts: refused before the engine thread ------------------------------------------------
@pytest.mark.parametrize("kind", ["completion", "chat", "many messages"])
def test_prompt_over_the_cheap_bounds_is_refused_untokenized(srv, kind, monkeypatch):
    encoder, tokenized, real = srv.app.state.encoder, [], prompts.encode_prompt
    monkeypatch.setattr(prompts, "encode_prompt", lambda *a: tokenized.append(a) or real(*a))
    n0, n = submitted(srv), encoder.max_chars + 1
    if kind == "chat":  # the bound is on all messages together
        half = "y" * (n // 2 + 1)
        path, body, param = "chat/completions", {"messages": [{"role": "user", "content": half}] * 2}, "messages"
    elif kind == "many messages":  # no characters at all, but each message costs its role header
        empty = [{"role": "user", "content": ""}] * (CONTEXT + 1)
        path, body, param = "chat/completions", {"messages": empty}, "messages"
    else:
        path, body, param = "completions", {"prompt": "y" * n}, "prompt"
    err = error_of(srv.http.post(f"/v1/{path}", json={"model": NAME, **body}), 400)
    want = f"{CONTEXT + 1} messages" if kind == "many messages" else f"{encoder.max_chars} in all"
    assert err["param"] == param and want in err["message"]
    assert tokenized == [] and submitted(srv) == n0


def test_prompt_within_the_bound_is_tokenized_and_checked_before_the_worker(srv):
    """Under the character bound but over the context in tokens: refused by the token count,
    still without reaching the engine thread."""
    n0 = submitted(srv)
    err = error_of(srv.http.post("/v1/completions", json={"model": NAME, "prompt": "word " * CONTEXT}), 400)
    assert err["param"] == "prompt" and "tokens" in err["message"] and submitted(srv) == n0


def test_slow_tokenization_does_not_hold_up_other_requests(srv, monkeypatch):
    """While one prompt is stuck in tokenization, another request is tokenized, decoded and
    answered: tokenizing runs neither on the event loop nor on the engine thread."""
    real, entered, release = prompts.encode_prompt, threading.Event(), threading.Event()

    def slow(tokenizer, prompt, chat):  # holds its tokenizer copy while it waits
        if prompt == "the slow one":
            entered.set()
            assert release.wait(60)
        return real(tokenizer, prompt, chat)

    monkeypatch.setattr(prompts, "encode_prompt", slow)
    slow_result: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: slow_result.append(
            srv.http.post("/v1/completions", json={"model": NAME, "prompt": "the slow one", "max_tokens": 2})
        )
    )
    t.start()
    try:
        assert entered.wait(30)
        r = srv.http.post("/v1/completions", json={"model": NAME, "prompt": "fast", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert not slow_result and t.is_alive()  # still waiting on its tokenization
    finally:
        release.set()
        t.join(60)
    assert slow_result[0].status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "temperature": 10**400}, "temperature"),  # an int too long for a float is still a number
        ({"prompt": "hi", "top_p": -(10**400)}, "top_p"),
        ({"prompt": [1, 10**400]}, "prompt"),
    ],
)
def test_huge_numbers_are_a_400(srv, body, param):
    err = error_of(srv.http.post("/v1/completions", json={"model": NAME, **body}), 400)
    assert err["param"] == param and "... (40" in err["message"]


# ---- user input quoted in errors is capped ---------------------------------------------------------------
HUGE = 1_000_000
ECHOES = [
    ("completions", {"model": "m" * HUGE, "prompt": "hi"}, 404, "model", f"... ({HUGE} characters)"),
    ("completions", {"prompt": "hi", "max_tokens": "9" * HUGE}, 400, "max_tokens", f"... ({HUGE} characters)"),
    ("completions", {"prompt": "hi", "logprobs": [1] * HUGE}, 400, "logprobs", "characters)"),
    ("chat/completions", {"messages": [{"role": "r" * HUGE, "content": "x"}]}, 400, "messages[0].role", "characters)"),
]


@pytest.mark.parametrize("path,body,status,param,tail", ECHOES, ids=[e[3] for e in ECHOES])
def test_echoed_values_are_capped(srv, path, body, status, param, tail):
    r = srv.http.post(f"/v1/{path}", json={"model": NAME, **body})
    err = error_of(r, status)
    assert err["param"] == param and tail in err["message"]
    assert len(r.content) < 600


# ---- Content-Type ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
)
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_post_needs_a_json_content_type(srv, path, content_type):
    n0, before = submitted(srv), srv.scrape()
    body = {"model": NAME, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {} if content_type is None else {"content-type": content_type}
    err = error_of(srv.http.post(f"/v1/{path}", content=json.dumps(body), headers=headers), 415)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert submitted(srv) == n0

    def invalid(m):
        return metric(m, "dspark_requests_total", status="invalid")

    assert invalid(srv.scrape()) == invalid(before) + 1


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_content_type_with_parameters_is_accepted(srv, content_type):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    r = srv.http.post("/v1/completions", content=json.dumps(body), headers={"content-type": content_type})
    assert r.status_code == 200, r.text


# ---- the API key -----------------------------------------------------------------------------------------
def test_health_answers_without_the_key_and_nothing_else_does():
    s = LiveServer(create_app(tiny_engine(max_batch=1), model_name=NAME, api_key=KEY))
    try:
        assert s.http.get("/health").json() == {"status": "ok"}
        for method, path in [
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
        ]:
            err = error_of(s.http.request(method, path, json={"model": NAME, "prompt": "hi"}), 401)
            assert err["code"] == "invalid_api_key"
        # the key comes first: an unauthenticated client learns nothing about its body
        assert s.http.post("/v1/completions", content=b"x", headers={"content-type": "text/plain"}).status_code == 401
        # ... nor which routes and methods exist (docs/SERVER.md: checked before anything else)
        for method, path in [
            ("GET", "/v1/nothing"),
            ("POST", "/admin"),
            ("GET", "/v1/completions"),
            ("PUT", "/metrics"),
        ]:
            assert error_of(s.http.request(method, path), 401)["code"] == "invalid_api_key", (method, path)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert s.http.get("/v1/nothing", headers=auth).status_code == 404
        assert s.http.get("/v1/completions", headers=auth).status_code == 405
        assert s.http.post("/health").status_code == 405  # the open routes stay open
    finally:
        s.close()


# ---- fields a request must not leave to chance ------------------------------------------------------------
@pytest.mark.parametrize("fmt", [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}])
def test_response_format_on_completions_is_refused_as_on_chat(srv, fmt):
    n0 = submitted(srv)
    err = error_of(srv.http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "response_format": fmt}), 400)
    assert err["param"] == "response_format" and "response_format is not supported" in err["message"]
    assert submitted(srv) == n0
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "response_format": {"type": "text"}}
    assert srv.http.post("/v1/completions", json=body).status_code == 200  # the default stays accepted


@pytest.mark.parametrize(
    "path,raw,key",
    [
        ("completions", b'{"model":"smollm2","prompt":"hi","max_tokens":2,"max_tokens":4000}', "max_tokens"),
        ("completions", b'{"model":"smollm2","prompt":"hi","prompt":"other"}', "prompt"),
        (
            "chat/completions",
            b'{"model":"smollm2","messages":[{"role":"user","content":"a","role":"system"}]}',
            "role",
        ),
        (
            "completions",
            b'{"model":"smollm2","prompt":"hi","stream_options":{"include_usage":true,"include_usage":false}}',
            "include_usage",
        ),
    ],
    ids=["top-level", "prompt", "nested", "stream_options"],
)
def test_a_key_given_twice_is_a_400_naming_it(srv, path, raw, key):
    """Parsers disagree on which of two values counts: a proxy that checked one must not see the other pass."""
    n0 = submitted(srv)
    err = error_of(srv.http.post(f"/v1/{path}", content=raw, headers=JSON), 400)
    assert err["param"] == key and f'key "{key}" twice' in err["message"]
    assert submitted(srv) == n0


def test_a_duplicate_key_that_is_not_text_is_named_without_breaking_the_answer(srv):
    raw = rb'{"model":"smollm2","prompt":"hi","\ud800":1,"\ud800":2}'
    err = error_of(srv.http.post("/v1/completions", content=raw, headers=JSON), 400)
    assert err["param"] is None and "twice" in err["message"]
    still_serving(srv)
