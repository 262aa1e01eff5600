"""Verification policies: Algorithm 1 against brute force, its invariants, and the paper's
Appendix-A counterexample (why the early stop is what keeps verification lossless)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dspark.engine.batch import Proposal
from dspark.engine.calibration import Calibration
from dspark.engine.costs import CostCurve
from dspark.engine.sampling import draw, rejection_accept
from dspark.engine.scheduler import (
    AdaptiveScheduler,
    DraftPrior,
    FullScheduler,
    ThresholdScheduler,
    admit,
    batch_tokens,
    make_scheduler,
    threshold_lengths,
)
from dspark.errors import DSparkError
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest

# ---- strategies ----------------------------------------------------------------------------
# Confidences are multiples of 1/8: survivals (products) and tau (sums) are then exact in
# float64, so the scheduler and the brute force compare Theta values bit for bit.


@st.composite
def problems(draw, max_r=3, max_g=4):
    R = draw(st.integers(1, max_r))
    g = draw(st.integers(1, max_g))
    conf = np.array(draw(st.lists(st.lists(st.integers(0, 8), min_size=g, max_size=g), min_size=R, max_size=R))) / 8.0
    sps_table = draw(st.lists(st.floats(0.05, 2.0), min_size=R * (1 + g), max_size=R * (1 + g)))
    return conf, (lambda b: sps_table[b - 1])


def sps_of(curve):
    """Verify steps per second of the paper's SPS (no learnt overhead)."""
    return lambda tokens: 1.0 / curve.step_time(tokens)


def theta(surv, n, sps):
    tau = surv.shape[0] + sum(float(surv[r, : n[r]].sum()) for r in range(surv.shape[0]))
    return tau * sps(batch_tokens(np.asarray(n)))


def brute_force(surv, sps, early_stop=True):
    """Best Theta over ALL per-request prefix vectors, grouped by what the chain moves along
    (the depth); then the same stopping rule."""
    R, g = surv.shape
    best: dict[int, float] = {}
    for n in itertools.product(range(g + 1), repeat=R):
        key = max(n)
        best[key] = max(best.get(key, -np.inf), theta(surv, n, sps))
    keys = sorted(best)
    if early_stop:
        k = 0
        while k + 1 in best and best[k + 1] > best[k]:
            k += 1
        return k, best[k]
    k = max(keys, key=lambda key: (best[key], -key))  # first maximum
    return k, best[k]


# ---- Algorithm 1 properties --------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(problems(), st.booleans())
def test_admit_matches_brute_force(problem, early_stop):
    conf, sps = problem
    surv = np.cumprod(conf, axis=1)
    n = admit(surv, sps, early_stop=early_stop)
    k, best = brute_force(surv, sps, early_stop)
    assert int(n.max()) == k
    assert theta(surv, n, sps) == best


@settings(max_examples=200, deadline=None)
@given(problems())
def test_every_request_keeps_its_anchor_and_lengths_are_in_range(problem):
    conf, sps = problem
    n = admit(np.cumprod(conf, axis=1), sps)
    assert n.shape == (conf.shape[0],) and n.dtype == np.int64
    assert ((n >= 0) & (n <= conf.shape[1])).all()
    # the anchors alone are always the starting point: B never drops below one token per request
    assert batch_tokens(n) >= conf.shape[0]


@settings(max_examples=200, deadline=None)
@given(problems(), st.data())
def test_non_anticipation(problem, data):
    """Confidence of slot j depends on draft token j-1. Tokens from slot n_r on are not
    verified, so confidences of slots >= n_r + 1 may be anything: the decision must not move."""
    conf, sps = problem
    n = admit(np.cumprod(conf, axis=1), sps)
    changed = conf.copy()
    for r in range(conf.shape[0]):
        for j in range(int(n[r]) + 1, conf.shape[1]):
            changed[r, j] = data.draw(st.integers(0, 8)) / 8.0
    assert (admit(np.cumprod(changed, axis=1), sps) == n).all()


