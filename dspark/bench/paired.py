"""Paired comparison of two readings of a draft on the same anchors (used by `dspark doctor`).

The unit is the anchor: one position of target-generated text where a block would start. For
each reading the doctor knows L(i), the number of drafted tokens greedy verification would
accept at anchor i (0..gamma), so the reading's acceptance length on that text is
tau = 1 + mean L. Slot k counts at an anchor only when every earlier slot was accepted, so the
first slots weigh most, as they do for speed.

Two readings are compared on the same anchors and the same number of slots (the smaller
gamma) through the per-anchor difference D(i) = L_alt(i) - L_declared(i). Neighbouring anchors
share text (a block covers gamma positions), so the D(i) are not independent: the standard
error of mean D is a Newey-West (Bartlett) long-run variance with lag 2 x gamma, summed over
texts (texts are independent).

- "better":     z = mean D / se >= z_better and tau_alt / tau_declared - 1 >= min_gain;
- "not better": the alternative is excluded from being min_gain better: with
                E(i) = (1 + L_alt(i)) - (1 + min_gain)(1 + L_declared(i)),
                z_margin = -mean E / se(E) >= z_not_better;
- otherwise "open": more text decides.

The same paired test runs on a second, far less noisy statistic: the draft's log-probability
of the target's tokens over the common slots of each anchor, slot k (from 0) weighted
exp(-k / LL_SLOT_DECAY) (teacher-forced:
the Markov head is fed the target's tokens; `engine.drafting.teacher_forced`). That is the
objective the draft was trained on under its true reading, so a wrong reading costs
likelihood even where it barely moves acceptance (a weak draft whose taps are shifted by one
layer loses under 1% of its tokens per step, but clearly loses likelihood). With margin
ll_min_gain nats per slot (additive): "better" at z >= z_better, "not better" when
E(i) = D(i) - ll_min_gain is excluded from being positive at z_not_better.

An alternative is *better* on either statistic (likelihood only while its acceptance is not
itself clearly worse), *not better* when both exclude it, and open otherwise, with one more
exclusion: an alternative the draft's own objective clearly ranks *below* the declared reading
(its log-probability lower at z >= z_better, the level a finding needs the other way), and whose
acceptance gain is under min_gain, is not better either, once the comparison rests on
MIN_TEXTS_TO_EXCLUDE texts. Acceptance alone could leave it open
indefinitely: on code and math text a healthy file's taps read one layer off gave 1.4% more
tokens per step at z 2.1 after 7 424 anchors (docs/history/benchmarks.md, "Calibration"), too noisy to exclude
a 3% margin, while the likelihood put the declared taps ahead at z 7.9. A misread's true reading is
the one the draft was trained on, so it is the more likely one and this never excludes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch


def z_for(alpha: float, tests: int = 1) -> float:
    """One-sided normal quantile for `alpha` shared (Bonferroni) by `tests` tests."""
    return NormalDist().inv_cdf(1.0 - alpha / max(1, tests))


def p_of(z: float) -> float:
    """One-sided p-value of a z score."""
    return 1.0 - NormalDist().cdf(z) if math.isfinite(z) else (0.0 if z > 0 else 1.0)


def long_run_se(x: torch.Tensor, segments: list[int], lag: int) -> float:
    """Standard error of mean(x) for series made of independent segments (texts), each
    autocorrelated up to `lag` (Bartlett weights 1 - l/(lag+1))."""
    n = int(x.shape[0])
    if n == 0:
        return float("inf")
    d = x.double() - x.double().mean()
    total, start = 0.0, 0
    for m in segments:
        s = d[start : start + m]
        start += m
        total += float((s * s).sum())
        for k in range(1, min(lag, m - 1) + 1):
            total += 2.0 * (1.0 - k / (lag + 1)) * float((s[k:] * s[:-k]).sum())
    return math.sqrt(max(total, 0.0)) / n


@dataclass
class Comparison:
    """One alternative reading against the declared one on their common anchors and slots."""

    anchors: int
    slots: int
    tau_declared: float
    tau_alt: float
    gain: float  # tau_alt / tau_declared - 1
    z: float  # mean (L_alt - L_declared) / se: evidence that the alternative is better at all
    p: float  # one-sided p-value of z
    z_margin: float  # evidence that the alternative is *not* min_gain better
    status: str  # "better" | "not better" | "open": both statistics together
    ll_declared: float = float("nan")  # slot-weighted mean log q(target token), nats per slot
    ll_alt: float = float("nan")
    ll_z: float = 0.0
    ll_z_margin: float = 0.0
    by: str = ""  # which statistic made it "better": "acceptance" | "likelihood" | ""

    @property
    def ll_gain(self) -> float:
        return self.ll_alt - self.ll_declared

    @property
    def ll_p(self) -> float:
        return p_of(self.ll_z)

    def to_json(self) -> dict:
        r = lambda v: round(v, 4) if math.isfinite(v) else (1e9 if v > 0 else -1e9)  # noqa: E731
        return {
            "anchors": self.anchors,
            "slots": self.slots,
            "tau_declared": r(self.tau_declared),
            "tau_alt": r(self.tau_alt),
            "gain": r(self.gain),
            "z": r(self.z),
            "p": float(f"{self.p:.3g}"),
            "z_margin": r(self.z_margin),
            "loglik_declared": r(self.ll_declared),
            "loglik_alt": r(self.ll_alt),
            "loglik_gain": r(self.ll_gain),
            "loglik_z": r(self.ll_z),
            "loglik_z_margin": r(self.ll_z_margin),
            "status": self.status,
            "by": self.by,
        }


# A reading is excluded ("not better") only once the comparison rests on this many texts: the
# long-run variance of a handful of texts is unreliable (a weak draft, tau 1.1-1.2 with mostly zero
# accepted drafts, once had its true reading excluded after 4 texts, 203 anchors).
MIN_TEXTS_TO_EXCLUDE = 8
LL_SLOT_DECAY = 2.0  # the first slots decide speed, and separated misreads best where measured


def slot_weights(slots: int) -> torch.Tensor:
    """[slots] weights summing to 1 that make per-slot log-probabilities one number per anchor."""
    w = torch.exp(-torch.arange(slots, dtype=torch.float64) / LL_SLOT_DECAY)
    return w / w.sum()


def _z_pair(d: torch.Tensor, e: torch.Tensor, segments: list[int], lag: int) -> tuple[float, float]:
    """(z of mean d > 0, z of mean e < 0): the paired test and the margin test on one series."""
    n = int(d.shape[0])
    # floor: one anchor's worth of difference (all-equal samples, e.g. a draft that accepts nothing
    # under every reading, must not look infinitely certain)
    se_d, se_e = max(long_run_se(d, segments, lag), 1.0 / n), max(long_run_se(e, segments, lag), 1.0 / n)
    md, me = float(d.mean()), float(e.mean())
    return md / se_d, -me / se_e


def compare(
    declared: torch.Tensor,
    alt: torch.Tensor,
    segments: list[int],
    slots: int,
    *,
    min_gain: float,
    z_better: float,
    z_not_better: float,
    ll: tuple[torch.Tensor, torch.Tensor] | None = None,
    ll_min_gain: float = 0.0,
) -> Comparison:
    """declared, alt: [n] accepted drafts per anchor (same anchors, in text order); segments: anchors
    per text; ll: (declared, alt) [n, >= slots] log q(target token) per anchor and slot, or None."""
    a = declared.clamp(max=slots).double()
    b = alt.clamp(max=slots).double()
    n = int(a.shape[0])
    if n == 0:
        return Comparison(0, slots, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, "open")
    lag = 2 * slots
    tau_a, tau_b = 1.0 + float(a.mean()), 1.0 + float(b.mean())
    z, zm = _z_pair(b - a, (1.0 + b) - (1.0 + min_gain) * (1.0 + a), segments, lag)
    gain = tau_b / tau_a - 1.0
    acc = "better" if (z >= z_better and gain >= min_gain) else "not better" if zm >= z_not_better else "open"
    if ll is None:
        return Comparison(n, slots, tau_a, tau_b, gain, z, p_of(z), zm, acc, by="acceptance" if acc == "better" else "")
    w = slot_weights(slots)
    la, lb = (x[:, :slots].double() @ w for x in ll)
    lz, lzm = _z_pair(lb - la, (lb - la) - ll_min_gain, segments, lag)
    ll_gain = float((lb - la).mean())
    lik = (
        "better"
        if (lz >= z_better and ll_gain >= ll_min_gain and z > -z_better)
        else "not better"
        if lzm >= z_not_better
        else "open"
    )
    status = "better" if "better" in (acc, lik) else "not better" if acc == lik == "not better" else "open"
    if (
        status == "open"
        and lik == "not better"
        and lz <= -z_better
        and gain < min_gain
        and len(segments) >= MIN_TEXTS_TO_EXCLUDE
    ):
        status = "not better"  # the draft's objective clearly prefers the declared reading (docstring)
    by = "acceptance" if acc == "better" else "likelihood" if lik == "better" else ""
    return Comparison(
        n, slots, tau_a, tau_b, gain, z, p_of(z), zm, status, float(la.mean()), float(lb.mean()), lz, lzm, by
    )
