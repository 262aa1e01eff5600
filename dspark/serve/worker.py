"""The one thread that owns the Engine.

The Engine (and the tokenizer it calls) is not thread-safe, so every touch of it happens
here: HTTP handlers put commands ("add", "abort") on a thread-safe queue, and this thread
drains the queue between steps, admits, steps and hands results back to each request's
asyncio.Queue through loop.call_soon_threadsafe. Prompts arrive tokenized and checked against
the context already (prompts.py): a long prompt never holds up the batch. Each request has
its own queue and events are keyed by the engine request id, so tokens cannot cross between
requests.

Admission control: at most max_batch + max_queue requests are in flight (decoding or
waiting); one more is refused with 429 at once rather than left to wait unboundedly.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark.engine.marks import TextPieces
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError
from dspark.serve.prometheus import ServerMetrics
from dspark.serve.protocol import APIError, GenRequest, bad, usage

if TYPE_CHECKING:
    from dspark.engine.request import Request

log = logging.getLogger("dspark")


# ---- events handed to the event loop --------------------------------------------------------
@dataclass
class Admitted:
    prompt_tokens: int


@dataclass
class Delta:
    text: str
    marks: list[dict] | None = None  # the tokens behind `text` (requests that asked for marks)


@dataclass
class Done:
    finish_reason: str
    text: str  # the whole completion
    tail: str  # what the Delta events did not carry yet
    usage: dict
    spec: dict | None  # per-request speculative statistics; None without a draft
    tail_marks: list[dict] | None = None  # the tokens behind `tail`
    marks: list[dict] | None = None  # every token's mark (non-streamed requests that asked for marks)


@dataclass
class Failed:
    error: APIError


class Job:
    """One HTTP generation request as the worker sees it."""

    def __init__(
        self,
        req: GenRequest,
        loop: asyncio.AbstractEventLoop,
        t_received: float,
        prompt_ids: list[int],
        max_tokens: int,
    ):
        self.req, self.loop, self.t_received = req, loop, t_received
        self.prompt_ids, self.max_tokens = prompt_ids, max_tokens  # tokenized and fitted to the context
        self.id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self.settled = False  # loop side: no abort needed (outcome delivered, or abort already sent)
        # worker side
        self.engine_req: Request | None = None
        self.in_flight = False  # counts against the admission limit until closed
        self.closed = False
        self.started = False
        self.sent = ""  # the text already handed out as Delta events
        self.pieces = TextPieces() if req.marks else None
        # every mark so far, for a non-streamed body (a stream has handed them out already)
        self.marks: list[dict] | None = [] if req.marks and not req.stream else None

    @property
    def request(self) -> Request:
        """The engine's request of an admitted job (every job in the worker's table is one)."""
        if self.engine_req is None:
            raise RuntimeError(f"{self.id} was never admitted to the engine")
        return self.engine_req

    def push(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody is listening
            pass


_STOP = ("stop", None)
DRAIN_TIMEOUT_PASSED = "the server is shutting down (its drain timeout passed)"
RATE_WINDOW_S = 10.0  # tokens/s in the stats: over the steps of the last this many seconds
STATS_EVERY_S = 0.25  # the stats snapshot is refreshed at most this often (the policy line costs a little)


class EngineWorker:
    def __init__(self, engine, metrics: ServerMetrics, max_queue: int):
        if max_queue < 0:
            raise DSparkError(f"max_queue must be >= 0, got {max_queue}")
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.capacity = engine.max_batch + max_queue
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._running = 0
        self.draining = False  # set on SIGTERM: new requests are refused, those in flight go on
        self._cut: str | None = None  # worker thread: why every request was ended (cut), if it was
        self.submitted = 0  # jobs ever handed to this thread (tests: what was refused before reaching it)
        self._jobs: dict[str, Job] = {}  # worker thread only
        self._thread: threading.Thread | None = None
        self._generated = 0  # tokens delivered, for the stats' rate
        self._rate: collections.deque = collections.deque()  # (time, tokens generated so far) per step
        self._stats_at = 0.0
        self.stats = self._snapshot()  # replaced whole by the worker thread: readers never see it half made
        metrics.queue_depth.set_function(lambda: max(0, self._in_flight - self._running))
        metrics.running.set_function(lambda: self._running)

    # ---- called from the event loop ----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._cmds.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self) -> None:
        """Stop admitting (a shutdown began): new requests get a 503, those in flight go on."""
        self.draining = True

    def cut(self, why: str = DRAIN_TIMEOUT_PASSED) -> None:
        """The drain timeout passed, or a second signal forced the stop: every request still in
        flight ends with a clean 503 saying `why` (a stream: an error event, then [DONE])."""
        self._cmds.put(("cut", why))

    def submit(self, job: Job) -> None:
        """Queue a job for admission, or raise 429 when max_batch + max_queue are in flight."""
        if not self.alive:
            raise APIError(503, "the engine thread is not running")
        if self.draining:
            raise APIError(503, "the server is shutting down: retry shortly", None, code="shutting_down")
        with self._lock:
            if self._in_flight >= self.capacity:
                raise APIError(
                    429,
                    f"the server is at capacity: {self._in_flight} requests in flight "
                    f"({self.engine.max_batch} decoding + a queue of {self.max_queue}); retry later",
                    None,
                    type_="rate_limit_error",
                    code="queue_full",
                )
            self._in_flight += 1
            self.submitted += 1
            job.in_flight = True
        self._cmds.put(("add", job))

    def abort(self, job: Job) -> None:
        self._cmds.put(("abort", job))

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except Exception:  # the thread must outlive any bug: a dead worker hangs every request
                log.exception(
                    "dspark serve: worker iteration failed; failing the requests in flight: %s",
                    ", ".join(self._jobs) or "none",
                )
                self._engine_failed()

    def _iteration(self) -> bool:
        """Drain commands (blocking only when idle), then one engine step. False: stop."""
        cmds = [self._cmds.get()] if not self.engine.has_work() else []
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                break
        for kind, job in cmds:
            if kind == "stop":
                self._shutdown()
                return False
            if kind == "cut":
                self._cut = job  # the reason: a request admitted after the cut ends with it too
                self._fail_all(job, 503)
                continue
            try:
                self._add(job) if kind == "add" else self._abort(job)
            except Exception:  # a bug in admission must cost one request, not the batch
                log.exception("dspark serve: %s of %s failed", kind, job.id)
                self._fail([job], "admission failed")
        if self.engine.has_work():
            self._step()
        return True

    def _add(self, job: Job) -> None:
        if self._cut is not None:  # submitted just before the drain began, queued behind the cut
            return self._fail([job], self._cut, 503)
        req, ids = job.req, job.prompt_ids
        try:
            params = SamplingParams(
                max_new_tokens=job.max_tokens,
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                seed=req.seed,
                stop=req.stop,
            )
            job.engine_req = self.engine.add_request(
                ids, params, on_tokens=self._on_tokens, request_id=job.id, marks=req.marks
            )
        except DSparkError as err:  # RequestError: the engine's own checks, a backstop to prompts.py's
            return self._reject(job, bad(req.prompt_param, str(err)))
        self._jobs[job.id] = job
        self.metrics.prompt_tokens.inc(len(ids))
        job.push(Admitted(len(ids)))

    def _reject(self, job: Job, err: APIError) -> None:
        err.counted = True
        self.metrics.count("invalid")
        self._close(job)
        job.push(Failed(err))

    def _close(self, job: Job) -> None:
        job.closed = True
        self._jobs.pop(job.id, None)
        if job.in_flight:
            job.in_flight = False
            with self._lock:
                self._in_flight -= 1

    def _on_tokens(self, r, new: list[int]) -> None:
        """Engine callback (this thread), right after tokens are committed to request r."""
        job = self._jobs.get(r.id)
        if job is None:
            return
        if not job.started:
            job.started = True
            self.metrics.ttft.observe(time.perf_counter() - job.t_received)
        self.metrics.generation_tokens.inc(len(new))
        self._generated += len(new)
        if r.finished:
            return  # _finish hands out the rest, cut at the stop string
        if job.pieces is not None:
            marks = self._take_marks(job)
            delta = "".join(m["text"] for m in marks)
            if delta or marks:
                job.sent += delta
                job.push(Delta(delta, marks))
            return
        text = r.stream_text()  # the engine's incremental detokenizer (a stop string's start held back)
        if len(text) > len(job.sent):
            delta = text[len(job.sent) :]
            job.sent += delta
            job.push(Delta(delta))

    def _take_marks(self, job: Job) -> list[dict]:
        """The marks of job's tokens committed since the last call, as the wire carries them."""
        out = []
        if job.pieces is None:
            raise RuntimeError(f"{job.id} asked for no marks")
        for m in job.pieces.take(job.request):
            d = m.to_dict()
            if m.draft is not None:  # what the draft had written where the target corrected it
                d["draft_text"] = self.engine.decode([m.draft])
            out.append(d)
        if job.marks is not None:
            job.marks.extend(out)
        return out

    def _step(self) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        try:
            finished = eng.step()
        except Exception:
            # the ids let the 500s that name them be found here (their bodies carry no details)
            log.exception(
                "dspark serve: engine step failed; failing the requests in flight: %s", ", ".join(self._jobs) or "none"
            )
            self._engine_failed()
            return
        seconds = time.perf_counter() - t0
        self._running = len(eng.running)
        # decoded this step: those still running plus those it finished (prefill-only finishes are not returned)
        self.metrics.engine_step(eng.metrics, seconds, len(eng.running) + len(finished))
        done = [j for j in self._jobs.values() if j.request.finished]
        now = time.perf_counter()
        self._rate.append((now, self._generated))
        while now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        # before the answers go out: a client that reads the stats on its answer sees its own steps
        if done or now - self._stats_at >= STATS_EVERY_S or not eng.has_work():
            self._stats_at = now
            self.stats = self._snapshot()
        for job in done:
            self._finish(job)

    def _snapshot(self) -> dict:
        """What the page shows live: the engine's speculative counters, tokens/s over the last
        RATE_WINDOW_S, and the verification policy's own line on why it drafts or not."""
        eng, m = self.engine, self.engine.metrics
        rate = 0.0
        if len(self._rate) > 1 and self._rate[-1][0] > self._rate[0][0]:
            (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
            rate = (n1 - n0) / (t1 - t0)
        summary = getattr(eng.policy, "summary", None)
        steps = m.steps + m.plain_steps
        return {
            "speculative": eng.speculative,
            "policy": eng.policy.name,
            "policy_line": summary(max(1, len(eng.running))) if summary is not None and eng.draft is not None else None,
            "gamma": m.gamma,
            "verify_steps": m.steps,
            "plain_steps": m.plain_steps,
            "drafted_share": round(m.steps / steps, 4) if steps else None,
            "mean_accept_length": round(m.mean_accept_length, 4),
            "conditional_accept_rates": [round(x, 4) for x in m.conditional],
            "marginal_accept_rates": [round(x, 4) for x in m.marginal],
            # the lookup proposer's own verifications (None: lookup off): steps, tokens, per position
            "lookup": m.to_dict()["lookup"] if m.lookup is not None else None,
            "generated_tokens": self._generated,
            "tokens_per_s": round(rate, 2),
            "rate_at": self._rate[-1][0] if self._rate else None,
            "running": len(eng.running),
            "in_flight": self._in_flight,
        }

    def _finish(self, job: Job) -> None:
        r = job.request
        if r.finish_reason == "error":  # this request alone failed (engine.Engine._recover); the batch goes on
            return self._fail([job], r.error or "internal error in the engine")
        self._close(job)
        if r.finish_reason == "abort":
            self.metrics.count("aborted")
            return
        text = r.text if r.text is not None else self.engine.decode(r.output_ids)
        if not text.startswith(job.sent):
            log.warning("dspark serve: %s: streamed text is not a prefix of the final text (detokenizer)", job.id)
        reason = r.finish_reason
        if reason is None:
            raise RuntimeError(f"{job.id} is not finished")
        assert r.metrics is not None  # add_request gives every request its metrics
        spec = r.metrics.to_dict() if self.engine.speculative else None
        tail_marks = self._take_marks(job) if job.pieces is not None else None
        self.metrics.count(reason)  # before the client can see the answer: /metrics never lags it
        job.push(
            Done(
                reason,
                text,
                text[len(job.sent) :],
                usage(len(r.prompt_ids), len(r.output_ids)),
                spec,
                tail_marks,
                job.marks,
            )
        )

    def _abort(self, job: Job) -> None:
        if job.closed or job.engine_req is None:
            return
        self.engine.abort(job.engine_req)
        self._running = len(self.engine.running)
        self._finish(job)

    def _fail(self, jobs: list[Job], why: str, status: int = 500) -> None:
        """why: a fixed phrase. The exception behind a failure is in the log only: its text can
        hold server internals or another request's input."""
        for job in jobs:
            if job.closed:
                continue
            self._close(job)
            self.metrics.count("error")
            where = f" (request {job.id}; the server log has the details)" if status == 500 else ""
            err = APIError(status, f"generation failed: {why}{where}")
            err.counted = True
            job.push(Failed(err))

    def _empty_engine(self) -> None:
        # After an exception mid-step the batch state is unknown: start from an empty engine
        # rather than risk committing one request's cache rows to another.
        self.engine.reset()
        self._running = 0

    def _fail_all(self, why: str, status: int = 500) -> None:
        """Every request in flight ends with `why`, from an empty engine."""
        self._empty_engine()
        self._fail(list(self._jobs.values()), why, status)

    def _engine_failed(self) -> None:
        self._fail_all("internal error in the engine")

    def _shutdown(self) -> None:
        self._fail_all("the server is shutting down", 503)
