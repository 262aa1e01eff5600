"""A soak of `dspark serve`: the server as a process on 127.0.0.1, a bounded mix of requests at a
fixed concurrency, and the figures a deployment asks about (docs/RELIABILITY.md).

The mix is a pure function of (seed, index), so a run can be repeated exactly and a `--seconds`
run draws as many requests as it has time for. Every request of the mix says what answer it
expects: 200 for a well-formed one, the exact 4xx for a malformed one; a client that
disconnects mid-stream expects nothing. Anything else is an unexpected error: a 5xx, a 4xx to a
well-formed request, a stream cut short or carrying an error event, a timeout.

Greedy requests are checked token for token: after the soak, each distinct greedy request is
sent again alone (concurrency 1, not streamed) and its text must equal what it got in the batch.

The client is the standard library's http.client, one connection per request on a thread of
its own: no dependency beyond what `dspark serve` itself needs, and a disconnect is a real
socket shutdown.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark import envs
from dspark.errors import DSparkError
from dspark.target.load import cpu_model_and_flags

HOST = "127.0.0.1"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON_TYPE = "application/json"

SHORT_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a list.",
    "What is 17 times 23?",
    "Give three tips for writing clear emails.",
    "List the planets of the solar system in order.",
    "Translate 'good morning' into French.",
    "Write a haiku about autumn rain.",
    "Why do we have seasons on Earth?",
    "Describe how a bicycle works.",
    "What are prime numbers?",
    "Once upon a time",
    "def fibonacci(n):",
)
# Long prompts are built from these sentences, in an order fixed by the prompt's index.
SENTENCES = (
    "The river bends twice before it reaches the old mill at the edge of the village.",
    "Every morning the baker lights the oven an hour before sunrise.",
    "A binary search halves the interval that can still hold the answer at every step.",
    "The committee met on Tuesday to discuss the budget for the coming year.",
    "Light from the sun is scattered by the molecules of the air, blue more than red.",
    "She kept a notebook of every bird she saw along the coast that summer.",
    "The train to the capital leaves at seven and arrives shortly after noon.",
    "A function that calls itself needs a case in which it stops.",
    "The museum's new wing holds paintings from the last two centuries.",
    "Rain fell steadily through the night and the streets were quiet.",
)
LONG_PROMPTS = 4
GREEDY_SHARE, STREAM_SHARE, CHAT_SHARE, LONG_SHARE = 0.5, 0.5, 0.5, 0.25
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


# ---- the mix ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One request of the mix and the answer it expects."""

    index: int
    path: str
    body: bytes
    expect: int | None  # the HTTP status it must get; None: the client leaves mid-stream
    label: str  # what it is: "chat stream greedy long", "malformed:bad_json", ...
    stream: bool = False
    content_type: str | None = JSON_TYPE
    declared_length: int | None = None  # a Content-Length that lies (the 413 case)
    greedy_key: str | None = None  # identifies a greedy request for the solo comparison
    solo_body: bytes | None = None  # that request, not streamed: what is sent alone afterwards

    @property
    def malformed(self) -> bool:
        return self.label.startswith("malformed:")


@dataclass(frozen=True)
class MixSettings:
    model: str
    context: int  # the model's context in tokens: long prompts and the over-long case follow it
    max_tokens: int = 32
    malformed_share: float = 0.1
    disconnect_share: float = 0.1
    seed: int = 0

    def __post_init__(self):
        check_mix(self.max_tokens, self.malformed_share, self.disconnect_share)


def check_mix(max_tokens: int, malformed_share: float, disconnect_share: float) -> None:
    if max_tokens < 4:  # the mix asks for a quarter of it
        raise DSparkError(f"--max-tokens must be >= 4, got {max_tokens}")
    if not (0 <= malformed_share and 0 <= disconnect_share and malformed_share + disconnect_share <= 1):
        raise DSparkError("the malformed and disconnect shares must be >= 0 and add up to at most 1")


def long_prompt(i: int, words: int) -> str:
    """A prompt of about `words` words, the same for the same (i, words)."""
    order = list(SENTENCES)
    random.Random(f"long:{i}").shuffle(order)
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        out.append(order[len(out) % len(order)])
    return " ".join(out)