@settings(max_examples=200, deadline=None)
@given(problems(), st.floats(0.0, 1.0), st.data())
def test_threshold_cuts_at_first_low_confidence_and_ignores_later_slots(problem, thr, data):
    conf, _ = problem
    n = threshold_lengths(conf, thr)
    for r in range(conf.shape[0]):
        assert (conf[r, : n[r]] >= thr).all()
        assert n[r] == conf.shape[1] or conf[r, n[r]] < thr
    changed = conf.copy()
    for r in range(conf.shape[0]):
        for j in range(int(n[r]) + 1, conf.shape[1]):
            changed[r, j] = data.draw(st.integers(0, 8)) / 8.0
    assert (threshold_lengths(changed, thr) == n).all()


def test_global_search_anticipates():
    # Appendix A instance: the later confidence (which depends on the first draft token)
    # flips the global search's decision about the first slot; the early stop never looks.
    sps = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__
    after_a, after_b = np.array([[0.8, 0.8]]), np.array([[0.8, 0.0]])
    assert admit(after_a, sps, early_stop=False)[0] == 2
    assert admit(after_b, sps, early_stop=False)[0] == 0
    assert admit(after_a, sps)[0] == admit(after_b, sps)[0] == 0


def test_flat_curve_verifies_everything():
    flat = CostCurve((1, 64), (0.01, 0.01))
    surv = np.cumprod(np.full((4, 7), 0.1), axis=1)  # hopeless drafts
    assert (admit(surv, sps_of(flat)) == 7).all()


def test_padded_mode_is_not_myopic():
    """Padded cost: the first request to reach depth j pays R tokens; the rest of depth j
    is free. Per-item admission would stop there, depth bundles see the whole gain."""
    curve = CostCurve((1, 64), (0.020, 0.020 + 63 * 0.0006))
    surv = np.cumprod(np.full((8, 4), 0.8), axis=1)
    n = admit(surv, sps_of(curve))
    assert (n == n[0]).all() and n[0] >= 2
    tau = lambda m: 8 + 8 * sum(0.8 ** (i + 1) for i in range(m))  # noqa: E731
    assert tau(int(n[0])) * sps_of(curve)(8 * (1 + int(n[0]))) > tau(0) * sps_of(curve)(8)


# ---- the Appendix-A counterexample, statistically -------------------------------------------

A = 0
P_TARGET = torch.tensor([0.7, 0.3])
Q_DRAFT = torch.tensor([0.5, 0.5])
ALPHA = 0.001  # significance level of every test below (fixed seeds: the outcome is reproducible)
TRIALS = 5000


def first_token_is_a(sps, early_stop: bool, trials: int = TRIALS, seed: int = 0) -> tuple[int, list[int]]:
    """One request, gamma 2, drafts x1, x2 ~ q; c1 = 0.8, c2 = 1 if x1 == A else 0 (so the
    survival of slot 2 is 0.8 after A and 0 after B). Verify with the real rejection sampler."""
    gen = torch.Generator().manual_seed(seed)
    hits, lengths = 0, []
    for _ in range(trials):
        x = [draw(Q_DRAFT, float(torch.rand(1, generator=gen))) for _ in range(2)]
        surv = np.array([[0.8, 0.8 * (1.0 if x[0] == A else 0.0)]])
        n = int(admit(surv, sps, early_stop=early_stop)[0])
        lengths.append(n)
        u = torch.rand(n + 1, generator=gen)
        drafts = torch.tensor(x[:n], dtype=torch.long)
        acc, nxt = rejection_accept(P_TARGET.expand(n + 1, 2), Q_DRAFT.expand(n, 2), drafts, u)
        hits += (x[0] if acc >= 1 else nxt) == A
    return hits, lengths


def test_appendix_a_early_stop_keeps_the_target_distribution():
    sps = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__
    hits, _ = first_token_is_a(sps, early_stop=True)
    assert binomtest(hits, TRIALS, 0.7).pvalue > ALPHA, hits / TRIALS


