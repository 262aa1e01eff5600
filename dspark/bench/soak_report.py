"""What a soak reports: its counts by outcome, latency and time-to-first-token percentiles, tokens/s,
memory, greedy outputs changed by batching, the machine it ran on, and whether it passed."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field

from dspark.bench.soak_client import Outcome
from dspark.target.load import cpu_model_and_flags


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
    # short requests that overlapped a huge prompt's prefill (sent before its first token came):
    # what chunked prefill promises them (docs/RELIABILITY.md)
    short_beside_huge: int = 0
    short_beside_huge_p50_s: float | None = None
    short_beside_huge_p99_s: float | None = None
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


def beside_huge(ok: list[Outcome]) -> list[float]:
    """Latencies of the short requests that ran while a huge prompt was prefilling: sent before the
    huge request's first token (its first streamed chunk, else its answer) and answered after it
    was sent."""
    spans = [(o.start, o.start + (o.ttft if o.ttft is not None else o.latency)) for o in ok if "huge" in o.label]
    return [
        o.latency
        for o in ok
        if "short" in o.label and any(o.start < end and o.start + o.latency > start for start, end in spans)
    ]


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
    beside = beside_huge(ok)
    report.short_beside_huge = len(beside)
    report.short_beside_huge_p50_s = percentile(beside, 0.5)
    report.short_beside_huge_p99_s = percentile(beside, 0.99)
    report.completion_tokens = sum(o.tokens for o in ok)
    report.tokens_per_s = report.completion_tokens / report.wall_s if report.wall_s > 0 else 0.0
