"""Proposals from the text itself: the continuation that followed the current suffix the last
time it occurred in the request's prompt or output (prompt lookup / n-gram speculation).

A lookup proposal costs no network pass, only a target verify, so it pays from a low acceptance
where the answer repeats its context (editing, code changes, format conversion, quoting, lists).
It is a point mass (the proposed token is a function of the context), so greedy verification
and rejection sampling with q = that point mass stay exact (engine/step.py).

- `LookupIndex`, one per request: every n-gram of 1..MATCH_MAX tokens -> the position after its
  latest occurrence, updated as tokens commit (no rescan of the context per step).
- `LookupStats`, one per engine: the acceptance of each proposed position by match length,
  learned online from verification (decayed counts; a cell with few verifications leans on the
  pooled rate of first or of later positions, itself starting from an even prior, so a new kind
  of text is tried before it is judged).
- `LookupProposer`: the step's choice per request between the lookup continuation, the draft's
  block and nothing, by expected committed tokens per second from the verification policy's
  measured costs (docs/SCHEDULING.md, "Two proposers").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MATCH_MAX = 4  # the longest suffix matched (n-gram keys of 1..MATCH_MAX tokens)
LOOKUP_MAX = 8  # tokens proposed at most
# the prior of an unseen (match length, position): PRIOR_MEAN with the weight of PRIOR_WEIGHT
# verified proposals; optimistic so that a proposal is tried before its acceptance is known
PRIOR_MEAN, PRIOR_WEIGHT = 0.5, 2.0
FIXED_WINDOW = 16  # recent steps of each kind whose least fixed time is that kind's
# steps of each kind timed before a lookup step's extra fixed time is charged: the least of a
# single one is whatever that step met (a first call, a page fault), and charged it could price
# every later proposal out, so that no lookup step ever ran again to correct it
FIXED_MIN = 3
DRAFT_EMA = 0.05  # weight of the newest verified draft block in the draft's running gain
DECAY = 0.98  # weight of the older verifications at each new one: the text's kind changes
# a batch of requests rarely takes a lookup step (its rows verify to one depth, so a proposal pays
# only where most rows have one): after IDLE_PLANS plans in a row chose nothing for a batch of 2+
# requests, the next plans are skipped (the step proposes nothing from the text), 1, 2, 4, ... up
# to SKIP_MAX of them between two plans, until a plan chooses a proposal again or the batch changes;
# a request decoding alone is planned every step (it loses copies when it skips, and its plan is
# a small share of its step)
IDLE_PLANS, SKIP_MAX = 4, 8
# plans whose best proposal the measured extra fixed time priced out (it paid on the curve alone)
# before one is made anyway, to time that extra again: a lookup step not taken measures nothing, so
# a few first steps slower than the rest (cold code paths) would otherwise price the lookup out for
# good; each such probe that changes nothing doubles the wait, up to PRICED_OUT_MAX
PRICED_OUT_PROBE, PRICED_OUT_MAX = 16, 256


class LookupIndex:
    """The tokens of one request (prompt, then output) and where each n-gram last occurred."""

    def __init__(self, tokens: list[int] | None = None):
        self.tokens: list[int] = list(tokens or [])
        # n-gram ending just before position p -> p, the latest such p. The n-grams ending at the
        # last token are registered only when the next token arrives, so a lookup of the current
        # suffix finds an earlier occurrence, never itself.
        self.after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions whose n-grams are in `after`: the rest wait for the next proposal

    def extend(self, new: list[int]) -> None:
        """Committed tokens: appended now, indexed when the next proposal reads the index (a step
        that proposes nothing from the text pays nothing for it)."""
        self.tokens.extend(new)

    def _index(self) -> None:
        toks, after = self.tokens, self.after
        for i in range(max(self._indexed, 1), len(toks)):
            for n in range(1, min(MATCH_MAX, i) + 1):
                after[tuple(toks[i - n : i])] = i
        self._indexed = len(toks)

    def propose(self, limit: int = LOOKUP_MAX) -> tuple[list[int], int]:
        """(the continuation after the latest earlier occurrence of the longest matching suffix, at
        most `limit` tokens; the match length), or ([], 0) when no suffix occurred before."""
        if self._indexed < len(self.tokens):
            self._index()
        toks = self.tokens
        for n in range(min(MATCH_MAX, len(toks)), 0, -1):
            p = self.after.get(tuple(toks[-n:]))
            if p is not None:
                return toks[p : p + limit], n
        return [], 0


@dataclass
class LookupStats:
    """Per match length m (1..MATCH_MAX) and proposed position j: decayed counts of verifications
    that reached j with every earlier position accepted, and of those that accepted j."""

    seen: list[list[float]] = field(default_factory=lambda: [[0.0] * LOOKUP_MAX for _ in range(MATCH_MAX)])
    hits: list[list[float]] = field(default_factory=lambda: [[0.0] * LOOKUP_MAX for _ in range(MATCH_MAX)])
    # survivals by match length, kept until the next verification changes the counts: every row of
    # every step reads them, and they change only when a lookup proposal is verified
    _survival: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)

    def pooled(self, first: bool) -> float:
        """The acceptance of first positions (first=True) or of later ones given the earlier were
        accepted, over every match length and position: the prior of a cell with few verifications.
        A copy, once it holds, tends to go on, so later positions learn from each other."""
        cols = range(1) if first else range(1, LOOKUP_MAX)
        s = sum(row[j] for row in self.seen for j in cols)
        h = sum(row[j] for row in self.hits for j in cols)
        return (h + PRIOR_MEAN * PRIOR_WEIGHT) / (s + PRIOR_WEIGHT)

    def conditional(self, m: int) -> list[float]:
        """P(position j accepted | positions < j accepted) for a match of m tokens: this cell's
        verifications, with the pooled rate of its kind of position weighing PRIOR_WEIGHT of them."""
        s, h = self.seen[m - 1], self.hits[m - 1]
        first, later = self.pooled(True), self.pooled(False)
        return [(h[j] + (first if j == 0 else later) * PRIOR_WEIGHT) / (s[j] + PRIOR_WEIGHT) for j in range(LOOKUP_MAX)]

    def survival(self, m: int, k: int) -> list[float]:
        """[k] P(the first j+1 proposed tokens all accepted), for a match of m tokens."""
        surv = self._survival.get(m)
        if surv is None:
            surv, acc = [], 1.0
            for c in self.conditional(m):
                acc *= c
                surv.append(acc)
            self._survival[m] = surv
        return surv[:k]

    def record(self, m: int, verified: int, accepted: int) -> None:
        self._survival.clear()
        s, h = self.seen[m - 1], self.hits[m - 1]
        for j in range(min(verified, accepted + 1)):
            s[j] = s[j] * DECAY + 1.0
            h[j] = h[j] * DECAY + (1.0 if j < accepted else 0.0)


@dataclass
class Plan:
    """One step's proposals: per row the lookup tokens it verifies (empty: none) and their match
    length, and whether the draft runs for the rows without a lookup proposal."""

    tokens: list[list[int]]
    match: list[int]
    draft: bool

    @property
    def any(self) -> bool:
        return any(self.tokens)


class LookupProposer:
    """The lookup side of a step: proposals per row, the choice against the draft and plain
    decoding, and learning from what verification accepted."""

    def __init__(self, limit: int = LOOKUP_MAX):
        if not 1 <= limit <= LOOKUP_MAX:
            raise ValueError(f"lookup proposals are 1..{LOOKUP_MAX} tokens, got {limit}")
        self.limit = limit
        self.stats = LookupStats()
        # the draft's accepted tokens per verified block (running mean): what a lookup proposal is
        # compared with, per row, when a policy drafts whatever the cost (full, threshold)
        self.draft_gain = 0.0
        self._draft_seen = 0
        # what a step that verifies lookup tokens costs outside the target's forward beyond what a
        # plain step does (its proposal, the verify's acceptance and bookkeeping: a few small tensor
        # ops, each dear right after a forward): the least of each kind's recent fixed times, since
        # load only ever adds time, and one slow step (a first call, a descheduled one) must not
        # price the lookup out for good (a lookup that is not proposed measures nothing new)
        self._fixed: dict[str, deque[float]] = {
            "lookup": deque(maxlen=FIXED_WINDOW),
            "plain": deque(maxlen=FIXED_WINDOW),
        }
        # batches of 2+ requests: empty plans in a row, plans left to skip, the last skip's length,
        # and the batch size they were counted at
        self._idle, self._skip, self._wait, self._rows = 0, 0, 0, 0
        # plans the extra fixed time priced out since the last lookup step, and how many make a probe
        self._priced_out, self._probe_every = 0, PRICED_OUT_PROBE

    @property
    def extra_seconds(self) -> float:
        """A lookup step's fixed time over a plain step's, as measured (0 before FIXED_MIN of each are)."""
        look, plain = self._fixed["lookup"], self._fixed["plain"]
        if len(look) < FIXED_MIN or len(plain) < FIXED_MIN:
            return 0.0
        return max(0.0, min(look) - min(plain))

    def describe(self, draft: bool = True) -> str:
        against = "the draft and plain decoding" if draft else "plain decoding (no draft loaded)"
        return (
            f"lookup: proposals from the prompt and the output (suffix of up to {MATCH_MAX} tokens matched, "
            f"up to {self.limit} proposed), chosen per request against {against} by expected tokens per second"
        )

    def plan(self, indices: list[LookupIndex], step_seconds, draft_rate) -> Plan:
        """indices: the batch's rows. step_seconds(tokens) -> seconds of a step that verifies that
        many tokens without drafting. draft_rate: None when the draft does not run this step,
        else (committed tokens/s drafting every row, the draft's expected gain per row).

        The lookup option verifies each row's proposal to a common depth d (the target runs a padded
        [B, 1 + d] block) and is valued at (B + its expected accepted tokens) / step_seconds(B(1+d)).
        It wins the step when that beats plain decoding and, when the policy drafts, drafting; otherwise the rows
        whose lookup proposal expects more accepted tokens than the draft's block take it in the
        same verify. Every choice reads the context and earlier steps only: exact. A batch of 2+
        requests whose plans keep choosing nothing skips planning for a while (IDLE_PLANS)."""
        B = len(indices)
        if B != self._rows:
            self._idle, self._skip, self._wait, self._rows = 0, 0, 0, B
        if self._skip > 0:  # a batch whose plans keep choosing nothing: this step proposes nothing
            self._skip -= 1
            return Plan([[] for _ in range(B)], [0] * B, draft=draft_rate is not None)
        plan = self._plan(indices, step_seconds, draft_rate)
        if B >= 2:
            if plan.any:
                self._idle, self._wait = 0, 0
            else:
                self._idle += 1
                if self._idle >= IDLE_PLANS:
                    self._wait = min(SKIP_MAX, 2 * self._wait or 1)
                    self._skip = self._wait
        return plan

    def _plan(self, indices: list[LookupIndex], step_seconds, draft_rate) -> Plan:
        B = len(indices)
        props = [ix.propose(self.limit) for ix in indices]
        survs = [self.stats.survival(m, len(t)) if m else [] for t, m in props]
        plain = B / step_seconds(B)
        best_rate, best_d = plain, 0
        free_rate, free_d = plain, 0  # the same choice without the extra fixed time
        extra = self.extra_seconds
        for d in range(1, max((len(s) for s in survs), default=0) + 1):
            gain, t = sum(sum(s[:d]) for s in survs), step_seconds(B * (1 + d))
            rate, free = (B + gain) / (t + extra), (B + gain) / t
            if rate > best_rate:
                best_rate, best_d = rate, d
            if free > free_rate:
                free_rate, free_d = free, d
        if best_d:
            self._priced_out, self._probe_every = 0, PRICED_OUT_PROBE
        elif free_d:  # only the extra priced it out: a probe every so often times the extra again
            self._priced_out += 1
            if self._priced_out >= self._probe_every:
                self._priced_out, self._probe_every = 0, min(2 * self._probe_every, PRICED_OUT_MAX)
                best_rate, best_d = free_rate, free_d
        if draft_rate is not None:
            rate, per_row = draft_rate
            # the policy chose to draft (a probe among them): only a lookup that beats it takes the step
            if best_d == 0 or rate > best_rate:  # the draft's step, the rows whose lookup expects more taking it
                cut = [t[:best_d] if sum(s[:best_d]) > per_row else [] for (t, _), s in zip(props, survs)]
                return Plan(cut, [m if c else 0 for c, (_, m) in zip(cut, props)], draft=True)
        cut = [t[:best_d] for t, _ in props]
        return Plan(cut, [m if c else 0 for c, (_, m) in zip(cut, props)], draft=False)

    def observe(self, res) -> None:
        """A step's result (engine/step.py StepResult): the lookup rows' verifications teach the
        acceptance by match length, the draft rows' the draft's gain."""
        if not res.drafting:  # the fixed time of a step without the draft's phase, by kind
            kind = "lookup" if res.match is not None and any(res.match) else "plain"
            self._fixed[kind].append(res.t_draft + res.t_other)
        match = res.match or [0] * len(res.verified)
        for b, (m, v, a) in enumerate(zip(match, res.verified, res.accepted)):
            if m and v:
                self.stats.record(m, v, a)
            elif v and res.source(b) == "draft":
                self._draft_seen += 1
                w = max(DRAFT_EMA, 1.0 / self._draft_seen)
                self.draft_gain = (1 - w) * self.draft_gain + w * a
