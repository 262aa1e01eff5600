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
The drafting phase itself (the compiled call, or the draft's modules) is engine/drafting.py.
"""

from __future__ import annotations

import math

import torch

from dspark.engine.batch import Batch, Proposal, StepResult, wait_taps
from dspark.engine.drafting import propose
from dspark.engine.lookup import LookupProposer, Plan
from dspark.engine.policy import VerifyPolicy
from dspark.engine.sampling import greedy_accept, greedy_accept_ids, speculative_sample
from dspark.engine.timing import now
from dspark.model.draft import DSparkDraft
from dspark.target.base import Target


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