def test_appendix_a_global_search_is_biased():
    sps = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__
    hits, lengths = first_token_is_a(sps, early_stop=False)
    # verifies only after drawing A (then A is always accepted: p/q = 1.4): P(A) = 0.5 + 0.5 * 0.7
    assert set(lengths) == {0, 2}
    assert binomtest(hits, TRIALS, 0.7).pvalue < ALPHA, hits / TRIALS
    assert abs(hits / TRIALS - 0.85) < 0.03


def test_early_stop_that_does_verify_is_still_exact():
    """Cheaper SPS(2): the early-stop scheduler now verifies slot 1 always and slot 2 only
    after x1 = A; the decision about slot 2 reads only x1, so P(A) is still 0.7."""
    sps = {1: 1.0, 2: 0.6, 3: 0.45}.__getitem__
    hits, lengths = first_token_is_a(sps, early_stop=True, seed=1)
    assert set(lengths) == {1, 2}
    assert binomtest(hits, TRIALS, 0.7).pvalue > ALPHA, hits / TRIALS


# ---- policy objects -------------------------------------------------------------------------------


def _proposal(conf_logits):
    z = torch.tensor(conf_logits, dtype=torch.float32)
    return Proposal(tokens=torch.zeros(z.shape, dtype=torch.long), q=[None] * z.shape[0], conf_logits=z)


class _Batch:
    anchors = torch.zeros(2, dtype=torch.long)


def test_full_and_threshold_policies():
    prop = _proposal([[3.0, 1.0, -1.0, 2.0], [-0.5, 4.0, 4.0, 4.0]])
    assert FullScheduler().verify_lengths(prop, _Batch()).tolist() == [4, 4]
    assert ThresholdScheduler(0.5).verify_lengths(prop, _Batch()).tolist() == [2, 0]
    # a huge temperature at slot 0 lifts sigmoid(-0.5 / t) to just under 0.5, over 0.49
    cal = Calibration((1e6, 1.0, 1.0, 1.0))
    assert ThresholdScheduler(0.49, cal).verify_lengths(prop, _Batch()).tolist() == [2, 4]


def test_adaptive_policy_is_algorithm_1_on_calibrated_survivals():
    z = [[2.0, 0.5, -1.0, 3.0], [0.1, 1.5, 2.5, -2.0]]
    temps = (0.5, 2.0, 1.0, 3.0)
    curve = CostCurve((1, 4, 16), (0.010, 0.011, 0.030))
    sched = AdaptiveScheduler(curve, Calibration(temps), learn=False)
    want = admit(np.cumprod(1 / (1 + np.exp(-np.array(z) / np.array(temps))), axis=1), sps_of(curve))
    assert sched.verify_lengths(_proposal(z), _Batch()).tolist() == want.tolist()


def test_adaptive_learns_overhead_and_scale_from_earlier_steps():
    curve = CostCurve((1, 16), (0.010, 0.020))
    sched = AdaptiveScheduler(curve)

    class Res:
        drafted = torch.tensor([4, 4])
        verified = torch.tensor([3, 1])  # padded: 2 * (1 + 3) = 8 tokens, predicted 0.01467 s
        accepted = torch.tensor([1, 0])
        t_draft, t_other, t_verify = 0.004, 0.001, 0.02933
        caught_up = 0

    sched.observe(Res(), [])
    assert sched.overhead == pytest.approx(0.005)
    assert sched.draft_scale == pytest.approx(2.0, rel=1e-3)
    assert sched.plain_scale == sched.draft_scale  # no skipped step yet: the drafting steps' scale stands in
    Res.t_verify = 100.0  # a descheduled step: clamped at 4x, then averaged in (the mean of the first steps)
    sched.observe(Res(), [])
    assert sched.draft_scale == pytest.approx((2.0 + 4.0) / 2, rel=1e-3)
    for _ in range(20):  # past the first steps: a running average with weight 0.1
        Res.t_verify = 0.02933
        sched.observe(Res(), [])
    before = sched.draft_scale
    Res.t_verify = 100.0
    sched.observe(Res(), [])
    assert sched.draft_scale == pytest.approx(0.9 * before + 0.1 * 4.0, rel=1e-3)
    frozen = AdaptiveScheduler(curve, learn=False)
    frozen.observe(Res(), [])
    assert (frozen.overhead, frozen.draft_scale, frozen.plain_scale) == (0.0, 1.0, 1.0)


