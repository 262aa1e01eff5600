"""Continuous batching with every verification policy: a request's greedy output never
depends on the batch around it nor on how many drafts were verified; metrics keep drafted,
verified and accepted apart; the batching benchmark runs end to end (tiny models only)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dspark.engine.calibration import Calibration
from dspark.engine.costs import CostCurve
from dspark.engine.metrics import SpecMetrics
from dspark.engine.sampling import SamplingParams
from dspark.engine.scheduler import AdaptiveScheduler, VerifyPolicy, make_scheduler
from dspark.errors import DSparkError
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiny import bigram_draft, engine_for, hf_greedy, tiny_target

V = 96
PROMPTS = [
    [5, 6, 7, 8],
    [9, 10, 11, 12, 13, 14, 15],
    [20, 21],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41],
    [50, 50, 50],
    [60, 61, 62, 63, 64],
    [70],
    [80, 81, 82, 83, 84, 85, 86, 87, 88],
]
MAX_NEW = 40
# (prompt index, max_new_tokens, step at which the request arrives)
JOBS = [(0, 40, 0), (1, 17, 0), (2, 33, 0), (3, 9, 0), (4, 40, 3), (5, 25, 5), (6, 12, 11), (7, 40, 11), (2, 5, 20)]
# Steep enough that the adaptive policy trims at these batch sizes.
STEEP = CostCurve((1, 4, 16, 64), (0.010, 0.012, 0.030, 0.100))


@pytest.fixture(scope="module")
def models():
    """Tiny target + a draft whose Markov head is the target's greedy bigram table: it
    accepts whole blocks inside the target's loops and fails at their edges, so steps end in
    every possible partial accept."""
    model = tiny_target()
    draft = bigram_draft(engine_for(model), extra_prompts=PROMPTS)
    return model, draft


@pytest.fixture(scope="module")
def reference(models):
    """Each prompt decoded alone (full verification), checked against transformers for two."""
    model, draft = models
    out = []
    for p in PROMPTS:
        eng = engine_for(model, draft)
        out.append(eng.generate(p, SamplingParams(max_new_tokens=MAX_NEW)).output_ids)
    for i in (0, 3):
        assert out[i] == hf_greedy(model, PROMPTS[i], MAX_NEW)
    return out


def run_jobs(eng, jobs=JOBS):
    """Requests arrive at their step; the engine admits them between steps (max_batch 3, so
    some also wait in the queue for a free slot)."""
    reqs, step = [None] * len(jobs), 0
    while step == 0 or eng.has_work() or any(r is None for r in reqs):
        for i, (p, n, at) in enumerate(jobs):
            if at == step:
                reqs[i] = eng.add_request(PROMPTS[p], SamplingParams(max_new_tokens=n))
        eng.step()
        step += 1
    return reqs


class Recording(VerifyPolicy):
    """Wraps a policy; remembers every n it returned."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.sent = inner, 0

    def should_draft(self, batch):
        return self.inner.should_draft(batch)

    def verify_lengths(self, prop, batch):
        n = self.inner.verify_lengths(prop, batch)
        assert n.shape == (prop.tokens.shape[0],) and bool(((n >= 0) & (n <= prop.tokens.shape[1])).all())
        self.sent += int(n.sum())
        return n

    def observe(self, res, requests):  # the learning adaptive policy needs it
        self.inner.observe(res, requests)


class RandomLengths(VerifyPolicy):
    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def verify_lengths(self, prop, batch):
        return torch.randint(0, prop.tokens.shape[1] + 1, (prop.tokens.shape[0],), generator=self.gen)


class VerifyNothing(VerifyPolicy):
    def verify_lengths(self, prop, batch):
        return torch.zeros(prop.tokens.shape[0], dtype=torch.long)


