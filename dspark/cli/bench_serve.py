"""`dspark bench-serve`: a soak of `dspark serve` (dspark.bench.soak): the server as a process on
127.0.0.1, a bounded mix of requests, and what it held. Exit 0 when the soak passed, 1 when not."""

from __future__ import annotations

import argparse
import json
import sys

from dspark.bench.soak import SoakReport, SoakSettings, run_soak
from dspark.cli.engine_flags import add_engine_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)  # handed to `dspark serve` as given
    g = p.add_argument_group("soak")
    g.add_argument("--concurrency", type=int, default=16, help="clients in flight at once (default 16)")
    g.add_argument("--requests", type=int, default=None, help="requests to send (default 200 unless --seconds)")
    g.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="stop starting requests after this long (with --requests: whichever comes first)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests before the memory baseline, not counted (default 2 x concurrency)",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="the longest output asked for; requests ask for a quarter, a half or all of it (default 32)",
    )
    g.add_argument("--malformed", type=float, default=0.1, help="share of malformed requests (default 0.1)")
    g.add_argument(
        "--disconnect", type=float, default=0.1, help="share of clients that disconnect mid-stream (default 0.1)"
    )
    g.add_argument("--seed", type=int, default=0, help="the mix (same seed, same requests)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take before it counts as hung")
    g.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    g.add_argument("--max-queue", type=int, default=None, help="the server's --max-queue (default: its own)")
    g.add_argument("--json", action="store_true", help="print the report as JSON")


def serve_args(args: argparse.Namespace) -> list[str]:
    """The engine flags of this command line as `dspark serve` flags: every one that differs from
    its default, read from the shared definition so that a new engine flag travels too."""
    reference = argparse.ArgumentParser(add_help=False)
    add_engine_flags(reference)
    out = []
    for action in reference._actions:  # argparse keeps no public list of a parser's options
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        out += [flag] if action.nargs == 0 else [flag, str(value)]
    if args.max_queue is not None:
        out += ["--max-queue", str(args.max_queue)]
    return out + ["--log-level", "warning"]


def settings(args: argparse.Namespace) -> SoakSettings:
    requests = args.requests if args.requests is not None or args.seconds is not None else 200
    return SoakSettings(
        concurrency=args.concurrency,
        requests=requests,
        seconds=args.seconds,
        warmup=args.warmup,
        max_tokens=args.max_tokens,
        malformed_share=args.malformed,
        disconnect_share=args.disconnect,
        seed=args.seed,
        timeout=args.timeout,
    )


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def text(r: SoakReport) -> str:
    growth = r.rss_growth
    m = r.machine
    lines = [
        f"CPU {m.get('cpu')} ({m.get('cpu_count')} cores, avx512_bf16 {'yes' if m.get('avx512_bf16') else 'no'}), "
        f"load average {m.get('load_average_start')} before, {m.get('load_average_end')} after",
        f"model {r.model!r} (context {r.context}), concurrency {r.settings['concurrency']}, {r.sent} requests "
        f"in {r.wall_s:.1f} s",
        f"served {r.served}   disconnected mid-stream (on purpose) {r.disconnected}   "
        f"malformed refused as expected {sum(r.refused_as_expected.values())} "
        f"{json.dumps(r.refused_as_expected)}",
        f"unexpected errors {r.unexpected_total} {json.dumps(r.unexpected) if r.unexpected else ''}",
        f"latency p50 {_s(r.latency_p50_s)}  p99 {_s(r.latency_p99_s)}   time to first token (streamed) "
        f"p50 {_s(r.ttft_p50_s)}  p99 {_s(r.ttft_p99_s)}",
        f"short requests while a long prompt prefilled: {r.short_beside_huge}, latency p50 "
        f"{_s(r.short_beside_huge_p50_s)}  p99 {_s(r.short_beside_huge_p99_s)}",
        f"tokens/s {r.tokens_per_s:.1f} ({r.completion_tokens} completion tokens)",
        f"resident memory of the server: start {_mib(r.rss_start_bytes)} (after warm-up), end "
        f"{_mib(r.rss_end_bytes)}, peak {_mib(r.rss_peak_bytes)}"
        + ("" if growth is None else f", end/start {growth:+.1%}"),
        f"greedy outputs that differed from the same request decoded alone: {r.greedy_differed} "
        f"of {r.greedy_checked} ({r.greedy_distinct} distinct requests)",
        f"in flight after the load: {json.dumps(r.gauges_after)}   tracebacks in the server log: "
        f"{r.server_tracebacks}   server exit code after SIGTERM: {r.server_exit_code}",
    ]
    for ex in r.unexpected_examples:
        lines.append(f"  unexpected: {ex['label']}: {ex['problem']}")
    for ex in r.greedy_examples:
        lines.append(f"  differed: {ex['label']}: batched {ex['batched']!r} alone {ex['alone']!r}")
    if r.server_log_tail:
        lines += ["server log (last lines):", r.server_log_tail]
    lines.append("PASSED" if r.passed else "FAILED")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    chosen = settings(args)  # a bad setting is refused before the server loads
    report = run_soak(
        serve_args(args),
        chosen,
        port=args.port or None,
        on_phase=None if args.json else lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else text(report))
    return 0 if report.passed else 1