def test_adaptive_corrects_a_profile_that_overprices_verification_from_the_steps_it_measures():
    """The start-up profile's 2-token point moves against its 1-token point from one start-up to
    the next on a shared machine; break-even reads their ratio. Drafting steps and skipped steps
    each correct the curve for their own forwards, so a profile that made a 2-token verify look
    20% dearer than one token, where decoding measures 5%, stops hiding a draft that pays."""
    curve = CostCurve((1, 2, 4), (0.010, 0.012, 0.016))  # the profile: 2 tokens 1.2x one
    sched = AdaptiveScheduler(curve)
    sched.seed(DraftPrior(np.array([1] * 29 + [0] * 71), 2, 0.001))  # first slot 0.29

    def step(drafted: bool, t_verify: float) -> SimpleNamespace:
        return SimpleNamespace(
            drafted=torch.tensor([2 if drafted else 0]),
            verified=torch.tensor([1 if drafted else 0]),
            accepted=torch.tensor([0]),
            t_draft=0.001 if drafted else 0.0,
            t_other=0.0,
            t_verify=t_verify,
            caught_up=0,
        )

    R = 1
    # (0.001 + 0.012) / 0.010 - 1: slot 1 must reach 0.3 and the draft's 0.29 does not
    assert sched.break_even(R) == pytest.approx(0.30)
    assert sched.expected_rates(R)[0] < sched.expected_rates(R)[1]
    for _ in range(30):  # decoding measures 10.0 ms plain, 10.5 ms for a 2-token verify
        sched.observe(step(False, 0.010), [])
        sched.observe(step(True, 0.0105), [])
    assert sched.plain_scale == pytest.approx(1.0)
    assert sched.draft_scale == pytest.approx(0.0105 / 0.012)
    assert sched.break_even(R) == pytest.approx((0.001 + 0.0105) / 0.010 - 1, abs=0.02)
    sched.realised[0] = 0.29  # the acceptance it measures: what the prior said
    spec, plain = sched.expected_rates(R)
    assert spec > plain  # now drafting pays


def test_policy_errors_are_clear():
    no_head = Proposal(tokens=torch.zeros(1, 2, dtype=torch.long), q=[None], conf_logits=None)
    with pytest.raises(DSparkError, match="confidence head"):
        ThresholdScheduler(0.5).verify_lengths(no_head, _Batch())
    with pytest.raises(DSparkError, match="threshold"):
        ThresholdScheduler(1.5)
    with pytest.raises(DSparkError, match="temperatures"):
        ThresholdScheduler(0.5, Calibration((1.0, 1.0, 1.0))).verify_lengths(
            _proposal([[0.0, 0.0, 0.0, 0.0]]), _Batch()
        )


def test_make_scheduler(tmp_path):
    from tests.tiny import engine_for, tiny_draft, tiny_target

    model = tiny_target()
    eng = engine_for(model, tiny_draft(model))
    curve = CostCurve((1, 8, 40), (0.001, 0.0012, 0.003))
    assert isinstance(make_scheduler("full", eng.target, eng.draft), FullScheduler)
    thr = make_scheduler("threshold", eng.target, eng.draft, threshold=0.3)
    assert isinstance(thr, ThresholdScheduler) and thr.threshold == 0.3
    path = tmp_path / "cal.json"
    Calibration((1.0, 2.0, 0.5, 1.5)).save(path)
    ada = make_scheduler("adaptive", eng.target, eng.draft, calibration=str(path), curve=curve)
    assert isinstance(ada, AdaptiveScheduler) and ada.calibration.temperatures == (1.0, 2.0, 0.5, 1.5)
    curve_file = tmp_path / "curve.json"
    curve.save(curve_file)
    assert make_scheduler("adaptive", eng.target, eng.draft, curve=curve_file).curve == curve
    with pytest.raises(DSparkError, match="unknown verification policy"):
        make_scheduler("greedy", eng.target, eng.draft)
    Calibration((1.0, 2.0)).save(path)
    with pytest.raises(DSparkError, match="2 temperatures"):
        make_scheduler("threshold", eng.target, eng.draft, calibration=path)
    with pytest.raises(DSparkError, match="needs a draft"):
        make_scheduler("adaptive", eng.target, None, curve=curve)
    no_head = tiny_draft(model, confidence_head=False)
    with pytest.raises(DSparkError, match="confidence head"):
        make_scheduler("threshold", eng.target, no_head)


