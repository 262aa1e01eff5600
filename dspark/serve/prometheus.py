"""The server's Prometheus metrics, in a registry of their own.

A per-app CollectorRegistry (not prometheus_client's global one) lets one process hold several
apps (tests, embedding) without "duplicated timeseries" errors. The speculative counters are
fed from deltas of the engine's global SpecMetrics after every step, so /metrics and the
engine's own accounting can never drift apart; all writes happen in the worker thread or the
event loop, and prometheus_client's metric objects are thread-safe.

Position labels are 0-based: position 0 is the first drafted token of a block.
The `dspark_spec_*` series count the draft's proposals; `dspark_proposer_*` count every proposer
apart, labelled `proposer="draft"` or `proposer="lookup"` (proposals copied from the request's
own text, engine/lookup.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dspark.engine.metrics import SpecMetrics

# finish reasons of admitted requests, then outcomes of requests refused at the door
STATUSES = ("stop", "length", "aborted", "error", "invalid", "unauthorized", "queue_full")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, gamma: int, lookup: int = 0):
        """gamma: the draft's block size (0: no draft); lookup: the most tokens a lookup proposal
        holds (0: lookup off)."""
        self.registry = r = CollectorRegistry()
        self.gamma = gamma
        self.requests = Counter(
            "dspark_requests",
            "Requests by outcome: finish reason, aborted (client went "
            "away), error (engine failure), or refused (invalid, unauthorized, queue_full)",
            ["status"],
            registry=r,
        )
        for s in STATUSES:
            self.requests.labels(status=s)  # every series exists from the start: rates never see a gap
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(
            "dspark_generation_tokens", "Tokens generated (delivered to requests)", registry=r
        )
        self.verify_steps = Counter(
            "dspark_spec_verify_steps", "Verify steps, counted once per request per step", registry=r
        )
        self.plain_steps = Counter(
            "dspark_spec_plain_steps",
            "Steps decoded without drafting (the adaptive policy "
            "judged the draft pass not worth it), counted once per request per step",
            registry=r,
        )
        self.drafted = Counter("dspark_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.verified = Counter(
            "dspark_spec_verified_tokens", "Draft tokens sent to the target for verification", registry=r
        )
        self.accepted = Counter("dspark_spec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.accepted_pos = Counter(
            "dspark_spec_accepted_per_position",
            "Verify steps whose draft at this 0-based position was accepted (marginal rate = this / verify steps)",
            ["position"],
            registry=r,
        )
        self.reached_pos = Counter(
            "dspark_spec_reached_per_position",
            "Verify steps where this position was verified with all earlier drafts accepted "
            "(conditional rate = accepted_per_position / this)",
            ["position"],
            registry=r,
        )
        for i in range(gamma):
            self.accepted_pos.labels(position=str(i))
            self.reached_pos.labels(position=str(i))
        self.mean_accept_length = Gauge(
            "dspark_spec_mean_acceptance_length",
            "Tokens committed per verify step since start, bonus token included "
            "(0 before the first step or without a draft)",
            registry=r,
        )
        self.step_time = Histogram(
            "dspark_step_seconds", "Wall time of one engine step (admission + decode)", buckets=STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "dspark_step_batch_size", "Requests decoded together in one step", buckets=BATCH_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "dspark_time_to_first_token_seconds",
            "From request received to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("dspark_queue_depth", "Requests accepted but not yet decoding", registry=r)
        self.running = Gauge("dspark_running_requests", "Requests in the decode batch", registry=r)
        self._seen = SpecMetrics(gamma, lookup=SpecMetrics(lookup) if lookup else None)  # totals already exported
        self.proposer_steps = Counter(
            "dspark_proposer_verify_steps",
            "Verify steps by what proposed the tokens, counted once per request per step",
            ["proposer"],
            registry=r,
        )
        self.proposer_tokens = Counter(
            "dspark_proposer_tokens",
            "Proposed tokens by proposer and stage: proposed, verified (sent to the target), accepted",
            ["proposer", "stage"],
            registry=r,
        )
        self.proposer_accepted_pos = Counter(
            "dspark_proposer_accepted_per_position",
            "Verify steps whose proposal at this 0-based position was accepted, by proposer",
            ["proposer", "position"],
            registry=r,
        )
        self.proposer_reached_pos = Counter(
            "dspark_proposer_reached_per_position",
            "Verify steps where this position was verified with all earlier proposed tokens accepted, by proposer",
            ["proposer", "position"],
            registry=r,
        )
        self._proposers = [("draft", gamma)] * (gamma > 0) + [("lookup", lookup)] * (lookup > 0)
        for name, width in self._proposers:
            self.proposer_steps.labels(proposer=name)
            for stage in ("proposed", "verified", "accepted"):
                self.proposer_tokens.labels(proposer=name, stage=stage)
            for i in range(width):
                self.proposer_accepted_pos.labels(proposer=name, position=str(i))
                self.proposer_reached_pos.labels(proposer=name, position=str(i))

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def engine_step(self, m: SpecMetrics, seconds: float, batch: int) -> None:
        """After each step: export what the engine's global counters gained since the last call."""
        self.step_time.observe(seconds)
        if batch:
            self.batch_size.observe(batch)
        s = self._seen
        if self.gamma:  # the draft's series by proposer: before the ones below move _seen on
            self._proposer_step("draft", m, s)
        if s.lookup is not None and m.lookup is not None:
            self._proposer_step("lookup", m.lookup, s.lookup)
            self._advance(s.lookup, m.lookup)
        self.verify_steps.inc(m.steps - s.steps)
        self.plain_steps.inc(m.plain_steps - s.plain_steps)
        self.drafted.inc(m.drafted - s.drafted)
        self.verified.inc(m.verified - s.verified)
        self.accepted.inc(m.accepted - s.accepted)
        for i in range(self.gamma):
            self.accepted_pos.labels(position=str(i)).inc(m.accepted_at[i] - s.accepted_at[i])
            self.reached_pos.labels(position=str(i)).inc(m.reached[i] - s.reached[i])
        self.mean_accept_length.set(m.mean_accept_length)
        self._advance(s, m)
        s.plain_steps = m.plain_steps

    def _proposer_step(self, name: str, m: SpecMetrics, s: SpecMetrics) -> None:
        self.proposer_steps.labels(proposer=name).inc(m.steps - s.steps)
        for stage, now, was in (
            ("proposed", m.drafted, s.drafted),
            ("verified", m.verified, s.verified),
            ("accepted", m.accepted, s.accepted),
        ):
            self.proposer_tokens.labels(proposer=name, stage=stage).inc(now - was)
        for i in range(m.gamma):
            self.proposer_accepted_pos.labels(proposer=name, position=str(i)).inc(m.accepted_at[i] - s.accepted_at[i])
            self.proposer_reached_pos.labels(proposer=name, position=str(i)).inc(m.reached[i] - s.reached[i])

    @staticmethod
    def _advance(s: SpecMetrics, m: SpecMetrics) -> None:
        s.steps, s.drafted, s.verified, s.accepted = m.steps, m.drafted, m.verified, m.accepted
        s.accepted_at, s.reached = list(m.accepted_at), list(m.reached)

    def render(self) -> bytes:
        return generate_latest(self.registry)