POLICIES = {
    "full": lambda eng: make_scheduler("full", eng.target, eng.draft),
    "threshold": lambda eng: make_scheduler(
        "threshold", eng.target, eng.draft, threshold=0.45, calibration=Calibration((0.7, 1.5, 1.0, 3.0))
    ),
    "adaptive-padded": lambda eng: make_scheduler("adaptive", eng.target, eng.draft, curve=STEEP, learn=False),
    # probes at the SKIP_PROBE floor: with the default probe budget this draft, dear next to a tiny target,
    # would draft too rarely in these short requests for the test to see accepts
    "adaptive-learning": lambda eng: AdaptiveScheduler(STEEP, probe_share=1.0),
    "random": lambda eng: RandomLengths(),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_mixed_batch_output_equals_single_request_output(models, reference, policy):
    model, draft = models
    eng = engine_for(model, draft, max_batch=3)
    eng.policy = Recording(POLICIES[policy](eng))
    reqs = run_jobs(eng)
    for (p, n, _), req in zip(JOBS, reqs):
        assert req.output_ids == reference[p][:n], f"prompt {p} (max {n}) differs under {policy}"
        assert req.finish_reason == "length"
    m = eng.metrics
    assert m.verified == eng.policy.sent
    assert m.drafted == m.steps * draft.spec.gamma
    assert m.accepted > 0 and sum(m.histogram[1:-1]) > 0, "the test needs partial accepts to mean anything"
    if policy != "full":
        assert m.verified < m.drafted, f"{policy} never trimmed: the test would prove nothing"


def test_seeded_sampling_does_not_depend_on_the_batch(models):
    model, draft = models
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
    alone = engine_for(model, draft).generate(PROMPTS[1], sp).output_ids
    eng = engine_for(model, draft, max_batch=4)
    others = [eng.add_request(PROMPTS[i], SamplingParams(max_new_tokens=30, temperature=0.8, seed=i)) for i in (0, 3)]
    eng.step()
    eng.step()
    req = eng.add_request(PROMPTS[1], sp)
    eng.run_until_done()
    assert req.output_ids == alone
    assert all(r.finished for r in others)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.data())
def test_trimming_never_inflates_acceptance(gamma, data):
    """Same drafts, same target: per step the full block would accept a_full drafts; a policy
    verifying n accepts min(a_full, n). Against full verification of the same steps, nothing
    per step or per drafted token can go up, and drafted is unchanged."""
    steps = data.draw(st.lists(st.tuples(st.integers(0, gamma), st.integers(0, gamma)), min_size=1, max_size=30))
    full, trimmed = SpecMetrics(gamma), SpecMetrics(gamma)
    for a_full, n in steps:
        full.record(gamma, gamma, a_full)
        trimmed.record(gamma, n, min(a_full, n))
    assert trimmed.drafted == full.drafted == gamma * len(steps)
    assert trimmed.verified == sum(n for _, n in steps)
    assert trimmed.accepted <= full.accepted
    assert trimmed.accepted / trimmed.drafted <= full.accepted / full.drafted
    assert trimmed.mean_accept_length <= full.mean_accept_length
    assert all(t <= f for t, f in zip(trimmed.marginal, full.marginal))
    assert sum(trimmed.histogram) == len(steps)
    assert trimmed.mean_accept_length == pytest.approx(1 + sum(trimmed.marginal))
    # a slot counts as reached only when it was verified: never more than full verification reached
    assert all(t <= f for t, f in zip(trimmed.reached, full.reached))


def test_verifying_nothing_reports_zero_acceptance(models):
    model, draft = models
    eng = engine_for(model, draft, policy=VerifyNothing())
    req = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=10))
    m = req.metrics
    assert req.output_ids == hf_greedy(model, PROMPTS[0], 10)
    assert (m.verified, m.accepted, m.drafted) == (0, 0, m.steps * draft.spec.gamma)
    assert m.draft_acceptance_rate == 0.0 and m.mean_accept_length == 1.0


# ---- benchmark -----------------------------------------------------------------------------------