def test_adaptive_skips_drafting_only_when_it_does_not_pay_and_probes_again():
    """Skip rule: before drafting, compare expected committed tokens/s at the best depth (earlier
    survivals, draft + verify cost) with plain decoding's; a skipped step is plain decoding."""
    from dspark.engine import scheduler as sch

    curve = CostCurve((1, 64), (0.010, 0.010))  # verification cost does not grow with tokens

    def res(drafted, t_draft, t_other=0.001, t_verify=0.010, accepted=0):
        return SimpleNamespace(
            drafted=torch.tensor([drafted] * 2),
            verified=torch.tensor([drafted] * 2),
            accepted=torch.tensor([accepted] * 2),
            t_draft=t_draft,
            t_other=t_other,
            t_verify=t_verify,
            caught_up=0,
        )

    batch = SimpleNamespace(anchors=torch.zeros(2, dtype=torch.long))
    sched = AdaptiveScheduler(curve)
    assert sched.should_draft(batch)  # nothing known yet: draft
    weak = _proposal([[-4.0, -4.0, -4.0]] * 2)  # survival 0.018, 0.0003, ...
    sched.verify_lengths(weak, batch)
    sched.observe(res(3, t_draft=0.030), [])  # the draft pass costs 3x a verify step
    spec, plain = sched.expected_rates(2)
    assert spec == pytest.approx(2 * 1.018 / (0.031 + 0.010), rel=0.02) and plain == pytest.approx(2 / 0.011, rel=0.01)
    assert not sched.should_draft(batch)
    decisions = [sched.should_draft(batch) for _ in range(3500)]
    probes = [i for i, d in enumerate(decisions) if d]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    # a probe costs the 30 ms draft pass over an 11 ms plain step: probes wait until they cost at most
    # PROBE_SHARE of the plain decoding in between, longer than SKIP_PROBE_MAX, and never wait longer
    wait = math.ceil(0.030 / (sch.PROBE_SHARE * 0.011))
    assert wait > sch.SKIP_PROBE_MAX and probes[0] == wait - 1 and set(gaps) == {wait}
    # a cheap probe (here: any share allowed): after SKIP_PROBE skipped steps, each confirmed probe
    # doubling the wait, up to SKIP_PROBE_MAX
    cheap = AdaptiveScheduler(curve, probe_share=1.0)
    cheap.verify_lengths(weak, batch)
    cheap.observe(res(3, t_draft=0.030), [])
    decisions = [cheap.should_draft(batch) for _ in range(1200)]
    probes = [i for i, d in enumerate(decisions) if d]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert probes[0] == sch.SKIP_PROBE and gaps[:4] == [32, 64, 128, 256] and set(gaps[4:]) == {sch.SKIP_PROBE_MAX}
    while not sched.should_draft(batch):
        pass
    sched.verify_lengths(_proposal([[6.0, 6.0, 6.0]] * 2), batch)  # this probe finds the text predictable again
    assert sched.should_draft(batch) and sched._probe_every is None  # the next skipping run starts afresh
    sched.observe(res(0, t_draft=0.0005), [])  # the first skipped step measures the plain overhead
    assert sched.plain_overhead == pytest.approx(0.0015)
    sched.observe(res(0, t_draft=0.0015), [])  # later ones move it by the running average
    assert sched.plain_overhead == pytest.approx(0.9 * 0.0015 + 0.1 * 0.0025)

    good = AdaptiveScheduler(curve)
    good.verify_lengths(_proposal([[6.0, 6.0, 6.0]] * 2), batch)  # survivals ~1: 4 tokens per step
    good.observe(res(3, t_draft=0.005, accepted=3), [])
    assert good.should_draft(batch)

    # a head that promises acceptance the target does not grant: measured acceptance decides
    boastful = AdaptiveScheduler(curve)
    for _ in range(sch.REALISED_MIN // 2):  # 2 requests per step
        boastful.verify_lengths(_proposal([[6.0, 6.0, 6.0]] * 2), batch)
        boastful.observe(res(3, t_draft=0.005, accepted=0), [])
    assert boastful.survival[0] > 0.99 and boastful.expected_survival().tolist() == [0.0, 0.0, 0.0]
    assert not boastful.should_draft(batch)
    assert not AdaptiveScheduler(curve, skip=False).skip
    off = AdaptiveScheduler(curve, skip=False)
    off.verify_lengths(weak, batch)
    off.observe(res(3, t_draft=0.030), [])
    assert off.should_draft(batch)  # --no-skip keeps drafting every step


def test_a_prior_from_the_load_time_check_decides_the_first_step():
    """Seeded with the acceptance the load-time check measured and one timed draft phase, the policy
    knows before any step whether drafting pays: a weak draft is never drafted at the first step, a
    strong one is; later steps move the seeded estimates by running averages only."""
    from dspark.engine import scheduler as sch

    curve = CostCurve((1, 64), (0.010, 0.010))
    batch = SimpleNamespace(anchors=torch.zeros(1, dtype=torch.long))
    weak = DraftPrior(np.array([0, 0, 1, 0, 0, 0, 2, 0] * 4), gamma=3, draft_seconds=0.006)
    assert weak.survival().tolist() == pytest.approx([0.25, 0.125, 0.0])
    sched = AdaptiveScheduler(curve, prior=weak)
    spec, plain = sched.expected_rates(1)
    assert spec == pytest.approx((1 + 0.25 + 0.125) / 0.016) and plain == pytest.approx(1 / 0.010)  # best depth 2
    assert not sched.should_draft(batch)  # no draft pass was ever paid to learn this
    assert "decodes plainly" in sched.summary() and "32 anchors" in sched.summary()
    # what the draft would need: (1 + a) / (6 + 10 ms) = 1 / 10 ms at a = 0.6; with a draft phase
    # longer than a step even a slot always accepted would not pay
    assert sched.break_even() == pytest.approx(0.6) and "slot 1 breaks even at 0.60" in sched.summary()
    slow = AdaptiveScheduler(curve, prior=DraftPrior(np.full(32, 3), gamma=3, draft_seconds=0.011))
    assert slow.break_even() == pytest.approx(1.1) and "slot 1 cannot break even" in slow.summary()
    # the prior's acceptance counts as evidence: one drafting step that accepted everything only nudges
    # it; its draft phase is replaced by the first drafting step's cost (a probe also pays the context
    # update of the skipped steps)
    sched.observe(
        SimpleNamespace(
            drafted=torch.tensor([3]),
            verified=torch.tensor([3]),
            accepted=torch.tensor([3]),
            t_draft=0.030,
            t_other=0.0,
            t_verify=0.010,
            caught_up=0,
        ),
        [],
    )
    assert sched.realised[0] == pytest.approx(0.9 * 0.25 + 0.1) and sched.overhead == pytest.approx(0.030)
    strong = AdaptiveScheduler(curve, prior=DraftPrior(np.full(32, 3), gamma=3, draft_seconds=0.002))
    assert strong.should_draft(batch) and strong.summary().endswith("so it drafts")
    # --always-draft keeps drafting whatever the prior says
    assert AdaptiveScheduler(curve, prior=weak, skip=False).should_draft(batch)
    with pytest.raises(DSparkError, match="accepted counts"):
        DraftPrior(np.array([0, 4]), gamma=3, draft_seconds=0.001)
    with pytest.raises(DSparkError, match="draft_seconds"):
        DraftPrior(np.array([0, 1]), gamma=3, draft_seconds=float("nan"))
    assert sch.AdaptiveScheduler(curve).summary().endswith("the first step drafts")


def test_a_catch_up_of_the_draft_context_is_not_taken_for_what_drafting_costs():
    """The first drafting step after the prompt (or after skipped steps) also adds their positions
    to the draft context: a one-off that must not become the policy's drafting overhead, or one
    such step after a long prompt would stop a draft that pays. Its acceptance still counts. And
    the first skipped step's measured plain overhead is compared at once, not RECHECK steps later."""
    curve = CostCurve((1, 64), (0.010, 0.010))
    batch = SimpleNamespace(anchors=torch.zeros(1, dtype=torch.long))
    prior = DraftPrior(np.array([1, 1, 0, 2] * 8), gamma=3, draft_seconds=0.002)
    sched = AdaptiveScheduler(curve, prior=prior)

    def res(t_draft, caught_up, accepted=1, drafted=1):
        return SimpleNamespace(
            drafted=[drafted],
            verified=[drafted],
            accepted=[accepted] if drafted else [0],
            t_draft=t_draft,
            t_other=0.0,
            t_verify=0.010,
            caught_up=caught_up,
        )

    sched.observe(res(0.050, caught_up=400), [])  # a 400-token prompt's context update
    assert sched.overhead == pytest.approx(0.002) and sched.realised_n[0] == 32 + 1
    sched.observe(res(0.003, caught_up=0), [])  # a step after a drafting step: its cost is learnt
    assert sched.overhead == pytest.approx(0.003)
    sched.observe(res(0.004, caught_up=0), [])
    assert sched.overhead == pytest.approx(0.9 * 0.003 + 0.1 * 0.004)

    # a policy that skipped its first step on the prior's stand-in plain overhead (0) looks again
    # right after that step measured the real one
    weak = AdaptiveScheduler(curve, prior=DraftPrior(np.array([1, 0, 0, 0] * 8), gamma=3, draft_seconds=0.003))
    assert not weak.should_draft(batch)  # 1.25 tokens in 13 ms against 1 in 10 ms
    weak.observe(res(0.004, caught_up=0, drafted=0), [])  # a plain step's own work: 4 ms
    assert weak.should_draft(batch)  # 1.25 in 13 ms beats 1 in 14 ms: compared at once


def test_survivals_are_the_calibrated_confidences_product_and_never_overflow():
    sched = AdaptiveScheduler(CostCurve((1, 64), (0.010, 0.010)), Calibration((0.5, 2.0)))
    z = [[2.0, -1.0], [1000.0, -1000.0], [-800.0, 800.0]]
    with np.errstate(over="ignore"):  # numpy's naive logistic overflows to inf and still ends right
        want = np.cumprod(1 / (1 + np.exp(-np.array(z) / np.array([0.5, 2.0]))), axis=1)
    got = np.array(sched.survivals(_proposal(z)))
    assert np.allclose(got, want, rtol=1e-12, atol=0) and np.isfinite(got).all()


def test_greedy_acceptance_on_ints_matches_the_tensor_rule():
    from dspark.engine.sampling import greedy_accept_ids

    def reference(best, drafts, n):  # the rule in tensor ops: the longest verified matching prefix
        g = drafts.shape[1]
        match = (best[:, :g] == drafts) & (torch.arange(g)[None, :] < n[:, None])
        acc = match.long().cumprod(-1).sum(-1)
        return acc, best.gather(1, acc[:, None]).squeeze(1)

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 4), st.integers(0, 4), st.data())
    def check(B, g, data):
        ints = st.integers(0, 3)  # a small vocabulary: matches happen often
        best = torch.tensor(data.draw(st.lists(st.lists(ints, min_size=g + 1, max_size=g + 1), min_size=B, max_size=B)))
        drafts = torch.tensor(data.draw(st.lists(st.lists(ints, min_size=g, max_size=g), min_size=B, max_size=B)))
        n = torch.tensor(data.draw(st.lists(st.integers(0, g), min_size=B, max_size=B)))
        got, want = greedy_accept_ids(best, drafts.reshape(B, g), n), reference(best, drafts.reshape(B, g), n)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    check()


