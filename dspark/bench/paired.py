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
        for l in range(1, min(lag, m - 1) + 1):
            total += 2.0 * (1.0 - l / (lag + 1)) * float((s[l:] * s[:-l]).sum())
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
    status: str  # "better" | "not better" | "open"

    def to_json(self) -> dict:
        r = lambda v: round(v, 4) if math.isfinite(v) else (1e9 if v > 0 else -1e9)  # noqa: E731
        return {"anchors": self.anchors, "slots": self.slots, "tau_declared": r(self.tau_declared),
                "tau_alt": r(self.tau_alt), "gain": r(self.gain), "z": r(self.z), "p": float(f"{self.p:.3g}"),
                "z_margin": r(self.z_margin), "status": self.status}


def compare(declared: torch.Tensor, alt: torch.Tensor, segments: list[int], slots: int, *, min_gain: float,
            z_better: float, z_not_better: float) -> Comparison:
    """declared, alt: [n] accepted drafts per anchor (same anchors, in text order); segments: anchors per text."""
    a = declared.clamp(max=slots).double()
    b = alt.clamp(max=slots).double()
    n = int(a.shape[0])
    if n == 0:
        return Comparison(0, slots, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, "open")
    lag = 2 * slots
    d = b - a
    e = (1.0 + b) - (1.0 + min_gain) * (1.0 + a)
    tau_a, tau_b = 1.0 + float(a.mean()), 1.0 + float(b.mean())
    # floor: one anchor's worth of difference (all-equal samples, e.g. a draft that accepts nothing
    # under every reading, must not look infinitely certain)
    se_d, se_e = max(long_run_se(d, segments, lag), 1.0 / n), max(long_run_se(e, segments, lag), 1.0 / n)
    md, me = float(d.mean()), float(e.mean())
    z = md / se_d if se_d > 0 else (0.0 if md == 0 else math.copysign(math.inf, md))
    zm = -me / se_e if se_e > 0 else (0.0 if me == 0 else math.copysign(math.inf, -me))
    gain = tau_b / tau_a - 1.0
    status = "better" if (z >= z_better and gain >= min_gain) else "not better" if zm >= z_not_better else "open"
    return Comparison(n, slots, tau_a, tau_b, gain, z, p_of(z), zm, status)
