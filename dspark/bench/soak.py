"""A soak of `dspark serve`: the server as a process on 127.0.0.1, a bounded mix of requests at a
fixed concurrency, and the figures a deployment asks about (docs/RELIABILITY.md).

The mix is a pure function of (seed, index), so a run can be repeated exactly and a `--seconds`
run draws as many requests as it has time for. Every request of the mix says what answer it
expects: 200 for a well-formed one, the exact 4xx for a malformed one; a client that
disconnects mid-stream expects nothing. Anything else is an unexpected error: a 5xx, a 4xx to a
well-formed request, a stream cut short or carrying an error event, a timeout.

Greedy requests are checked token for token: after the soak, each distinct greedy request is
sent again alone (concurrency 1, not streamed) and its text must equal what it got in the batch.

The soak runs here; its pieces beside it: the request mix (soak_mix.py), the client
(soak_client.py), the server process (soak_server.py), the report (soak_report.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from dspark.bench.soak_client import HOST, Outcome, drive, gauges, get_json, send
from dspark.bench.soak_mix import Call, MixSettings, check_mix, numbered_calls
from dspark.bench.soak_report import SoakReport, load_average, machine_info, summarize
from dspark.bench.soak_server import RssSampler, ServerProcess, free_port
from dspark.errors import DSparkError


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
    drive(port, numbered_calls(mix, -warm, warm), settings.concurrency, settings.timeout)
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
    with RssSampler(server) as sampler:
        outcomes = drive(
            port,
            remembered(numbered_calls(mix, 0, settings.requests)),
            settings.concurrency,
            settings.timeout,
            deadline,
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