def test_each_drafted_slot_is_priced_so_a_shallow_step_is_not_charged_for_deep_ones():
    """The prior's phase timed at 3 slots with a cost per slot: depth 1 is charged the phase less
    two slots, so a draft whose deeper slots do not pay their head row still drafts one slot; a
    drafting step at depth d teaches the depth-1 overhead (its time less d - 1 slots)."""
    curve = CostCurve((1, 64), (0.010, 0.010))
    batch = SimpleNamespace(anchors=torch.zeros(1, dtype=torch.long))
    prior = DraftPrior(np.array([1, 1, 0, 2] * 8), gamma=3, draft_seconds=0.006, depth=3, slot_seconds=0.002)
    assert prior.first_slot_seconds() == pytest.approx(0.002)
    sched = AdaptiveScheduler(curve, prior=prior)  # survival .75 .25 0
    spec, plain = sched.expected_rates(1)
    # depth 1: 1.75 tokens in 2 + 10 ms beats depth 2: 2.0 in 4 + 10 ms, and plain's 1 in 10 ms
    assert spec == pytest.approx(1.75 / 0.012) and sched._best_depth == 1 and sched.should_draft(batch)
    assert sched.break_even() == pytest.approx(0.2) and "+2.0 ms a slot" in sched.summary()
    flat = AdaptiveScheduler(curve, prior=DraftPrior(prior.accepted, gamma=3, draft_seconds=0.006, depth=3))
    assert flat.break_even() == pytest.approx(0.6)  # the same phase, every depth charged the whole of it
    sched.observe(
        SimpleNamespace(
            drafted=[2], verified=[2], accepted=[1], t_draft=0.005, t_other=0.0, t_verify=0.010, caught_up=0
        ),
        [],
    )
    assert sched.overhead == pytest.approx(0.003)  # 5 ms at depth 2, less one slot
    with pytest.raises(DSparkError, match="slot_seconds"):
        DraftPrior(np.array([0, 1]), gamma=3, draft_seconds=0.001, slot_seconds=-1.0)