def long_words(context: int, max_tokens: int) -> int:
    """Long prompts take about a quarter of what the context leaves after the output, and at
    most 400 words: English runs at about 1.3 tokens a word and a chat template adds a few
    dozen, so this always fits and is long next to the short prompts."""
    return max(16, min(400, (context - max_tokens) // 4))


def _malformed(model: str, context: int) -> list[tuple[str, str, bytes, int, dict]]:
    """(name, path, body, expected status, extra Call fields): each a mistake a real client makes."""
    ok_chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def js(d: dict) -> bytes:
        return json.dumps(d).encode()

    return [
        ("bad_json", CHAT, b'{"model": "' + model.encode() + b'", "messages": [', 400, {}),
        ("not_an_object", COMPLETIONS, b'["a prompt"]', 400, {}),
        ("max_tokens_string", COMPLETIONS, js({"model": model, "prompt": "hi", "max_tokens": "ten"}), 400, {}),
        (
            "max_tokens_past_context",
            COMPLETIONS,
            js({"model": model, "prompt": "hi", "max_tokens": context + 1}),
            400,
            {},
        ),
        ("temperature_too_high", CHAT, js({**ok_chat, "temperature": 7}), 400, {}),
        ("unknown_model", CHAT, js({**ok_chat, "model": model + "-nope"}), 404, {}),
        ("empty_messages", CHAT, js({**ok_chat, "messages": []}), 400, {}),
        ("bad_role", CHAT, js({**ok_chat, "messages": [{"role": "robot", "content": "hi"}]}), 400, {}),
        ("n_is_3", CHAT, js({**ok_chat, "n": 3}), 400, {}),
        ("logprobs", COMPLETIONS, js({"model": model, "prompt": "hi", "logprobs": 5}), 400, {}),
        ("token_id_outside_vocab", COMPLETIONS, js({"model": model, "prompt": [1 << 40], "max_tokens": 4}), 400, {}),
        (
            "lone_surrogate",
            CHAT,
            b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
            b'"content": "\\ud800"}], "max_tokens": 4}',
            400,
            {},
        ),
        ("text_plain", COMPLETIONS, js({"model": model, "prompt": "hi"}), 415, {"content_type": "text/plain"}),
        ("content_length_1gib", COMPLETIONS, b"{}", 413, {"declared_length": 1 << 30}),
        ("unknown_route", "/v1/embeddings", js({"model": model, "input": "hi"}), 404, {}),
    ]


def make_call(settings: MixSettings, index: int) -> Call:
    """Request `index` of the mix: a pure function of the settings and the index."""
    rng = random.Random(f"{settings.seed}:{index}")
    roll = rng.random()
    if roll < settings.malformed_share:
        name, path, raw, status, extra = rng.choice(_malformed(settings.model, settings.context))
        return Call(index, path, raw, status, f"malformed:{name}", **extra)
    disconnect = roll < settings.malformed_share + settings.disconnect_share
    chat = rng.random() < CHAT_SHARE
    long = rng.random() < LONG_SHARE
    greedy = disconnect or rng.random() < GREEDY_SHARE
    stream = disconnect or rng.random() < STREAM_SHARE
    m = settings.max_tokens
    # a client that leaves mid-stream asks for the most tokens, so that it is still streaming
    max_tokens = m if disconnect else rng.choice((m // 4, m // 2, m))
    if long:
        text = long_prompt(rng.randrange(LONG_PROMPTS), long_words(settings.context, m))
    else:
        text = rng.choice(SHORT_PROMPTS)
    body: dict = {"model": settings.model, "max_tokens": max_tokens}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body.update({"temperature": 0} if greedy else {**SAMPLED, "seed": rng.randrange(1 << 31)})
    solo = json.dumps(body, sort_keys=True)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    label = " ".join(
        w
        for w in (
            "chat" if chat else "completion",
            "stream" if stream else "",
            "greedy" if greedy else "sampled",
            "long" if long else "short",
            "disconnect" if disconnect else "",
        )
        if w
    )
    return Call(
        index,
        CHAT if chat else COMPLETIONS,
        json.dumps(body).encode(),
        None if disconnect else 200,
        label,
        stream=stream,
        greedy_key=solo if greedy and not disconnect else None,
        solo_body=solo.encode() if greedy and not disconnect else None,
    )


# ---- one request ------------------------------------------------------------------------------
@dataclass
class Outcome:
    label: str
    expect: int | None
    status: int | None = None  # None: no HTTP answer (refused connection, timeout, left on purpose)
    text: str = ""
    finish: str | None = None
    tokens: int = 0
    latency: float = 0.0
    ttft: float | None = None  # streamed requests: the first chunk carrying text
    problem: str | None = None  # why it is unexpected; None: it got what it expected
    greedy_key: str | None = None


def send(port: int, call: Call, timeout: float) -> Outcome:
    out = Outcome(call.label, call.expect, greedy_key=call.greedy_key)
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
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


# ---- the server process -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`dspark serve ARGS --host 127.0.0.1 --port PORT` as a child process, its output in a file."""

    def __init__(self, serve_args: list[str], port: int, start_timeout: float):
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="dspark-soak-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "dspark", "serve", *serve_args, "--host", HOST, "--port", str(port)]
        # its own server on 127.0.0.1: a $DSPARK_API_KEY in the environment would make it ask for a key
        env = envs.child_env(drop=("DSPARK_API_KEY",))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DSparkError(f"dspark serve exited {self.proc.returncode} before answering:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DSparkError(f"dspark serve did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")
            try:
                if get_json(self.port, "/health", 2)[0] == 200:
                    return
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.25)

    def rss_bytes(self) -> int | None:
        return rss_bytes(self.proc.pid)

    def log_text(self) -> str:
        return Path(self.log.name).read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, as a supervisor sends it; the exit code (None never: killed after `timeout`)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        self.log.close()
        os.unlink(self.log.name)


def get_json(port: int, path: str, timeout: float) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        raw = resp.read().decode("utf-8", errors="replace")
        return resp.status, (json.loads(raw) if resp.getheader("content-type", "").startswith(JSON_TYPE) else raw)
    finally:
        conn.close()


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process: /proc on Linux, psutil elsewhere when it is installed."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # optional: not a dependency of dspark
    except ImportError:
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


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


# ---- the soak ---------------------------------------------------------------------------------
@dataclass
class SoakSettings:
    concurrency: int = 16
    requests: int | None = 200  # None: as many as `seconds` allows
    seconds: float | None = None
    warmup: int | None = None  # requests before the memory baseline (None: 2 x concurrency)
    max_tokens: int = 32
    malformed_share: float = 0.1
    disconnect_share: float = 0.1
    seed: int = 0
    timeout: float = 300.0  # one request, client side: past it the request counts as hung
    start_timeout: float = 600.0  # the server's load, draft check and cost profile included
    settle_seconds: float = 10.0  # how long the in-flight gauges may take to reach 0 after the load

    def __post_init__(self):
        if self.concurrency < 1:
            raise DSparkError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.requests is None and self.seconds is None:
            raise DSparkError("give --requests, --seconds or both")
        if self.requests is not None and self.requests < 1:
            raise DSparkError(f"--requests must be >= 1, got {self.requests}")
        if self.seconds is not None and self.seconds <= 0:
            raise DSparkError(f"--seconds must be > 0, got {self.seconds}")
        if self.warmup is not None and self.warmup < 0:
            raise DSparkError(f"--warmup must be >= 0, got {self.warmup}")
        check_mix(self.max_tokens, self.malformed_share, self.disconnect_share)  # before the server loads


@dataclass
class SoakReport:
    settings: dict
    model: str
    context: int
    machine: dict = field(default_factory=dict)  # the client's view: CPU, cores, load average before and after
    wall_s: float = 0.0
    sent: int = 0
    served: int = 0  # well-formed requests answered in full
    disconnected: int = 0  # clients that left mid-stream on purpose
    refused_as_expected: dict = field(default_factory=dict)  # status -> malformed requests refused with it
    unexpected: dict = field(default_factory=dict)  # "HTTP 500" / "timeout" / ... -> count
    unexpected_examples: list = field(default_factory=list)
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    completion_tokens: int = 0
    tokens_per_s: float = 0.0
    rss_start_bytes: int | None = None
    rss_end_bytes: int | None = None
    rss_peak_bytes: int | None = None
    greedy_checked: int = 0  # greedy requests compared with the same request decoded alone
    greedy_distinct: int = 0  # distinct greedy requests among them (each decoded alone once)
    greedy_differed: int = 0
    greedy_examples: list = field(default_factory=list)
    gauges_after: dict = field(default_factory=dict)
    server_tracebacks: int = 0  # "Traceback" lines in the server's log
    server_exit_code: int | None = None
    server_log_tail: str | None = None  # only when something went wrong

    @property
    def unexpected_total(self) -> int:
        return sum(self.unexpected.values())

    @property
    def rss_growth(self) -> float | None:
        if not self.rss_start_bytes or self.rss_end_bytes is None:
            return None
        return self.rss_end_bytes / self.rss_start_bytes - 1

    @property
    def passed(self) -> bool:
        return (
            self.unexpected_total == 0
            and self.greedy_differed == 0
            and self.server_tracebacks == 0
            and self.server_exit_code == 0
            and not any(self.gauges_after.values())
        )

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "unexpected_total": self.unexpected_total,
            "rss_growth": self.rss_growth,
            "passed": self.passed,
        }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    """What the figures were measured on; the load average shows whether something else was running."""
    name, flags = cpu_model_and_flags()
    return {
        "cpu": name,
        "avx512_bf16": "avx512_bf16" in flags,
        "cpu_count": os.cpu_count(),
        "load_average_start": load_average(),
    }


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between closest ranks; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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


class _RssSampler:
    """The server's resident memory every `every` seconds while the load runs: its peak."""

    def __init__(self, server: ServerProcess, every: float = 0.5):
        self.server, self.every, self.peak = server, every, server.rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            rss = self.server.rss_bytes()
            if rss is not None:
                self.peak = max(self.peak or 0, rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _calls(mix: MixSettings, start: int, count: int | None):
    i = start
    while count is None or i < start + count:
        yield make_call(mix, i)
        i += 1


def summarize(report: SoakReport, outcomes: list[Outcome]) -> None:
    """Counts, latencies and tokens/s of the soak's outcomes into `report`."""
    report.sent = len(outcomes)
    refused: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    for o in outcomes:
        if o.problem is not None:
            unexpected[f"HTTP {o.status}" if o.status is not None else o.problem.partition(":")[0]] += 1
            if len(report.unexpected_examples) < 10:
                report.unexpected_examples.append({"label": o.label, "status": o.status, "problem": o.problem})
        elif o.expect is None:
            report.disconnected += 1
        elif o.expect == 200:
            report.served += 1
        else:
            refused[str(o.status)] += 1
    report.refused_as_expected, report.unexpected = dict(sorted(refused.items())), dict(unexpected)
    ok = [o for o in outcomes if o.problem is None and o.expect == 200]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    report.latency_p50_s, report.latency_p99_s = (
        percentile([o.latency for o in ok], 0.5),
        percentile([o.latency for o in ok], 0.99),
    )
    report.ttft_p50_s, report.ttft_p99_s = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    report.completion_tokens = sum(o.tokens for o in ok)
    report.tokens_per_s = report.completion_tokens / report.wall_s if report.wall_s > 0 else 0.0


def compare_greedy(
    report: SoakReport, outcomes: list[Outcome], calls_by_key: dict[str, Call], port: int, timeout: float
) -> None:
    """Each distinct greedy request decoded alone (concurrency 1, not streamed) against every
    answer it got in the soak: text and finish reason must be the same."""
    served = [(o.greedy_key, o) for o in outcomes if o.greedy_key is not None and o.problem is None]
    solo: dict[str, Outcome] = {}
    for key in sorted({k for k, _ in served}):
        call = calls_by_key[key]
        if call.solo_body is None:
            raise ValueError(f"greedy call {call.label!r} has no solo body to send alone")
        solo[key] = send(port, Call(-1, call.path, call.solo_body, 200, "solo " + call.label), timeout)
    report.greedy_checked, report.greedy_distinct = len(served), len(solo)
    for key, o in served:
        ref = solo[key]
        if ref.problem is not None or (o.text, o.finish) != (ref.text, ref.finish):
            report.greedy_differed += 1
            if len(report.greedy_examples) < 5:
                report.greedy_examples.append(
                    {"label": o.label, "batched": o.text, "alone": ref.text, "alone_problem": ref.problem}
                )


def wait_idle(port: int, seconds: float) -> dict[str, float]:
    """The in-flight gauges, polled until both read 0 or `seconds` pass (aborts land a step later)."""
    deadline = time.monotonic() + seconds
    while True:
        g = gauges(port)
        if not any(g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.2)


def run_soak(serve_args: list[str], settings: SoakSettings, port: int | None = None, on_phase=None) -> SoakReport:
    """Start `dspark serve SERVE_ARGS` on 127.0.0.1, warm it up, soak it, check it, stop it.

    on_phase(str): told when each phase starts (the command prints it; the library does not)."""
    tell = on_phase or (lambda _msg: None)
    port = port or free_port()
    tell(f"starting dspark serve on {HOST}:{port}")
    server = ServerProcess(serve_args, port, settings.start_timeout)
    try:
        return _soak(server, settings, tell)
    finally:
        server.close()


def _soak(server: ServerProcess, settings: SoakSettings, tell) -> SoakReport:
    port = server.port
    _, models = get_json(port, "/v1/models", 10)
    if not isinstance(models, dict):
        raise RuntimeError(f"/v1/models answered {models[:200]!r}, not JSON")
    card = models["data"][0]
    mix = MixSettings(
        card["id"],
        card["max_model_len"],
        settings.max_tokens,
        settings.malformed_share,
        settings.disconnect_share,
        settings.seed,
    )
    report = SoakReport(asdict(settings), card["id"], card["max_model_len"], machine_info())
    # warm-up: calls from a stream of indexes the soak never uses, so they do not repeat its own
    warm = settings.concurrency * 2 if settings.warmup is None else settings.warmup
    tell(f"warm-up: {warm} requests at concurrency {settings.concurrency}")
    drive(port, _calls(mix, -warm, warm), settings.concurrency, settings.timeout)
    wait_idle(port, settings.settle_seconds)
    report.rss_start_bytes = server.rss_bytes()

    tell(
        f"soak: {settings.requests or 'unbounded'} requests"
        f"{f' / {settings.seconds:g} s' if settings.seconds else ''} at concurrency {settings.concurrency}"
    )
    calls_by_key: dict[str, Call] = {}

    def remembered(calls):
        for c in calls:
            if c.greedy_key is not None:
                calls_by_key.setdefault(c.greedy_key, c)
            yield c

    deadline = time.monotonic() + settings.seconds if settings.seconds else None
    t0 = time.perf_counter()
    with _RssSampler(server) as sampler:
        outcomes = drive(
            port, remembered(_calls(mix, 0, settings.requests)), settings.concurrency, settings.timeout, deadline
        )
    report.wall_s = time.perf_counter() - t0
    report.gauges_after = wait_idle(port, settings.settle_seconds)
    report.rss_end_bytes = server.rss_bytes()
    report.rss_peak_bytes = max(filter(None, (sampler.peak, report.rss_end_bytes)), default=None)
    summarize(report, outcomes)

    tell("greedy outputs: each distinct one decoded alone")
    compare_greedy(report, outcomes, calls_by_key, port, settings.timeout)
    tell("stopping the server (SIGTERM)")
    report.server_exit_code = server.stop()
    report.machine["load_average_end"] = load_average()
    log = server.log_text()
    report.server_tracebacks = log.count("Traceback (most recent call last)")
    if not report.passed:
        report.server_log_tail = server.log_tail()
    return report