def test_bench_batching_function(models, monkeypatch):
    from dspark.bench.batching import ARMS, bench_batching

    model, draft = models
    rows = bench_batching(
        engine_for(model, draft),
        PROMPTS[:3],
        concurrency=(1, 2),
        max_new_tokens=6,
        requests_per_level=2,
        curve=STEEP,
        repeats=3,
    )
    assert [(r["concurrency"], r["arm"]) for r in rows] == [(c, a) for c in (1, 2) for a in ARMS]
    for r in rows:
        assert r["output_tokens"] == r["concurrency"] * 2 * 6 and r["repeats"] == 3
        assert r["tokens_per_s"] > 0 and r["mean_accept_length"] >= 1.0
        assert (r["verified_per_step"] == 0) == (r["arm"] == "plain")
        assert 0.0 < r["drafting_steps"] <= 1.0 or r["arm"] == "plain"
    with pytest.raises(DSparkError, match="repeats"):
        bench_batching(engine_for(model, draft), PROMPTS[:1], repeats=0)
    assert rows[0]["vs_plain"] == 1.0
    # an arm whose policy never drafts verified nothing: no acceptance length to report (not 0)
    monkeypatch.setattr(AdaptiveScheduler, "should_draft", lambda self, batch: False)
    never = bench_batching(engine_for(model, draft), PROMPTS[:1], concurrency=(1,), arms=("plain", "adaptive"))
    assert never[1]["drafting_steps"] == 0.0 and never[1]["mean_accept_length"] is None
    full = next(r for r in rows if r["arm"] == "full")
    assert full["verified_per_step"] == full["drafted_per_step"] == draft.spec.gamma


def test_bench_batch_cli(models, tmp_path, capsys):
    from dspark.cli import main
    from dspark.formats.convert import write_deepspec

    model, draft = models
    model.save_pretrained(tmp_path / "target")
    write_deepspec(draft.spec, draft.own_state_dict(), tmp_path / "draft")
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt_ids": p}) for p in PROMPTS[:2]))
    STEEP.save(tmp_path / "curve.json")
    rc = main(
        [
            "bench-batch",
            "--target",
            str(tmp_path / "target"),
            "--draft",
            str(tmp_path / "draft"),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--concurrency",
            "2",
            "--max-new-tokens",
            "4",
            "--requests-per-level",
            "1",
            "--cost-curve",
            str(tmp_path / "curve.json"),
            "--json",
            str(tmp_path / "rows.json"),
        ]
    )
    assert rc == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["arm"] for r in rows] == ["plain", "full", "threshold", "adaptive"]
    assert all(r["output_tokens"] == 8 for r in rows)
    assert "tok/s" in capsys.readouterr().out
    assert main(["bench-batch", "--target", str(tmp_path / "target"), "--concurrency", "0,2"]) == 2
    assert np.isfinite(rows[-1]["tokens_per_s"])


def test_skipped_drafting_steps_are_plain_decoding(models, reference):
    """An adaptive policy that judges drafting not worth it decodes plainly in between its probes:
    same output, the draft's context kept in step (probe steps still accept), counted apart."""
    from dspark.engine.scheduler import SKIP_PROBE_MAX

    class Skipping(AdaptiveScheduler):
        def expected_rates(self, R):
            return 0.0, 1.0

    model, draft = models
    eng = engine_for(model, draft, max_batch=3, policy=Skipping(STEEP, probe_share=1.0))  # probes every SKIP_PROBE+
    reqs = run_jobs(eng)
    for (p, n, _), req in zip(JOBS, reqs):
        assert req.output_ids == reference[p][:n]
    m = eng.metrics
    assert m.plain_steps > m.steps > 1 and m.drafted == m.steps * draft.spec.gamma
    assert m.plain_steps <= SKIP_PROBE_MAX * m.steps  # probes keep coming, ever more rarely
    assert m.accepted > 0  # probes after many plain steps still draft from a correct context
    assert eng.metrics.to_dict()["plain_steps"] == m.plain_steps