def test_adaptive_drafts_only_as_deep_as_it_could_verify():
    """The depth the skip comparison found best, plus one for a confident step, is all the policy
    asks the draft for; a step that drafted fewer slots updates only their survival."""
    curve = CostCurve((1, 64), (0.010, 0.010))
    batch = SimpleNamespace(anchors=torch.zeros(1, dtype=torch.long))
    prior = DraftPrior(np.array([3, 3, 0, 1] * 8), gamma=5, draft_seconds=0.001)  # survival .75 .5 .5 0 0
    sched = AdaptiveScheduler(curve, prior=prior)
    assert sched.draft_depth(batch) is None  # nothing compared yet: every slot
    sched.expected_rates(1)
    assert sched.draft_depth(batch) == 4  # best depth 3, plus one a confident step may verify
    with pytest.raises(DSparkError, match="depth"):
        DraftPrior(np.array([0, 1]), gamma=5, draft_seconds=0.001, depth=6)
    assert (
        "draft phase 1.0 ms at 2 slots"
        in AdaptiveScheduler(curve, prior=DraftPrior(np.array([0, 1]), gamma=5, draft_seconds=0.001, depth=2)).summary()
    )
    assert sched.should_draft(batch)
    assert sched._best_depth == 3 and sched.draft_depth(batch) == 4
    before = sched.survival.copy()
    prop = SimpleNamespace(conf_logits=torch.full((1, 2), 10.0), tokens=torch.zeros(1, 2, dtype=torch.long))
    n = sched.verify_lengths(prop, batch)
    assert n.tolist() == [2] and sched.survival[2:].tolist() == before[2:].tolist()
    assert sched.survival[0] > before[0]
    assert FullScheduler().draft_depth(batch) is None
