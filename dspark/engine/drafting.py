"""The drafting phase: what the draft's network makes of a block, and the proposal a step verifies.

On a draft context made for dspark's kernels (`ContextCache.kernels`, chosen where the engine is
built) the phase is one compiled call (model/fast.py -> csrc/draft.cpp): the context update of the
committed positions, the block's layers, the head, the Markov walk of greedy and sampled rows for
every Markov head kind, and the confidences. On the others (GPUs, a CPU without the kernels, fp32
drafts, the doctor's shared contexts) the draft's modules run the same steps op by op and
`walk_in_torch` walks the block slot by slot: that path is also the reference the compiled call
is tested against (tests/test_draft_phase.py). `teacher_forced` feeds the Markov head given
tokens (`dspark doctor`, `dspark train probe`). The decode step that uses all this is engine/step.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from dspark.engine.batch import Batch, Proposal, take_pending
from dspark.engine.sampling import SamplingParams, draw, probs
from dspark.engine.timing import now
from dspark.model import fast
from dspark.model.draft import ContextCache, DSparkDraft
from dspark.ops import argmax
from dspark.target.base import TargetState


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
    q: torch.Tensor | None = None  # [B, depth, V] what each sampled row's walked slot was drawn from (None: none)


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
    (their distributions in Block.q). On a context made for dspark's kernels (`ContextCache.kernels`,
    chosen where the engine makes it) that is one compiled call (model/fast.py), whatever the Markov
    head's kind; on the others the modules (the reference, and the path on other devices) run the
    same steps op by op and leave the walk to the caller (`propose`).
    The whole block runs, as trained, whatever the depth."""
    spec = draft.spec
    B = anchors.shape[0]
    rows = spec.sampled_rows
    stop = rows.stop if depth is None else rows.start + depth
    if ctx.kernels:
        fast.check_context(draft, ctx, B)
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
            draft.module_extend_context(ctx, taps, counts)
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
            for b in sampled:  # over the target's vocabulary already
                q[b] = block.q[b]
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
    # a greedy row's temperature is 0: the call reads it as greedy
    shaping = torch.tensor([[p.temperature, float(p.top_k), p.top_p] for p in batch.params])
    uniforms = torch.zeros(len(batch.params), depth)
    for b in sampled:
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
        batch.ctx = ctx.fork()
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
