"""What one decode step reads and returns, typed once for the step, the engine and the policies.

- `Batch`: the decoding state of the requests in flight (target cache, draft context, anchors,
  sampling, the taps waiting for the draft context, the lookup indices);
- `Proposal`: the tokens a step verifies and the distributions they were drawn from;
- `StepResult`: what a step committed and how long its parts took, per request;
- the draft context's deferred commit: the taps a step commits wait in the batch (`pending`,
  `unposted`) until the next drafting call takes them (`take_pending`), joined per row by
  the steps that do not draft (`wait_taps`), and kept waiting when rows join (`merged`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.engine.lookup import LookupIndex
from dspark.engine.sampling import SamplingParams
from dspark.model.draft import ContextCache
from dspark.target.base import TargetState


@dataclass
class Batch:
    """Decoding state of the requests in flight, one row each."""

    target: TargetState
    ctx: ContextCache | None  # draft context (None without a draft)
    anchors: torch.Tensor  # [B] last committed token, not yet run through the target
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    # taps [B, k, n_taps*H] not yet in the draft context (a new request's prompt, then the steps
    # that skipped drafting, every row the same k): a plain step does not pay for the context
    # update; the next drafting step adds them in one call
    pending: list[torch.Tensor] = field(default_factory=list)
    # the last drafting step's taps [B, 1+m, F] and how many of each row it committed [B] (or what
    # a lookup step or a join left waiting, ragged): the next drafting step's call posts them with
    # its block (one call, not two, a step). `pending`'s positions come after these.
    unposted: tuple[torch.Tensor, torch.Tensor] | None = None
    # per row, the index the lookup proposer reads (None: no lookup)
    lookup: list[LookupIndex] | None = None
    # positions in `unposted` that steps without drafting left there (lookup steps, and the plain
    # steps before them): a catch-up for the next drafting call, like `pending`
    joined: int = 0

    @property
    def catch_up(self) -> int:
        """Positions waiting for the draft context that steps without drafting left (the prompt's,
        plain and lookup steps'): those in `pending` and those counted in `joined`."""
        return self.joined + sum(t.shape[1] for t in self.pending)

    def select(self, keep: list[int], target) -> Batch:
        """The batch of rows `keep` (in that order), everything a row holds kept with it; target: the
        runtime whose state this is (Target.select)."""
        rows = torch.tensor(keep, device=self.anchors.device)
        return Batch(
            target.select(self.target, rows),
            self.ctx.select(rows) if self.ctx is not None else None,
            self.anchors[rows],
            [self.params[i] for i in keep],
            [self.generators[i] for i in keep],
            [p[rows] for p in self.pending],
            None if self.unposted is None else (self.unposted[0][rows], self.unposted[1][rows]),
            None if self.lookup is None else [self.lookup[i] for i in keep],
            self.joined,
        )


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, g] target-vocabulary ids
    q: list[torch.Tensor | None]  # per request [g, V]: the exact distributions sampled from (None: greedy)
    conf_logits: torch.Tensor | None  # [B, g]


@dataclass
class StepResult:
    # per request, plain ints: every step's observers read them, and a tensor op costs more than
    # the Python around it (a step that skips drafting must cost what a plain step does)
    drafted: list[int]  # [B] drafts proposed
    verified: list[int]  # [B] drafts sent to the target
    accepted: list[int]  # [B]
    committed: list[list[int]]  # per request: accepted drafts + the target's next token
    t_draft: float
    t_verify: float
    t_other: float
    # [B, g] raw confidence logits of the drafted slots (None without a confidence head), kept
    # so step observers (calibration, `dspark calibrate`) can pair them with `accepted`
    conf_logits: torch.Tensor | None = None
    # [B][g] the drafts proposed (None when the step drafted nothing): what a rejected slot held
    proposed: list[list[int]] | None = None
    # positions of the prompt and of skipped steps that this drafting step's call added to the draft
    # context (0 when the step before drafted too): a one-off catch-up inside t_draft, not what
    # drafting costs a step, so the adaptive policy does not learn its overhead from such a step
    caught_up: int = 0
    # per row, what proposed its tokens: "draft", "lookup" or "plain" (nothing); None: every row
    # "draft" when the step drafted, else "plain"
    sources: list[str] | None = None
    # per row, the lookup proposal's match length (0: not a lookup row)
    match: list[int] | None = None

    def source(self, b: int) -> str:
        if self.sources is not None:
            return self.sources[b]
        return "draft" if self.drafted[b] else "plain"

    @property
    def drafting(self) -> bool:
        """Whether the draft ran this step (its phase is in t_draft)."""
        return "draft" in self.sources if self.sources is not None else bool(self.drafted and self.drafted[0])


