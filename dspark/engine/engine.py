"""Requests in, tokens out: admission (prefill), the loop that calls decode_step, stops.

Requests join between steps (their own prefill, then merged into the batch) and leave as
soon as they finish. Each request samples from its own seeded generator, so its tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from dspark.engine.adaptive import DraftPrior
from dspark.engine.batch import Batch, StepResult, merged
from dspark.engine.detok import Detokenizer
from dspark.engine.drafting import flush_context
from dspark.engine.lookup import LOOKUP_MAX, LookupIndex, LookupProposer
from dspark.engine.marks import TokenMark, step_marks
from dspark.engine.metrics import SpecMetrics, degraded
from dspark.engine.policy import FullScheduler, VerifyPolicy
from dspark.engine.request import Prefilling, Request, StepObserver, request_metrics
from dspark.engine.sampling import SamplingParams, sample_token
from dspark.engine.step import decode_step, draft_taps
from dspark.errors import DSparkError, RequestError
from dspark.model import fast
from dspark.model.draft import ContextCache, DSparkDraft
from dspark.ops import argmax
from dspark.target.base import Target, replay
from dspark.target.text import encode_prompt

log = logging.getLogger("dspark")

# Prompt tokens prefilled per engine step: a longer prompt is prefilled in chunks of this many,
# one chunk a step between the decode steps of the running requests, so a long prompt delays
# them by one chunk's time a step instead of its whole prefill (docs/DESIGN.md §11).
PREFILL_CHUNK = 256


class Engine:
    def __init__(
        self,
        target: Target,
        draft: DSparkDraft | None = None,
        tokenizer=None,
        eos_token_ids: tuple[int, ...] = (),
        policy: VerifyPolicy | None = None,
        max_batch: int = 16,
        lookup: LookupProposer | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        if prefill_chunk < 1:
            raise DSparkError(f"the prefill chunk must be >= 1 prompt token a step, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        # proposals from the request's own text beside the draft's (engine/lookup.py); None: off
        self.lookup = lookup
        self.eos_token_ids = tuple(eos_token_ids)
        self.policy = policy if policy is not None else FullScheduler()
        self.max_batch = max_batch
        self.gamma = draft.spec.gamma if draft is not None else 0
        if draft is not None:
            target.set_taps(draft.spec.hidden_state_indices)
        # the drafting phase on dspark's compiled call or the draft's modules, chosen here once
        self.draft_kernels = draft is not None and fast.why_not(draft) is None
        self.metrics = self.newrequest_metrics()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.prefilling: list[Prefilling] = []  # admitted, prompt longer than a chunk, not yet decoding
        self.batch: Batch | None = None
        self._warned = False
        # Called after the policy, after every decode step (StepObserver).
        self.observers: list[StepObserver] = []
        # Set by dspark.api.build_engine: the resolved EngineConfig, lines for the user about it, and
        # what the load-time check measured about the draft (scheduler.DraftPrior, or None)
        # (dspark.api.EngineConfig, not named here: dspark.api imports this module and circles are refused)
        self.config: Any = None
        self.notes: list[str] = []
        self.prior: DraftPrior | None = None

    @property
    def speculative(self) -> bool:
        """Whether a proposer runs: the draft, the lookup, or both (--no-draft: the lookup alone)."""
        return self.draft is not None or self.lookup is not None

    def newrequest_metrics(self) -> SpecMetrics:
        """Counters for this engine's proposers: the draft's, and the lookup's when it proposes."""
        return SpecMetrics(self.gamma, lookup=SpecMetrics(self.lookup.limit) if self.lookup is not None else None)

    def derive(
        self,
        *,
        speculative: bool = True,
        policy: VerifyPolicy | None = None,
        max_batch: int | None = None,
        lookup: bool | None = None,
    ) -> Engine:
        """Another engine over the same loaded target and draft: nothing is loaded twice, the new
        engine has its own requests and metrics. speculative=False: the plain-decoding twin (a
        target view without taps, so it pays for nothing a draft would read; no lookup either).
        policy: the new engine's verification policy, default full (policies keep running state:
        never shared). lookup: whether it proposes from the text too (None: as this engine does,
        when speculative); its statistics start afresh."""
        draft = self.draft if speculative else None
        target = self.target if draft is not None else self.target.view()
        use_lookup = speculative and (self.lookup is not None if lookup is None else lookup)
        proposer = LookupProposer(self.lookup.limit if self.lookup is not None else LOOKUP_MAX) if use_lookup else None
        mb, chunk = max_batch or self.max_batch, self.prefill_chunk
        other = Engine(target, draft, self.tokenizer, self.eos_token_ids, policy, mb, proposer, chunk)
        if proposer is not None and other.policy.curve is None:
            # the lookup prices its proposals with the target's cost curve: the one this engine has
            if self.policy.curve is None:
                raise DSparkError("the lookup proposer needs the target's cost curve, and this engine has none")
            other.policy.curve = self.policy.curve
        other.prior = self.prior if draft is not None else None
        return other

    # ---- text ------------------------------------------------------------------------------
    def encode(self, prompt, chat: bool = False) -> list[int]:
        """A string (or with chat a list of {role, content} messages) -> token ids."""
        if self.tokenizer is None:
            raise DSparkError("this target has no tokenizer: pass token ids")
        return encode_prompt(self.tokenizer, prompt, chat)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- admission -----------------------------------------------------------------------
    def room(self, prompt_len: int) -> int:
        """The admission rule: how many new tokens fit after a prompt of prompt_len tokens. The
        target's context must also hold one draft block beyond the last committed token (a verify
        forward runs anchor + gamma drafts)."""
        return self.target.max_length - prompt_len - (self.gamma + 1)

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens=None, request_id=None, marks: bool = False
    ) -> Request:
        """Queue a request. marks: record where each output token came from (Request.marks)."""
        if not prompt_ids:
            raise RequestError("prompt is empty")
        if params.max_new_tokens > self.room(len(prompt_ids)):
            block = (
                f" + one draft block ({self.gamma + 1} positions a verify needs)"
                if self.gamma and len(prompt_ids) + params.max_new_tokens <= self.target.max_length
                else ""
            )
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}){block} exceeds the "
                f"target's context of {self.target.max_length} tokens"
            )
        if max(prompt_ids) >= self.target.vocab_size or min(prompt_ids) < 0:
            raise RequestError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        req = Request(list(prompt_ids), params, on_tokens)
        if request_id is not None:
            req.id = request_id
        req.metrics = self.newrequest_metrics()
        if marks:
            req.marks = []
        if self.tokenizer is not None:
            req.detok = Detokenizer(self.tokenizer, params.stop)
        self.waiting.append(req)
        return req

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        return gen

    @torch.inference_mode()
    def _prefill_chunk(self, job: Prefilling) -> torch.Tensor:
        """Run the next chunk of a request's prompt through the target and commit it; -> the logits
        of its last position [1, 1, V] (the head on that position only)."""
        dev = self.target.device
        ids = job.req.prompt_ids[job.done : job.done + self.prefill_chunk]
        logits, taps = self.target.forward_last(job.state, torch.tensor([ids], device=dev))
        self.target.commit(job.state, torch.tensor([len(ids)], device=dev))
        job.done += len(ids)
        if self.draft is not None:
            job.taps.append(draft_taps(taps))
        return logits

    @torch.inference_mode()
    def _prefill(self, req: Request) -> Batch:
        """A prompt that fits one chunk, prefilled at once."""
        job = Prefilling(req, self.target.new_state(1))
        logits = self._prefill_chunk(job)
        return self._first_token(job, logits)

    @torch.inference_mode()
    def _first_token(self, job: Prefilling, logits: torch.Tensor) -> Batch:
        """After a request's whole prompt is committed: its first token and its one-row batch."""
        req, state, dev = job.req, job.state, self.target.device
        ctx, pending = None, []
        if self.draft is not None:
            ctx = self.draft.new_context_cache(1, dev, kernels=self.draft_kernels)
            # the prompt's taps wait like a skipped step's (flush_context): a request that never
            # drafts never pays the draft's context update
            pending = job.taps
        gen = self._generator(req.params)
        last = logits[0, -1]
        first = int(argmax(last)) if req.params.greedy else sample_token(last, req.params, gen)
        batch = Batch(state, ctx, torch.tensor([first], device=dev), [req.params], [gen], pending)
        if self.lookup is not None:
            batch.lookup = [LookupIndex(req.prompt_ids + [first])]
        req.t_first_token = time.perf_counter()
        self._emit(req, [first], [TokenMark(first, "plain", 0, 0)] if req.marks is not None else None)
        return batch

    def _admit(self) -> list[Request]:
        """Prefill waiting requests into the batch (a prompt longer than a chunk starts prefilling
        chunk by chunk instead); returns those that failed (each its own)."""
        failed = []
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            req = self.waiting.pop(0)
            if len(req.prompt_ids) > self.prefill_chunk:
                self.prefilling.append(Prefilling(req, self.target.new_state(1)))
                continue
            try:
                one = self._prefill(req)
            except Exception as err:  # its own prefill: nothing else was touched
                self._fail(req, err, "prefill")
                failed.append(req)
                continue
            if req.finished:
                continue
            self._join(req, one)
        return failed

    def _join(self, req: Request, one: Batch) -> None:
        self.running.append(req)
        self.batch = one if self.batch is None else self._merge(self.batch, one)

    def _prefill_step(self) -> list[Request]:
        """One chunk of the oldest prompt being prefilled; a prompt whose last chunk this was joins
        the running batch. Returns the request if it finished (failed, or stopped at its first token)."""
        if not self.prefilling:
            return []
        job = self.prefilling[0]
        try:
            logits = self._prefill_chunk(job)
            if job.done < len(job.req.prompt_ids):
                return []
            self.prefilling.pop(0)
            one = self._first_token(job, logits)
        except Exception as err:  # its own prefill: nothing else was touched
            if self.prefilling and self.prefilling[0] is job:
                self.prefilling.pop(0)
            self._fail(job.req, err, "prefill")
            return [job.req]
        if job.req.finished:
            return [job.req]
        self._join(job.req, one)
        return []

    @torch.inference_mode()
    def _resume(self, req: Request, gen: torch.Generator | None) -> Batch:
        """A one-row batch for a request that has output: its prompt and output but the last token
        run through the target again (`replay`: as prefill and decoding computed them), the last token
        its anchor, its own generator (as before the step that failed): decoding goes on as it would have."""
        dev = self.target.device
        state, taps = replay(self.target, req.prompt_ids, req.output_ids[:-1], self.prefill_chunk)
        ctx = self.draft.new_context_cache(1, dev, kernels=self.draft_kernels) if self.draft is not None else None
        return Batch(
            state,
            ctx,
            torch.tensor([req.output_ids[-1]], device=dev),
            [req.params],
            [gen],
            [draft_taps(taps)] if self.draft is not None else [],
            lookup=[LookupIndex(req.prompt_ids + req.output_ids)] if self.lookup is not None else None,
        )

    def _fail(self, req: Request, err: BaseException, where: str) -> None:
        log.error(
            "dspark: request %s failed in its %s: %s: %s",
            req.id,
            where,
            type(err).__name__,
            err,
            exc_info=not isinstance(err, DSparkError),
        )
        req.finish_reason = "error"
        req.error = str(err) if isinstance(err, DSparkError) else f"internal error in the {where}"
        req.t_finish = time.perf_counter()

    def _recover(self, err: Exception, states: list) -> list[Request]:
        """After a decode step raised: the batch state is suspect, the requests are not. Each is
        rebuilt alone from its tokens (generators as before the step) and steps once alone;
        those that fail alone (or that the error names) end with "error", the others go on as
        if nothing happened. Returns the requests this finished."""
        log.error(
            "dspark: a decode step of %d requests failed (%s: %s); isolating them",
            len(self.running),
            type(err).__name__,
            err,
            exc_info=not isinstance(err, DSparkError),
        )
        named = set(getattr(err, "rows", None) or ())
        assert self.batch is not None  # the step that failed ran on it
        reqs, gens = self.running, self.batch.generators
        self.running, self.batch = [], None
        finished = []
        for b, (req, gen, st) in enumerate(zip(reqs, gens, states)):
            if gen is not None:
                gen.set_state(st)
            try:
                if b in named:
                    raise err
                one = self._resume(req, gen)
                res = decode_step(self.target, self.draft, one, self.policy, self.lookup)
                done = self._record(res, [req])
            except Exception as alone:
                self._fail(req, alone, "decode step")
                finished.append(req)
                continue
            finished.extend(done)
            if not req.finished:
                self.running.append(req)
                self.batch = one if self.batch is None else self._merge(self.batch, one)
        return finished

    def _merge(self, a: Batch, b: Batch) -> Batch:
        """The running batch a and the rows b joining it: b's waiting taps (a new prompt's) enter the
        draft context now, a's keep waiting (`batch.merged`)."""
        flush_context(self.draft, b)
        if a.ctx is not None and b.ctx is None:
            raise RuntimeError("merging a batch with a draft context and one without")
        ctx = ContextCache.merge([a.ctx, b.ctx]) if a.ctx is not None and b.ctx is not None else None
        return merged(a, b, self.target.merge([a.target, b.target]), ctx)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.finished]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.batch = None
            return
        assert self.batch is not None  # requests were running: they are its rows
        self.batch = self.batch.select(keep, self.target)

    # ---- output --------------------------------------------------------------------------
    def _emit(self, req: Request, tokens: list[int], marks: list[TokenMark] | None = None) -> int:
        """Append committed tokens up to the first stop; nothing past a stop is ever emitted.
        Returns how many of `tokens` were kept (a stop string's cut comes later: see req.text)."""
        p, new = req.params, []
        for tok in tokens:
            new.append(tok)
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                req.finish_reason = "stop"
                break
            if len(req.output_ids) + len(new) >= p.max_new_tokens:
                req.finish_reason = "length"
                break
        req.output_ids.extend(new)
        if marks is not None:
            assert req.marks is not None  # marks come only for a request that records them
            req.marks.extend(marks[: len(new)])
        if p.stop and req.detok is not None:
            req.detok.update(req.output_ids)
            hit = req.detok.find_stop()
            if hit is not None:
                req.text = req.detok.text[:hit]
                req.finish_reason = "stop"
        if req.finished:
            req.t_finish = time.perf_counter()
            if req.text is None and self.tokenizer is not None:
                req.text = self.decode(req.output_ids)  # once, in full: the reference text
        if req.on_tokens is not None and new:
            req.on_tokens(req, new)
        return len(new)

    def reset(self) -> None:
        """Drop every request and the batch state (after a failed step its caches are suspect)."""
        for req in self.waiting + self.running + [job.req for job in self.prefilling]:
            req.finish_reason = req.finish_reason or "abort"
        self.waiting.clear()
        self.prefilling.clear()
        self.running = []
        self.batch = None

    def abort(self, req: Request) -> None:
        """Free a request's slot at once (a client went away)."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.prefilling = [job for job in self.prefilling if job.req is not req]
        req.finish_reason = req.finish_reason or "abort"
        self._drop_finished()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit waiting requests, run one decode step for the batch; return requests that finished
        (a failure ends only the requests it belongs to, with finish_reason "error")."""
        failed = self._admit()
        failed += self._prefill_step()
        if self.batch is None:
            return failed
        # the generators as they were: a failed step is replayed with the same randomness
        states = [g.get_state() if g is not None else None for g in self.batch.generators]
        try:
            res = decode_step(self.target, self.draft, self.batch, self.policy, self.lookup)
        except Exception as err:
            return failed + self._recover(err, states)
        finished = failed + self._record(res, self.running)
        self._drop_finished()
        return finished

    def _record(self, res: StepResult, running: list[Request]) -> list[Request]:
        """Hand a step's tokens to its requests (rows in order) and count them; returns those that
        finished. A request whose own output handling raises (its stop strings, its callback)
        ends with "error" alone."""
        for observer in (self.policy, *self.observers):
            observer.observe(res, running)
        if self.lookup is not None:
            self.lookup.observe(res)
        finished = []
        conf = None
        if res.conf_logits is not None and any(r.marks is not None for r in running):
            conf = torch.sigmoid(res.conf_logits.float()).tolist()
        for b, req in enumerate(running):
            req.steps += 1
            committed = res.committed[b]
            marks = None
            if req.marks is not None:
                source = res.source(b)
                marks = step_marks(
                    req.steps,
                    committed,
                    res.drafted[b],
                    res.verified[b],
                    res.accepted[b],
                    res.proposed[b] if res.proposed is not None else None,
                    conf[b] if conf is not None and source == "draft" else None,
                    source,
                )
            try:
                kept = self._emit(req, committed, marks)
            except Exception as err:
                self._fail(req, err, "output")
                kept = 0
            if self.speculative:
                # the engine's counters: what it drafted, verified and accepted (the policy's view);
                # the request's: what it received, so a stop (or max_new_tokens) among the accepted
                # drafts leaves the drafts past it out, and its statistics agree with its tokens
                acc = min(res.accepted[b], kept)
                ver = res.verified[b] if kept == len(committed) else min(res.verified[b], kept)
                source = res.source(b)
                request_metrics(req).record(res.drafted[b], ver, acc, source)
                self.metrics.record(res.drafted[b], res.verified[b], res.accepted[b], source)
            if req.finished:
                finished.append(req)
        share = 1.0 / len(running)
        for m in [self.metrics] + [request_metrics(r) for r in running]:
            w = 1.0 if m is self.metrics else share
            m.t_draft += res.t_draft * w
            m.t_verify += res.t_verify * w
            m.t_other += res.t_other * w
        self._check_degraded()
        return finished

    def _check_degraded(self) -> None:
        if self._warned or self.draft is None:
            return
        msg = degraded(self.metrics)
        if msg is not None:
            self._warned = True
            log.warning("WARNING: %s", msg)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def generate(self, prompt_ids: list[int], params: SamplingParams, on_tokens=None, marks: bool = False) -> Request:
        """One request to its end; a request that failed raises (DSparkError naming why)."""
        req = self.add_request(prompt_ids, params, on_tokens, marks=marks)
        while not req.finished:
            self.step()
        if req.finish_reason == "error":
            raise DSparkError(f"generation failed: {req.error} (request {req.id})")
        return req

    def generate_many(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[Request]:
        """Several requests batched; one that failed ends alone (finish_reason "error", .error why),
        the others are unaffected."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run_until_done()
        return reqs
