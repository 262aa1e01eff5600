"""ONE speculative decode step for a batch of requests, top to bottom.

    anchors [B] + draft context cache
      -> draft forward on [anchor, MASK, ...]            (spec.query_slots rows)
      -> rows chosen by the layout -> Markov walk        -> drafts [B, g], q, confidences
      -> verify lengths n [B]                            (the verification policy; full = g)
      -> target forward on [anchor, drafts[:n]]          -> logits, tapped hidden states
      -> accept (greedy or rejection sampling)           -> accepted a [B], next token [B]
      -> commit: target keeps anchor + a drafts; the draft context receives the taps of
         exactly those positions (never a rejected one), in the next drafting step's call;
         next token = new anchor
With no draft (g = 0) the same path is plain target decoding; so is a step whose policy
skips drafting (`should_draft`); its taps reach the draft context at the next drafting step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from dspark.engine.batch import Batch, Proposal, StepResult, take_pending, wait_taps
from dspark.engine.lookup import LookupProposer, Plan
from dspark.engine.policy import VerifyPolicy
from dspark.engine.sampling import (
    SamplingParams,
    draw,
    greedy_accept,
    greedy_accept_ids,
    probs,
    speculative_sample,
)
from dspark.engine.timing import now
from dspark.model import fast
from dspark.model.draft import ContextCache, DSparkDraft
from dspark.ops import argmax
from dspark.target.base import Target, TargetState


@dataclass
class Block:
    """What the draft's network made of one block: either the walked proposal (the kernels walked
    every row greedily: tokens and confidences) or what a walk in Python reads (h, the base logits
    of the drafted rows, the Markov head's state before the first of them)."""

    h: torch.Tensor | None = None  # [B, r, H] states of the block rows up to the last one drafted
    base: torch.Tensor | None = None  # [B, depth, Vd] draft-head logits of the drafted rows
    state: torch.Tensor | None = None  # the Markov head's state before the first drafted row (rnn / gated)
    tokens: torch.Tensor | None = None  # [B, depth] walked target ids
    conf: torch.Tensor | None = None  # [B, depth] confidence logits of the walked rows (None: no confidence head)
    q: torch.Tensor | None = None  # [B, depth, Vd] what each sampled row's walked slot was drawn from (None: none)


@torch.inference_mode()
def draft_block(
    draft: DSparkDraft,
    anchors: torch.Tensor,
    ctx: ContextCache,
    depth: int | None = None,
    taps: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    walk: bool = False,
    sampling: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Block:
    """The draft's network for one drafting phase: commit the first counts[b] of taps [B, n, F]
    to the context (when given), then the block [anchor, MASK, ...] over it, the head on the first
    `depth` sampled rows (all g by default) and, with walk, the Markov walk and the confidences:
    greedy, or for the rows `sampling` (`walk_sampling`) samples, drawn from the shaped logits
    (their distributions in Block.q). On a CPU with dspark's kernels that is one compiled call
    (model/fast.py), whatever the Markov head's kind; the modules (the reference, and the path on
    other devices) run the same steps op by op and leave the walk to the caller (`propose`).
    The whole block runs, as trained, whatever the depth."""
    spec = draft.spec
    B = anchors.shape[0]
    rows = spec.sampled_rows
    stop = rows.stop if depth is None else rows.start + depth
    if fast.applies(draft, ctx, B):
        kernel = fast.for_draft(draft)
        shaping, uniforms = sampling if sampling is not None and walk else (None, None)
        out = kernel.call(spec, ctx, taps, counts, anchors, rows.start, stop - rows.start, walk, shaping, uniforms)
        if walk:
            return Block(tokens=out[0], conf=out[1] if out[1].numel() else None, q=out[2] if out[2].numel() else None)
        h, base = out[0].to(draft.fc.weight.dtype), out[1]  # h: what the Python heads read
    else:
        if taps is not None:
            if counts is None:
                raise ValueError("draft_block: taps for the context come with counts (how many of each row to commit)")
            draft.extend_context(ctx, taps, counts)
        h = draft.block_states(anchors, ctx, stop)  # [B, stop, H]
        base = draft.head_logits(h[:, rows.start : stop])  # [B, depth, Vd]
    mh = draft.markov_head
    state = mh.init_state(B, h) if mh is not None else None
    if mh is not None and mh.head_type == "rnn" and rows.start == 1:
        # bonus-anchor row 0 is never sampled, but training ran the recurrence through it
        _, _, state = mh.step(anchors, h[:, 0], state)
    return Block(h=h, base=base, state=state)


@torch.inference_mode()
def propose(draft: DSparkDraft, batch: Batch, depth: int | None = None) -> Proposal:
    """Draft the first `depth` slots of the block (all g by default: a policy that will verify
    no deeper saves the draft head and the walk of the rest). The draft context takes the taps
    waiting in batch.pending in the same call (`draft_block`). On dspark's kernels the phase is
    that one call, the rows that sample drawn in it and their distributions, which verification
    divides by, returned; on the modules the walk runs here, slot by slot, from the same uniforms
    (`walk_sampling`)."""
    rows = draft.spec.sampled_rows
    if depth is not None:
        if not 1 <= depth <= len(rows):
            raise ValueError(f"draft depth must be 1..{len(rows)}, got {depth}")
        rows = rows[:depth]
    anchors = batch.anchors
    B = anchors.shape[0]
    sampled = [b for b, p in enumerate(batch.params) if not p.greedy]
    if batch.ctx is None:
        raise ValueError("propose: the batch has no draft context (it was made without a draft)")
    taps, counts = take_pending(batch)
    shaping = walk_sampling(batch, sampled, len(rows)) if sampled else None
    block = draft_block(draft, anchors, batch.ctx, len(rows), taps, counts, True, shaping)
    if block.tokens is not None:
        q: list[torch.Tensor | None] = [None] * B
        if block.q is not None:
            ids = draft.to_target_ids(torch.arange(block.q.shape[-1], device=block.q.device))
            for b in sampled:  # the draft vocabulary's distribution in the target's
                q[b] = block.q.new_zeros(len(rows), draft.spec.vocab_size).index_copy_(1, ids, block.q[b])
        return Proposal(tokens=block.tokens, q=q, conf_logits=block.conf)
    return walk_in_torch(draft, block, batch, rows, shaping)


def walk_in_torch(
    draft: DSparkDraft, block: Block, batch: Batch, rows: range, shaping: tuple[torch.Tensor, torch.Tensor] | None
) -> Proposal:
    """The Markov walk over a block's states and base logits, slot by slot in torch (the modules'
    path; on the kernels it runs in the call): greedy rows take the argmax, the rows `shaping`
    samples (`walk_sampling`) draw by their uniforms from `sampling.probs` of the slot's logits."""
    mh, anchors = draft.markov_head, batch.anchors
    B = anchors.shape[0]
    sampled = [b for b, p in enumerate(batch.params) if not p.greedy]
    h, base, state = block.h, block.base, block.state
    assert h is not None and base is not None  # a block the kernels did not walk holds its states and logits
    prev, tokens, embs = anchors, [], []
    qs: list[list[torch.Tensor]] = [[] for _ in range(B)]
    for k, row in enumerate(rows):
        logits = base[:, k]
        if mh is not None:
            bias, emb, state = mh.step(prev, h[:, row], state)
            logits = logits + bias
            embs.append(emb)
        # greedy rows: argmax in the draft vocabulary (a reduced one maps through d2t); only sampled
        # rows need the full [V] distribution q that verification divides by
        tok = draft.to_target_ids(argmax(logits))  # [B]
        if sampled:
            assert shaping is not None
            full = draft.to_target_vocab(logits[sampled]).float()  # [len(sampled), V]
            for i, b in enumerate(sampled):
                dist = probs(full[i], batch.params[b])
                tok[b] = draw(dist, float(shaping[1][b, k]))
                qs[b].append(dist)
        tokens.append(tok)
        prev = tok
    # confidences of all slots in one call (slot k reads h_k and the token before it, nothing later)
    conf = draft.confidence_logits(h[:, rows.start : rows.stop], torch.stack(embs, 1) if embs else None)
    return Proposal(tokens=torch.stack(tokens, 1), q=[torch.stack(q) if q else None for q in qs], conf_logits=conf)


def walk_sampling(batch: Batch, sampled: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the walk samples the rows `sampled` with: (shaping [B, 3] fp32: temperature (0: a greedy
    row), top_k, top_p; uniforms [B, depth] fp32, each sampled row's drawn from its generator, one a
    slot). The compiled walk and the walk in Python draw the same tokens from them."""
    B = batch.anchors.shape[0]
    shaping, uniforms = torch.zeros(B, 3), torch.zeros(B, depth)
    for b in sampled:
        p = batch.params[b]
        shaping[b] = torch.tensor([p.temperature, float(p.top_k), p.top_p])
        uniforms[b] = torch.rand(depth, generator=batch.generators[b])
    return shaping, uniforms


def target_step(target):
    """-> a call that runs one target step (one token, on a scratch state of its own, committed
    nowhere): what runs between two drafting phases. Allocation-free after the first call, as a
    decoding step is."""
    state = target.new_state(1)
    token = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    keep = torch.zeros(1, dtype=torch.long, device=target.device)

    @torch.inference_mode()
    def step() -> None:
        target.forward(state, token)
        target.commit(state, keep)

    return step


@torch.inference_mode()
def draft_phase_seconds(
    draft: DSparkDraft, context: int = 64, reps: int = 5, evict=None, depth: int | None = None
) -> float:
    """Wall time of one drafting step's own work at batch 1 (`propose`, with the context update of
    two positions the last step committed in its call, as decoding runs it), on a context of
    `context` positions: what the adaptive policy
    weighs against a target step before any real step has run. The least of `reps` after one
    warm-up: interference (another process, a page fault, a frequency step) only ever adds time, and
    a start-up that happened to meet some would otherwise price drafting out until a probe, many
    steps later (bench-runtime's forward costs are each size's fastest for the same reason).
    evict: called (untimed) before each rep; pass one target step, which in decoding runs between
    two drafting phases and pushes the draft's weights out of the CPU's caches (on SmolLM2 a warm
    phase costs ~2/3 of a cold one). depth: the slots drafted (`propose`), all by default."""
    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    width = draft.fc.weight.shape[1]
    ctx = draft.new_context_cache(1, dev)
    draft.extend_context(
        ctx, torch.zeros(1, context, width, device=dev, dtype=dtype), torch.tensor([context], device=dev)
    )
    batch = Batch(
        target=cast(TargetState, None),  # a drafting phase alone: propose reads no target state
        ctx=ctx,
        anchors=torch.zeros(1, dtype=torch.long, device=dev),
        params=[SamplingParams()],
        generators=[None],
    )
    committed = (torch.zeros(1, 3, width, device=dev, dtype=dtype), torch.tensor([2], device=dev))
    times = []
    for _ in range(reps + 1):
        # each rep from the same context: the writes past its length are scratch (ContextCache)
        batch.ctx = ContextCache(list(ctx.layers), ctx.lengths.clone())
        batch.unposted = committed  # a one-draft verify that accepted it: 2 of its 3 positions kept
        if evict is not None:
            evict()
        t0 = now(dev)
        propose(draft, batch, depth)
        times.append(now(dev) - t0)
    return min(times[1:])


@torch.inference_mode()
def teacher_forced(
    draft: DSparkDraft, anchors: torch.Tensor, ctx: ContextCache, targets: torch.Tensor, floor: float = -10.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block of `propose` with the Markov head fed the given tokens instead of its own:
    targets [B, g] -> (the draft's greedy token per slot [B, g], log q(target) per slot [B, g],
    clamped at `floor`; a target outside a reduced draft vocabulary scores the floor).

    While every earlier slot matched, the fed tokens are the draft's own, so the leading matches
    are exactly what greedy verification accepts; the log-probabilities are the draft's training
    objective on the same slots (`dspark doctor` compares readings on both)."""
    rows, mh = draft.spec.sampled_rows, draft.markov_head
    block = draft_block(draft, anchors, ctx)
    h, base, state = block.h, block.base, block.state
    assert h is not None and base is not None  # not walked: the block holds its states and logits
    prev, tokens, logps = anchors, [], []
    for k, row in enumerate(rows):
        logits = base[:, k]
        if mh is not None:
            bias, _, state = mh.step(prev, h[:, row], state)
            logits = logits + bias
        tokens.append(draft.to_target_ids(argmax(logits)))
        # -inf outside a reduced draft vocabulary, then the floor
        lp = draft.to_target_vocab(logits.float().log_softmax(-1))  # [B, V]
        logps.append(lp.gather(1, targets[:, k : k + 1])[:, 0].clamp(min=floor))
        prev = targets[:, k]
    return torch.stack(tokens, 1), torch.stack(logps, 1)


def accept(
    logits: torch.Tensor, prop_tokens: torch.Tensor, n: torch.Tensor, batch: Batch, q
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, 1+m, V] of the target on [anchor, drafts[:m]] -> (accepted [B], next [B])."""
    accepted, nxt = greedy_accept(logits, prop_tokens[:, : logits.shape[1] - 1], n)
    for b, p in enumerate(batch.params):
        if p.greedy:
            continue
        nb = int(n[b])
        qb = q[b][:nb] if nb else None
        a, t = speculative_sample(logits[b, : nb + 1], p, qb, prop_tokens[b, :nb], batch.generators[b])
        accepted[b], nxt[b] = a, t
    return accepted, nxt


def flush_context(draft: DSparkDraft | None, batch: Batch) -> None:
    """Bring the draft context up to the committed length: the last drafting step's taps, or the
    prompt's and those of skipped steps, in one call (`take_pending`)."""
    if draft is None:
        return
    taps, counts = take_pending(batch)
    if taps is not None:
        if batch.ctx is None or counts is None:
            raise ValueError("flush_context: the batch has no draft context (it was made without a draft)")
        draft.extend_context(batch.ctx, taps, counts)


def draft_taps(taps: torch.Tensor | None) -> torch.Tensor:
    """The taps a target forward returned for the draft context (a target with a draft taps)."""
    if taps is None:
        raise RuntimeError("the target returned no taps for the draft context (it taps none of the draft's layers)")
    return taps


def lookup_plan(policy: VerifyPolicy, lookup: LookupProposer, batch: Batch, drafting: bool) -> Plan | None:
    """The lookup proposer's choice for this step (None: the batch has no lookup index)."""
    if batch.lookup is None:
        return None
    draft_rate = None
    if drafting:  # a policy that drafts whatever the cost is compared per row only
        draft_rate = policy.draft_expectation(len(batch.lookup)) or (math.inf, lookup.draft_gain)
    return lookup.plan(batch.lookup, policy.plain_seconds, draft_rate)


def merge_lookup(
    prop: Proposal | None, n: torch.Tensor | None, plan: Plan, batch: Batch, vocab: int
) -> tuple[Proposal, torch.Tensor, list[str]]:
    """The step's proposal with each lookup row's tokens in place of the draft's (or of nothing):
    tokens [B, G], q (a point mass for a sampled lookup row), verify lengths n [B], each row's source."""
    B, dev = batch.anchors.shape[0], batch.anchors.device
    g = prop.tokens.shape[1] if prop is not None else 0
    G = max(g, max(len(t) for t in plan.tokens))
    q: list[torch.Tensor | None] = list(prop.q) if prop is not None else [None] * B
    if prop is None:  # a lookup step: the tokens made at once from the lists (each small op is dear here)
        tokens = torch.tensor([t + [0] * (G - len(t)) for t in plan.tokens], dtype=torch.long, device=dev)
        lengths = [len(t) for t in plan.tokens]
        sources = ["lookup" if t else "plain" for t in plan.tokens]
    else:  # the draft's block, each lookup row's tokens in place of its row
        tokens = batch.anchors.new_zeros(B, G)
        tokens[:, :g] = prop.tokens
        lengths = n.tolist() if n is not None else [0] * B
        sources = ["draft"] * B
        for b, t in enumerate(plan.tokens):
            if t:
                tokens[b] = torch.tensor(t + [0] * (G - len(t)), device=dev)
                lengths[b], sources[b] = len(t), "lookup"
    for b, t in enumerate(plan.tokens):
        if t and not batch.params[b].greedy:  # what the token was drawn from: a point mass
            q[b] = torch.zeros(len(t), vocab, device=dev).scatter_(1, tokens[b, : len(t), None], 1.0)
    conf = prop.conf_logits if prop is not None else None
    return Proposal(tokens, q, conf), torch.tensor(lengths, dtype=torch.long, device=dev), sources


@torch.inference_mode()
def decode_step(
    target: Target,
    draft: DSparkDraft | None,
    batch: Batch,
    policy: VerifyPolicy,
    lookup: LookupProposer | None = None,
) -> StepResult:
    dev = batch.anchors.device
    B = batch.anchors.shape[0]
    t0 = now(dev)
    # A policy may decide from earlier steps alone that drafting will not pay this step (its
    # cost exceeds the expected gain): then this is a plain target step, and the committed
    # position's taps wait in batch.pending until the draft next runs. A lookup proposal that
    # expects more committed tokens a second than drafting takes the step instead (lookup.py).
    drafting = draft is not None and policy.should_draft(batch)
    plan = lookup_plan(policy, lookup, batch, drafting) if lookup is not None else None
    if plan is not None:
        drafting = drafting and plan.draft
    prop = None  # a step without drafts makes no proposal tensors (each small op runs cold after a forward)
    caught_up = batch.catch_up if drafting else 0
    if drafting and draft is not None:
        prop = propose(draft, batch, policy.draft_depth(batch))
    t1 = now(dev)
    n = policy.verify_lengths(prop, batch) if prop is not None else None
    g_draft = prop.tokens.shape[1] if prop is not None else 0
    sources = None
    if plan is not None and plan.any:
        prop, n, sources = merge_lookup(prop, n, plan, batch, target.vocab_size)
    g = prop.tokens.shape[1] if prop is not None else 0
    plain_greedy = not g and all(p.greedy for p in batch.params)
    if g:
        assert prop is not None and n is not None  # g > 0: the proposal and its verify lengths
        m = int(n.max()) if B else 0
        tokens = torch.cat([batch.anchors[:, None], prop.tokens[:, :m]], dim=1)  # [B, 1+m]
    else:
        tokens = batch.anchors[:, None]
        if not plain_greedy:  # sampled rows are accepted as a proposal of no tokens
            prop, n = Proposal(batch.anchors.new_zeros(B, 0), [None] * B, None), batch.anchors.new_zeros(B)
    t2 = now(dev)
    if plain_greedy:
        # the target's argmax alone: no fp32 logits (one call on the native stack), and nothing to
        # accept: every row keeps its anchor, so the step's small tensor ops (each dear right after a
        # forward has streamed the weights through the caches) are made before the forward
        keep = batch.anchors.new_ones(B)
        best, taps = target.forward_argmax(batch.target, tokens, None)
        t3 = now(dev)
        nxt = best[:, 0]
    elif g and all(p.greedy for p in batch.params):
        # greedy verification reads the target's argmax alone, as a plain greedy step does: no fp32
        # logits [B, 1+m, V] to make and scan (docs/history/benchmarks.md, "... greedy verification
        # without fp32 logits"); the padding positions' tokens are never read
        assert prop is not None and n is not None  # g > 0
        best, taps = target.forward_argmax(batch.target, tokens, 1 + n)
        t3 = now(dev)
        accepted, nxt = greedy_accept_ids(best, prop.tokens[:, : tokens.shape[1] - 1], n)
    else:
        assert prop is not None and n is not None  # drafts, or the empty proposal of sampled rows
        logits, taps = target.forward(batch.target, tokens, 1 + n if g else None)
        t3 = now(dev)
        accepted, nxt = accept(logits, prop.tokens, n, batch, prop.q)
    if not plain_greedy:
        keep = 1 + accepted  # anchor + accepted drafts now sit in the target cache
    target.commit(batch.target, keep)
    t4 = now(dev)
    if drafting:  # the committed positions' taps reach the draft context with the next block's call
        batch.unposted = (draft_taps(taps), keep)
    elif draft is not None:  # taps of a plain or lookup step wait for the next drafting call
        wait_taps(batch, draft_taps(taps), keep if g else None)
    t5 = now(dev)
    batch.anchors = nxt
    nxt_ids = nxt.tolist()
    drafts = None
    if plain_greedy:
        acc, verified, committed = [0] * B, [0] * B, [[i] for i in nxt_ids]
    else:
        assert prop is not None and n is not None  # not plain greedy: a proposal, if an empty one
        acc, drafts, verified = accepted.tolist(), prop.tokens.tolist(), n.tolist()
        committed = [drafts[b][: acc[b]] + [nxt_ids[b]] for b in range(B)]
    if batch.lookup is not None:
        for ix, toks in zip(batch.lookup, committed):
            ix.extend(toks)
    drafted = [g] * B
    if sources is not None:  # a row's proposal: the draft's block, its lookup tokens, or nothing
        assert plan is not None
        drafted = [
            len(plan.tokens[b]) if s == "lookup" else (g_draft if s == "draft" else 0) for b, s in enumerate(sources)
        ]
    return StepResult(
        drafted=drafted,
        verified=verified,
        accepted=acc,
        committed=committed,
        t_draft=(t1 - t0) + (t5 - t4),
        t_verify=t3 - t2,
        t_other=(t2 - t1) + (t4 - t3),
        conf_logits=prop.conf_logits if prop is not None else None,
        proposed=drafts if g else None,
        caught_up=caught_up,
        sources=sources,
        match=plan.match if plan is not None and sources is not None else None,
    )
