"""The soak's client: the standard library's http.client, one connection per request on a thread of
its own (no dependency beyond what `dspark serve` itself needs, and a disconnect is a real socket
shutdown); what each request got, and whether that is what it expected."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass

from dspark.bench.soak_mix import JSON_TYPE, Call

HOST = "127.0.0.1"


@dataclass
class Outcome:
    label: str
    expect: int | None
    status: int | None = None  # None: no HTTP answer (refused connection, timeout, left on purpose)
    text: str = ""
    finish: str | None = None
    tokens: int = 0
    latency: float = 0.0
    start: float = 0.0  # when it was sent (time.perf_counter), to find what overlapped it
    ttft: float | None = None  # streamed requests: the first chunk carrying text
    problem: str | None = None  # why it is unexpected; None: it got what it expected
    greedy_key: str | None = None


def send(port: int, call: Call, timeout: float) -> Outcome:
    out = Outcome(call.label, call.expect, greedy_key=call.greedy_key)
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = out.start = time.perf_counter()
    try:
        conn.connect()
        sock = conn.sock  # kept: http.client drops its own reference once a response is read
        conn.putrequest("POST", call.path, skip_accept_encoding=True)
        if call.content_type is not None:
            conn.putheader("Content-Type", call.content_type)
        conn.putheader("Content-Length", str(call.declared_length or len(call.body)))
        conn.endheaders(call.body)
        resp = conn.getresponse()
        out.status = resp.status
        if call.stream and resp.status == 200:
            _read_stream(resp, call, out, t0, sock)
        else:
            _read_body(resp, call, out)
    except (OSError, http.client.HTTPException) as exc:
        out.problem = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    out.latency = time.perf_counter() - t0
    if out.problem is None and call.expect is not None and out.status != call.expect:
        out.problem = f"HTTP {out.status}, expected {call.expect}"
    return out


def _read_body(resp, call: Call, out: Outcome) -> None:
    raw = resp.read()
    try:
        body = json.loads(raw)
    except ValueError:
        out.problem = f"HTTP {resp.status} with a body that is not JSON: {raw[:120]!r}"
        return
    if resp.status != 200:
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            out.problem = f"HTTP {resp.status} without an error object: {raw[:120]!r}"
        return
    choice = body["choices"][0]
    out.text = choice["message"]["content"] if "message" in choice else choice["text"]
    out.finish, out.tokens = choice["finish_reason"], body["usage"]["completion_tokens"]


def _read_stream(resp, call: Call, out: Outcome, t0: float, sock: socket.socket) -> None:
    """Server-sent events up to [DONE]; a disconnecting client shuts its socket at the first text."""
    pieces: list[str] = []
    while True:
        line = resp.readline()
        if not line:
            if call.expect is not None:
                out.problem = "the stream ended without [DONE]"
            return
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            out.problem = f"error event in the stream: {event['error'].get('message')}"
            return
        if event.get("usage"):
            out.tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if text:
                pieces.append(text)
                if out.ttft is None:
                    out.ttft = time.perf_counter() - t0
                if call.expect is None:
                    sock.shutdown(socket.SHUT_RDWR)  # the client vanishes: the server must free the slot
                    out.text = text
                    return
            out.finish = choice.get("finish_reason") or out.finish
    out.text = "".join(pieces)
    if call.expect is not None and out.finish is None:
        out.problem = "the stream had no finish_reason"


def drive(port: int, calls, concurrency: int, timeout: float, deadline: float | None = None) -> list[Outcome]:
    """Send `calls` (an iterable) with at most `concurrency` in flight; past `deadline`
    (time.monotonic) no new call starts. Outcomes in the order they finished."""
    it = iter(calls)
    lock = threading.Lock()
    outcomes: list[Outcome] = []

    def worker() -> None:
        while True:
            with lock:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                call = next(it, None)
            if call is None:
                return
            outcome = send(port, call, timeout)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def get_json(port: int, path: str, timeout: float) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        raw = resp.read().decode("utf-8", errors="replace")
        return resp.status, (json.loads(raw) if resp.getheader("content-type", "").startswith(JSON_TYPE) else raw)
    finally:
        conn.close()


def gauges(port: int) -> dict[str, float]:
    """The server's in-flight gauges from /metrics (what should be back to 0 once the load stops)."""
    try:
        status, text = get_json(port, "/metrics", 10)
    except (OSError, http.client.HTTPException) as exc:
        return {f"/metrics unreachable ({type(exc).__name__})": 1.0}
    out = {}
    if status == 200 and isinstance(text, str):
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("dspark_running_requests", "dspark_queue_depth"):
                out[name] = float(value)
    return out
