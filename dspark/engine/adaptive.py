"""The adaptive verification policy: Algorithm 1 on the target's measured cost curve, and the
decision, before each step, whether drafting pays at all (docs/SCHEDULING.md, "Algorithm 1").
`DraftPrior` is what the load-time check measured about the draft, which it starts from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dspark.engine.batch import Batch, Proposal, StepResult
from dspark.engine.calibration import Calibration
from dspark.engine.costs import CostCurve
from dspark.engine.policy import VerifyPolicy, admit, draft_rows
from dspark.errors import DSparkError

EMA = 0.1  # weight of the newest step in the adaptive scheduler's running timings
SKIP_PROBE = 16  # at least this many steps without drafting before one drafts to re-estimate survivals
REALISED_MIN = 16  # verified requests at a depth before its measured acceptance replaces the prediction
SKIP_PROBE_MAX = 256  # a probe that confirms skipping doubles the wait before the next, up to this
# probes may cost at most this share of the time spent decoding plainly: a draft pass dearer than a
# target step waits longer between probes (the first wait is max(SKIP_PROBE, probe cost / share)).
# Probes are most of what a draft that never pays still costs against plain decoding, so the share
# is that cost's budget (docs/SCHEDULING.md, "Algorithm 1").
PROBE_SHARE = 0.0025
# while skipping, the two rates are compared again every RECHECK steps (and after every probe, or
# when the batch changes): between probes they move by running averages only, and a comparison
# before every step would be a visible share of a CPU step
RECHECK = 8


@dataclass(frozen=True)
class DraftPrior:
    """What was measured about the draft before decoding (the load-time check, dspark.api): how
    many drafts greedy verification accepted at each anchor of target-written text, and the wall
    time of one drafting phase (draft pass + context update) at batch 1. An adaptive policy seeded
    with it decides from the first step whether drafting pays, instead of drafting to find out."""

    accepted: np.ndarray  # [N] accepted drafts per anchor, 0..gamma
    gamma: int
    draft_seconds: float
    depth: int | None = None  # the slots drafted when draft_seconds was timed (None: all gamma)
    # what each drafted slot past the first adds to the phase (its head row and walk step): a
    # policy weighing depth 1 against depth 3 must not charge depth 1 for three slots
    slot_seconds: float = 0.0

    def __post_init__(self):
        a = np.asarray(self.accepted)
        if a.ndim != 1 or not len(a) or (a < 0).any() or (a > self.gamma).any():
            raise DSparkError(f"draft prior: accepted counts must be a non-empty 1-d array in [0, {self.gamma}]")
        if not (math.isfinite(self.draft_seconds) and self.draft_seconds > 0):
            raise DSparkError(f"draft prior: draft_seconds must be positive, got {self.draft_seconds!r}")
        if self.depth is not None and not 1 <= self.depth <= self.gamma:
            raise DSparkError(f"draft prior: depth must be 1..{self.gamma} (or None: all), got {self.depth!r}")
        if not (math.isfinite(self.slot_seconds) and self.slot_seconds >= 0):
            raise DSparkError(f"draft prior: slot_seconds must be >= 0, got {self.slot_seconds!r}")

    def first_slot_seconds(self) -> float:
        """The phase at one slot: draft_seconds less the slots past the first it was timed with."""
        return max(0.0, self.draft_seconds - self.slot_seconds * ((self.depth or self.gamma) - 1))

    @property
    def anchors(self) -> int:
        return len(self.accepted)

    def survival(self) -> np.ndarray:
        """[gamma] P(the first j+1 drafts are all accepted), what `realised` holds per depth."""
        a = np.asarray(self.accepted)
        return np.array([float((a > j).mean()) for j in range(self.gamma)])


class AdaptiveScheduler(VerifyPolicy):
    """Algorithm 1 with SPS(B) = 1 / (overhead + draft_scale * curve.step_time(B)).

    overhead = the step's time outside the target forward (draft pass, acceptance, commit),
    which verification length does not change; draft_scale and plain_scale correct the start-up
    profile for the load and context length seen since, one from the forwards of drafting steps,
    one from those of steps that skip drafting: on a shared 2-core machine the profile's 2-token
    point moves against its 1-token point from one start-up to the next, and break-even reads
    their ratio. All are running averages of earlier steps (via `observe`), fixed before the
    current drafts exist, so they cannot leak into losslessness. learn=False keeps overhead 0
    and both scales 1 (the paper's SPS = verify steps per second).

    Admission only trims verification; the draft pass is paid on every drafting step. So before
    a step (`should_draft`) the policy also compares the best expected rate with drafting against
    plain decoding, both from earlier steps, and skips drafting when it does not pay (skip=True).
    """

    name = "adaptive"

    def __init__(
        self,
        curve: CostCurve,
        calibration: Calibration | None = None,
        learn: bool = True,
        skip: bool = True,
        prior: DraftPrior | None = None,
        probe_share: float = PROBE_SHARE,
    ):
        super().__init__(calibration, curve)
        self.curve: CostCurve = curve  # always set: the policy prices every step with it
        self.learn, self.skip, self.probe_share = learn, skip, probe_share
        # overhead: a drafting step's fixed time at depth 1; each slot past the first adds slot_cost
        self.overhead, self.slot_cost = 0.0, 0.0
        # measured forward time / the curve's, for drafting steps and for skipped ones; each kind
        # stands in for the other until it has its own measurement (see `_scale`)
        self._scales: dict[bool, float] = {}
        self._steps = {True: 0, False: 0}  # steps observed of each kind (drafted or not)
        self.plain_overhead: float | None = None  # fixed time of a step that skips drafting
        self.survival: np.ndarray | None = None  # running mean predicted prefix survival per depth [g]
        self.realised: np.ndarray | None = None  # running P(first j+1 drafts accepted | verified), per depth
        self.realised_n: np.ndarray | None = None  # how many verified requests each depth has seen
        self._drafted_seen = 0  # drafting steps behind `overhead` (not counting a prior's draft phase)
        self._skipped = 0  # consecutive steps without drafting
        self._probe_every: int | None = None  # set when skipping starts (_probe_wait)
        self._probing = False  # the last drafting step was a probe between skipped steps
        self._skip_R: int | None = None  # requests at the last comparison that chose skipping
        self._step_times: dict[int, float] = {}  # the curve's step time per batch token count (_step_time)
        self._best_depth: int | None = None  # the depth expected_rates found best (draft_depth)
        self.prior = prior
        if prior is not None:
            self.seed(prior)

    def seed(self, prior: DraftPrior) -> None:
        """Start from the load-time measurement: its acceptance per depth counts as `realised`
        (as many verified requests as it had anchors), its draft phase as the drafting overhead.
        The plain overhead starts at 0 (the prior's draft time already leaves out what both kinds
        of step pay) until the first skipped step measures it; the first drafting step that follows
        a drafting step likewise replaces the draft phase (one that also adds the prompt's or skipped
        steps' positions to the draft context pays that once: `observe` leaves its time out). Later
        steps move them by the usual running averages."""
        self.prior = prior
        s = prior.survival()
        self.survival, self.realised = s.copy(), s.copy()
        self.realised_n = np.full(len(s), prior.anchors, dtype=np.int64)
        self.overhead, self.slot_cost, self._drafted_seen = prior.first_slot_seconds(), prior.slot_seconds, 0
        self.plain_overhead = 0.0

    def sps(self, tokens: int) -> float:
        return 1.0 / (self.overhead + self.draft_scale * self._step_time(tokens))

    def _scale(self, drafted: bool) -> float:
        return self._scales.get(drafted, self._scales.get(not drafted, 1.0))

    @property
    def draft_scale(self) -> float:
        """Measured / profiled time of a drafting step's target forward (running average)."""
        return self._scale(True)

    @property
    def plain_scale(self) -> float:
        """Measured / profiled time of a skipped step's target forward (running average)."""
        return self._scale(False)

    def _step_time(self, tokens: int) -> float:
        """curve.step_time(tokens), looked up once per token count: the policy reads it before and
        after every step, skipped ones included, right after the forward evicted the interpreter's
        working set (docs/history/benchmarks.md, "... what a step that skips drafting still paid")."""
        t = self._step_times.get(tokens)
        if t is None:
            t = self._step_times[tokens] = self.curve.step_time(tokens)
        return t

    def verify_lengths(self, prop: Proposal, batch: Batch) -> torch.Tensor:
        surv = self.survivals(prop)  # [B][g] prefix survivals
        B = len(surv)
        g = len(surv[0]) if B else 0
        mean = [sum(row[j] for row in surv) / B for j in range(g)]
        w = 1.0 if self._probing else EMA  # after many skipped steps the old estimate is stale
        if self.survival is None:
            self.survival = np.array(mean)
        else:  # a step that drafted only the first g slots (draft_depth) updates those
            for j in range(g):
                self.survival[j] = (1 - w) * self.survival[j] + w * mean[j]
        return self._lengths(admit(surv, self.sps), batch)

    def draft_depth(self, batch: Batch) -> int | None:
        """One slot past the depth the last comparison (`expected_rates`) found best: admission
        may still go one deeper on a confident step, and slots past that are not drafted."""
        if self._best_depth is None or self.survival is None:
            return None
        return min(len(self.survival), self._best_depth + 1)

    def expected_rates(self, R: int) -> tuple[float, float]:
        """(committed tokens/s drafting at the best depth, tokens/s without drafting) for R requests,
        from earlier steps' survivals and timings. Runs before every step: plain floats, no arrays
        (depth j verifies R * (1 + j) tokens)."""
        plain = R / self._plain_step(R)
        tau, best, scale = float(R), 0.0, self.draft_scale
        for j, s in enumerate(self.expected_survival().tolist()):
            tau += R * s
            rate = tau / (self.overhead + j * self.slot_cost + scale * self._step_time(R * (j + 2)))
            if rate > best:
                best, self._best_depth = rate, j + 1
        return best, plain

    def plain_seconds(self, tokens: int) -> float:
        """A step without drafting at `tokens` verified tokens, as measured (plain overhead and scale)."""
        return (self.plain_overhead or 0.0) + self.plain_scale * self._step_time(tokens)

    def draft_expectation(self, R: int) -> tuple[float, float] | None:
        if self.survival is None or self.plain_overhead is None:
            return None
        spec, _ = self.expected_rates(R)
        gain = float(sum(self.expected_survival()[: self._best_depth or 1]))
        return (spec if self.skip and self.learn else math.inf), gain

    def break_even(self, R: int = 1) -> float:
        """The first-slot acceptance at which drafting and verifying one slot would commit tokens as
        fast as plain decoding, from the same measured times as `expected_rates`: what a draft must
        reach before it can speed this machine up (above 1: one slot cannot pay here at all)."""
        return (self.overhead + self.draft_scale * self._step_time(2 * R)) / self._plain_step(R) - 1.0

    def _plain_step(self, R: int) -> float:
        """Expected seconds of a step that skips drafting, at R requests."""
        return (self.plain_overhead or 0.0) + self.plain_scale * self._step_time(R)

    def expected_survival(self) -> np.ndarray:
        """[g] prefix survival per depth for the skip rule: what verification actually accepted where
        that is known (REALISED_MIN verified requests), the confidence head's prediction elsewhere.
        An uncalibrated head that promises more than the target grants would otherwise keep a
        losing draft running."""
        if self.survival is None:
            raise RuntimeError("expected_survival() before any survival estimate (no drafting step, no prior)")
        s = self.survival.copy()
        if self.realised is not None and self.realised_n is not None:  # set together
            known = self.realised_n >= REALISED_MIN
            s[known] = self.realised[known]
        return np.minimum.accumulate(s)  # survival cannot grow with depth

    def _probe_wait(self, R: int) -> int:
        """Skipped steps before a probe: at least SKIP_PROBE, and enough that probes cost at most
        `probe_share` of the plain decoding time in between (a probe pays the drafting overhead and
        at least one more verified token per request)."""
        plain_step = self._plain_step(R)
        extra = max(0.0, self.overhead - (self.plain_overhead or 0.0)) + max(
            0.0, self.draft_scale * self._step_time(2 * R) - self.plain_scale * self._step_time(R)
        )
        return max(SKIP_PROBE, math.ceil(extra / (self.probe_share * plain_step)))

    def summary(self, R: int = 1) -> str:
        """One line on what the policy expects at R requests and what it will therefore do first."""
        if self.survival is None or self.plain_overhead is None:
            return "adaptive: nothing measured yet: the first step drafts"
        spec, plain = self.expected_rates(R)
        surv = " ".join(f"{x:.2f}" for x in self.expected_survival()[:4])
        src = "measured while decoding"
        if self.prior is not None:
            at = f" at {self.prior.depth} slot{'s' if self.prior.depth > 1 else ''}" if self.prior.depth else ""
            more = f", +{self.prior.slot_seconds * 1e3:.1f} ms a slot" if self.prior.slot_seconds else ""
            src = (
                f"load-time check, {self.prior.anchors} anchors; draft phase {self.prior.draft_seconds * 1e3:.1f} ms"
                f"{at}{more}"
            )
        need = self.break_even(R)
        even = f"slot 1 breaks even at {need:.2f}" if need <= 1 else "slot 1 cannot break even"
        head = (
            f"adaptive: acceptance by depth {surv} ... ({src}): expected {spec:.0f} tokens/s drafting against "
            f"{plain:.0f} plain ({even})"
        )
        if not (self.skip and self.learn) or spec >= plain:
            return head + ", so it drafts"
        return head + f", so it decodes plainly, drafting once after {self._probe_wait(R)} plain steps to look again"

    def should_draft(self, batch: Batch) -> bool:
        """Draft this step unless earlier steps say drafting costs more than it returns (the draft
        pass is paid whatever is verified). Decided before any draft exists, so a skipped step is
        plain target decoding: exact. After some skipped steps (`_probe_wait`) one drafting step
        (a probe) refreshes the survival estimate (the text may have become predictable); each
        probe that confirms skipping doubles that wait, up to SKIP_PROBE_MAX (or the first wait,
        if longer), so probing costs little."""
        if not (self.skip and self.learn) or self.survival is None or self.plain_overhead is None:
            return True
        R = int(batch.anchors.shape[0])
        # the first skipped step replaced the prior's stand-in plain overhead: compare again at once
        fresh = self._steps[False] == 1 and self._skipped == 1
        if fresh or self._probing or self._skip_R != R or self._skipped % RECHECK == 0:
            spec, plain = self.expected_rates(R)
            if spec >= plain:
                self._skipped, self._probing, self._probe_every, self._skip_R = 0, False, None, None
                return True
            self._skip_R = R
        if self._probe_every is None:
            self._probe_every = self._probe_wait(R)
        if self._probing:  # the probe confirmed it
            self._probing = False
            self._probe_every = min(2 * self._probe_every, max(SKIP_PROBE_MAX, self._probe_every))
        if self._skipped >= self._probe_every:
            self._skipped, self._probing = 0, True
            return True
        self._skipped += 1
        return False

    def _observe_acceptance(self, g: int, verified: list[int], accepted: list[int]) -> None:
        if self.realised is None or self.realised_n is None:  # set together
            self.realised, self.realised_n = np.zeros(g), np.zeros(g, dtype=np.int64)
        for j in range(g):
            seen = [a for v, a in zip(verified, accepted) if v > j]  # plain ints: see `admit`
            if not seen:
                break
            rate = sum(a > j for a in seen) / len(seen)
            w = 1.0 if self.realised_n[j] == 0 else EMA
            self.realised[j] = (1 - w) * self.realised[j] + w * rate
            self.realised_n[j] += len(seen)

    def observe(self, res: StepResult, requests: list) -> None:
        if not self.learn or res.t_verify <= 0:
            return
        fixed = res.t_draft + res.t_other
        verified = res.verified
        rows = draft_rows(res)
        drafted = bool(rows)  # the draft ran: its phase is in t_draft (a lookup step's proposals cost ~0)
        tokens = len(verified) * (1 + max(verified))  # batch_tokens (a plain step verifies no drafts)
        predicted = self._step_time(tokens)
        # clamp: one descheduled step must not make verification look 100x dearer
        ratio = min(4.0, max(0.25, res.t_verify / predicted))
        # the mean of the first steps of a kind, then a running average: one slow first forward
        # must not set the ratio of the two kinds, which decides whether drafting pays
        n = self._steps[drafted] = self._steps[drafted] + 1
        w = max(EMA, 1.0 / n)
        self._scales[drafted] = (1 - w) * self._scales.get(drafted, 0.0) + w * ratio
        if not drafted:  # a skipped step: its fixed time is the plain overhead
            # the first one replaces the stand-in (a drafting step's non-draft part, or a prior's 0)
            w = 1.0 if n == 1 else EMA
            self.plain_overhead = fixed if self.plain_overhead is None else (1 - w) * self.plain_overhead + w * fixed
            return
        if not res.caught_up:  # a catch-up of the prompt or of skipped steps is paid once, not a step
            w = 1.0 if self._drafted_seen == 0 else EMA
            fixed -= self.slot_cost * (res.drafted[rows[0]] - 1)  # as if it had drafted one slot
            self.overhead = (1 - w) * self.overhead + w * fixed
            self._drafted_seen += 1
        self._observe_acceptance(
            max(int(res.drafted[b]) for b in rows),
            [int(res.verified[b]) for b in rows],
            [int(res.accepted[b]) for b in rows],
        )
        if self.plain_overhead is None:  # before any plain step: the part that is not drafting
            self.plain_overhead = res.t_other
