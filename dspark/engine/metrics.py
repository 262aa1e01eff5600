"""Speculative-decoding counters (docs/DESIGN.md §8).

Drafted, verified and accepted tokens are kept apart so that verifying fewer drafts
(threshold / adaptive schedulers) never inflates an acceptance rate.
- conditional[i] = P(slot i accepted | slots < i accepted and slot i verified)
- marginal[i]    = P(slots 0..i all accepted), per verify step
- mean acceptance length = tokens committed per verify step, bonus included = 1 + sum(marginal)
Steps where the adaptive policy skipped drafting are counted apart (plain_steps): they verify
nothing, so they neither raise nor lower acceptance. Rows whose tokens the lookup proposer
proposed (engine/lookup.py) are counted in `lookup`, the same counters over its proposals, so
the draft's acceptance stays the draft's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    gamma: int
    steps: int = 0  # verify steps with drafts (what acceptance is measured over)
    plain_steps: int = 0  # steps the policy ran without drafting (see AdaptiveScheduler.should_draft)
    drafted: int = 0  # tokens the draft proposed
    verified: int = 0  # drafted tokens sent to the target
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)  # [a] = steps that accepted a drafts
    reached: list[int] = field(default_factory=list)  # [i] = steps where slot i was verified with 0..i-1 accepted
    accepted_at: list[int] = field(default_factory=list)  # [i] = steps where slot i was accepted
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_other: float = 0.0
    lookup: SpecMetrics | None = None  # the lookup proposer's verifications (None: lookup off)

    def __post_init__(self):
        g = self.gamma + 1
        self.histogram = self.histogram or [0] * g
        self.reached = self.reached or [0] * self.gamma
        self.accepted_at = self.accepted_at or [0] * self.gamma

    def record(self, drafted: int, verified: int, accepted: int, source: str = "draft") -> None:
        """One request's step: `source` proposed its `drafted` tokens ("draft", "lookup", or "plain":
        none, one token from the target alone)."""
        if source == "lookup":
            if self.lookup is None:
                raise ValueError("a lookup step recorded by metrics made without lookup")
            self.lookup.record(drafted, verified, accepted)
            return
        if source == "plain" or (drafted == 0 and self.gamma > 0):  # a skipped draft
            self.plain_steps += 1
            return
        self.steps += 1
        self.drafted += drafted
        self.verified += verified
        self.accepted += accepted
        self.histogram[accepted] += 1
        for i in range(min(verified, accepted + 1)):
            self.reached[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: SpecMetrics) -> None:
        if other.gamma != self.gamma:
            raise ValueError("cannot merge metrics of different gamma")
        for name in ("steps", "plain_steps", "drafted", "verified", "accepted", "t_draft", "t_verify", "t_other"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("histogram", "reached", "accepted_at"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        if other.lookup is not None:
            if self.lookup is None:
                self.lookup = SpecMetrics(other.lookup.gamma)
            self.lookup.merge(other.lookup)

    @property
    def mean_accept_length(self) -> float:
        return (self.steps + self.accepted) / self.steps if self.steps else 0.0

    @property
    def conditional(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def marginal(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_at]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    def to_dict(self) -> dict:
        total = self.t_draft + self.t_verify + self.t_other
        out = self._counts()
        if self.lookup is not None:
            # its own verify steps, proposed/verified/accepted tokens and per-position acceptance
            look = self.lookup._counts()
            del look["plain_steps"], look["gamma"]
            look["max_proposed"] = self.lookup.gamma
            out["lookup"] = look
        out["time_s"] = {
            "draft": round(self.t_draft, 4),
            "verify": round(self.t_verify, 4),
            "other": round(self.t_other, 4),
            "total": round(total, 4),
        }
        return out

    def _counts(self) -> dict:
        return {
            "verify_steps": self.steps,
            "plain_steps": self.plain_steps,
            "gamma": self.gamma,
            "drafted_tokens": self.drafted,
            "verified_tokens": self.verified,
            "accepted_tokens": self.accepted,
            "mean_accept_length": round(self.mean_accept_length, 4),
            "draft_acceptance_rate": round(self.draft_acceptance_rate, 4),  # accepted / verified
            "accepted_per_drafted": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "conditional_accept_rates": [round(x, 4) for x in self.conditional],
            "marginal_accept_rates": [round(x, 4) for x in self.marginal],
            "acceptance_length_histogram": list(self.histogram),  # [a] = steps committing a+1 tokens
        }


# A run "looks silently degraded" (docs/DESIGN.md §9) when, once the first draft slot has
# been verified this many times, fewer than this share of those first drafts were accepted.
# Slot 0 rather than the mean acceptance length: a verification policy that trims (threshold,
# adaptive) lowers the length of a healthy draft, never the acceptance of what it verifies.
# A draft that accepts next to nothing (random weights, another target's draft) sits near zero,
# far below a healthy draft even on its worst prompts, so the warning does not fire on hard
# text. Subtler misreads of a weak draft (taps off by one still agree on most of the first
# slots a correct reading gets) are `dspark doctor`'s job.
DEGRADED_AFTER_VERIFIED = 64
DEGRADED_FIRST_SLOT_RATE = 0.05


def degraded(m: SpecMetrics) -> str | None:
    """Why a run's draft looks silently degraded (docs/DESIGN.md §9), or None."""
    if m.steps < DEGRADED_AFTER_VERIFIED:
        return None
    if m.drafted == 0:
        return "the draft proposed no tokens: speculation is silently disabled"
    if m.reached[0] >= DEGRADED_AFTER_VERIFIED and m.conditional[0] < DEGRADED_FIRST_SLOT_RATE:
        return (
            f"only {m.conditional[0]:.0%} of the first draft tokens were accepted over {m.reached[0]} verify steps "
            f"(mean acceptance length {m.mean_accept_length:.2f}, gamma {m.gamma}): the draft looks silently "
            "degraded (layout, layer ids, mask token?); run `dspark doctor`"
        )
    return None