def take_pending(batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The taps waiting for the draft context and how many of each row to commit [B]: batch.unposted
    (ragged) followed by batch.pending (every row all of its k positions), joined once here, or
    (None, None). What is returned is no longer waiting."""
    unposted, pending = batch.unposted, batch.pending
    batch.unposted, batch.joined, batch.pending = None, 0, []
    if not pending:
        return unposted if unposted is not None else (None, None)
    taps = torch.cat(pending, dim=1) if len(pending) > 1 else pending[0]
    counts = torch.full((taps.shape[0],), taps.shape[1], dtype=torch.long, device=taps.device)
    return (taps, counts) if unposted is None else join_taps(*unposted, taps, counts)


def join_taps(
    a: torch.Tensor, ca: torch.Tensor, b: torch.Tensor, cb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two waits of taps, each [B, k, F] with counts [B] of each row's leading positions to commit,
    as one: row r holds a's first ca[r] positions, then b's."""
    counts = ca.tolist()
    if all(c == counts[0] for c in counts):  # every row the same (one request, plain steps): a slice
        return torch.cat([a[:, : counts[0]], b], dim=1), ca + cb
    # one gather whatever the batch (a loop over rows cost two small ops a row, every step after a
    # ragged one): row r reads a's first ca[r] positions, then b's; past those, a copy nothing commits
    both = torch.cat([a, b], dim=1)
    j = torch.arange(max(counts) + b.shape[1], device=a.device)[None, :]
    at = torch.where(j < ca[:, None], j, a.shape[1] + j - ca[:, None]).clamp(max=both.shape[1] - 1)
    return both.gather(1, at[..., None].expand(*at.shape, a.shape[2])), ca + cb


def wait_taps(batch: Batch, taps: torch.Tensor, counts: torch.Tensor | None = None) -> None:
    """A step that did not draft committed counts[b] positions of each row (None: all of taps'):
    their taps wait for the next drafting call, with no call of the draft's network. A plain step's
    queue in batch.pending (an append: whatever waits before them is joined once, when the draft
    takes them); a lookup step's, ragged, join everything waiting into batch.unposted."""
    if counts is None:
        batch.pending.append(taps)
        return
    joined = batch.catch_up
    w_taps, w_counts = take_pending(batch)
    if w_taps is None or w_counts is None:
        batch.unposted = (taps, counts)
    else:
        batch.unposted = join_taps(w_taps, w_counts, taps, counts)
    batch.joined = joined + taps.shape[1]


def merged(a: Batch, b: Batch, target: TargetState, ctx: ContextCache | None) -> Batch:
    """Batch a with b's rows after its own, given their merged target state and draft context; b
    waits for nothing (its taps are in its context). a's waiting taps keep waiting, b's rows
    committing none of them: a batch whose policy skips drafting for a while, as batched decoding
    often does, pays no draft call when a request joins, and its steps after the join still append."""
    joined = a.catch_up
    taps, counts = take_pending(a)
    more = b.anchors.shape[0]
    unposted = None
    if taps is not None and counts is not None:
        unposted = (
            torch.cat([taps, taps.new_zeros(more, *taps.shape[1:])]),
            torch.cat([counts, counts.new_zeros(more)]),
        )
    return Batch(
        target,
        ctx,
        torch.cat([a.anchors, b.anchors]),
        a.params + b.params,
        a.generators + b.generators,
        [],
        unposted,
        a.lookup + b.lookup if a.lookup is not None and b.lookup is not None else None,
        joined,
    )
