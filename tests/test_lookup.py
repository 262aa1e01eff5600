"""Proposals from the text itself (engine/lookup.py): the index, the learned acceptance, the choice
against the draft, and losslessness of a step where requests take different proposers."""

import pytest
import torch
from dspark.engine.batch import join_taps
from dspark.engine.costs import CostCurve
from dspark.engine.drafting import flush_context
from dspark.engine.engine import Engine
from dspark.engine.lookup import (
    FIXED_MIN,
    LOOKUP_MAX,
    MATCH_MAX,
    PRICED_OUT_PROBE,
    LookupIndex,
    LookupProposer,
    LookupStats,
)
from dspark.engine.marks import step_marks
from dspark.engine.metrics import SpecMetrics
from dspark.engine.sampling import SamplingParams
from dspark.engine.scheduler import FullScheduler
from dspark.target.load import make_target

from tests.test_engine import _exact_joint, _flat_target, chi_square_pvalue
from tests.tiny import hf_greedy, tiny_draft, tiny_target

# a verify that costs about what a step does: a lookup proposal pays from a low acceptance
FLAT = CostCurve.from_points([1, 2, 4, 8, 16, 32, 64, 160], [1.0, 1.01, 1.02, 1.04, 1.1, 1.2, 1.5, 2.5])
# verifying a second token costs a whole step: no proposal can pay
STEEP = CostCurve.from_points([1, 2, 4, 8], [1.0, 2.0, 4.0, 8.0])
COPY = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def _engine(model, draft=None, runtime="hf", curve=FLAT, **kw):
    policy = FullScheduler()
    policy.curve = curve
    return Engine(make_target(model, runtime), draft, policy=policy, lookup=LookupProposer(), **kw)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


# ---- the index ---------------------------------------------------------------------------------


def test_the_index_proposes_what_followed_the_longest_suffix_last_time():
    ix = LookupIndex([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    # "1 2 3" occurred at 0..2, followed by 4 9 2 3 ...; the shorter "2 3" last occurred before 5
    assert ix.propose(4) == ([4, 9, 2, 3], 3)
    ix.extend([8])  # "3 8" never occurred, "8" never did: no proposal
    assert ix.propose() == ([], 0)
    ix.extend([1, 2])  # "8 1 2" no, "1 2" last at 9..10, followed by 3 8 1 2
    assert ix.propose(8) == ([3, 8, 1, 2], 2)


def test_the_index_never_matches_the_suffix_itself_and_grows_incrementally():
    assert LookupIndex([4, 5, 6]).propose() == ([], 0)
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 5, (200,), generator=gen).tolist()
    step = LookupIndex(toks[:10])
    for i in range(10, len(toks)):
        whole = LookupIndex(toks[: i + 1])
        step.extend([toks[i]])
        assert step.propose() == whole.propose()
        prop, m = whole.propose()
        if m:  # the match is real and its continuation is what followed it
            suffix = toks[i + 1 - m : i + 1]
            starts = [p for p in range(i + 1 - m) if toks[p : p + m] == suffix]
            assert starts and prop == toks[: i + 1][starts[-1] + m : starts[-1] + m + LOOKUP_MAX]
            assert m == MATCH_MAX or not any(toks[p : p + m + 1] == toks[i - m : i + 1] for p in range(i - m))


def test_the_acceptance_by_match_length_is_learned_from_verification():
    stats = LookupStats()
    prior = stats.conditional(1)[0]
    for _ in range(40):
        stats.record(1, verified=4, accepted=0)  # the first position always rejected
        stats.record(3, verified=4, accepted=4)  # whole proposals accepted
    assert stats.conditional(1)[0] < 0.1 < prior
    # never reached at match length 1: later positions lean on the other lengths' later positions
    assert stats.conditional(1)[1] == stats.pooled(first=False) > 0.9
    assert min(stats.survival(3, 4)) > 0.85
    assert stats.conditional(2)[0] == stats.pooled(first=True) == pytest.approx(0.5, abs=0.05)  # half of firsts held


def test_the_choice_prices_proposals_against_plain_decoding_and_the_draft():
    ix = [LookupIndex(COPY), LookupIndex([1, 2, 3])]  # the second has nothing to copy
    flat, steep = LookupProposer(), LookupProposer()
    plan = flat.plan(ix, FLAT.step_time, None)
    assert plan.tokens[0] == [7, 8, 9, 5, 6, 7, 8, 9][: len(plan.tokens[0])] and plan.tokens[0]
    assert plan.tokens[1] == [] and not plan.draft and plan.match == [4, 0]  # "8 9 5 6" occurred before
    assert not steep.plan(ix, STEEP.step_time, None).any  # a second verified token costs a step
    # drafting expected far faster: the draft runs, and a row takes its lookup only where it expects more
    plan = flat.plan(ix, FLAT.step_time, (1e9, 0.1))
    assert plan.draft and plan.tokens[0] and not plan.tokens[1]
    plan = flat.plan(ix, FLAT.step_time, (1e9, 50.0))
    assert plan.draft and not plan.any
    # drafting slower than the lookup: the lookup takes the step and the draft does not run
    assert not flat.plan(ix, FLAT.step_time, (0.5, 0.1)).draft


def test_a_batch_whose_plans_choose_nothing_skips_planning_for_a_while(monkeypatch):
    """Batches of 2+ requests rarely take a lookup step: after IDLE_PLANS empty plans the next ones
    are skipped (1, 2, 4, ... up to SKIP_MAX between two plans), and the first plan that chooses a
    proposal, or a change of batch size, plans every step again. A request alone is planned every
    step. The index is brought up to date when a plan reads it, whatever was skipped."""
    from dspark.engine import lookup as lk

    calls = []
    real = lk.LookupProposer._plan

    def counted(self, indices, step_seconds, draft_rate):
        calls.append(len(indices))
        return real(self, indices, step_seconds, draft_rate)

    monkeypatch.setattr(lk.LookupProposer, "_plan", counted)
    prop = LookupProposer()
    rows = [LookupIndex([1, 2, 3]), LookupIndex([4, 5, 6])]  # nothing to copy
    made = []
    for step in range(40):
        before = len(calls)
        plan = prop.plan(rows, FLAT.step_time, None)
        made.append(len(calls) > before)
        assert not plan.any and not plan.draft
        for i, ix in enumerate(rows):
            ix.extend([100 + 2 * step + i])
    gaps = [i for i, m in enumerate(made) if m]
    assert gaps[: lk.IDLE_PLANS] == list(range(lk.IDLE_PLANS))  # the first plans all ran
    spaced = [b - a - 1 for a, b in zip(gaps[lk.IDLE_PLANS - 1 :], gaps[lk.IDLE_PLANS :])]
    assert spaced[:4] == [1, 2, 4, 8] and max(spaced) == lk.SKIP_MAX and sum(made) < 12
    # the text turns copyable: planned again within SKIP_MAX + 1 steps, then every step
    for ix in rows:
        ix.extend(COPY)
    waited = next(w for w in range(lk.SKIP_MAX + 2) if prop.plan(rows, FLAT.step_time, None).any)
    assert waited <= lk.SKIP_MAX
    n = len(calls)
    prop.plan(rows, FLAT.step_time, None)
    assert len(calls) == n + 1
    # a request alone: every step planned, however many plans chose nothing
    alone, n = LookupProposer(), len(calls)
    for step in range(20):
        alone.plan([LookupIndex([7, 8, 9 + step])], FLAT.step_time, None)
    assert len(calls) == n + 20
    # the lazily built index equals one built at once
    ix = LookupIndex([1, 2])
    for t in COPY:
        ix.extend([t])
    whole = LookupIndex([1, 2, *COPY])
    assert ix.propose() == whole.propose() and ix.after == whole.after


def test_waiting_taps_join_per_row():
    a = torch.arange(2 * 3 * 1.0).view(2, 3, 1)
    b = 100 + torch.arange(2 * 2 * 1.0).view(2, 2, 1)
    taps, counts = join_taps(a, torch.tensor([1, 3]), b, torch.tensor([2, 1]))
    assert counts.tolist() == [3, 4]
    assert taps[0, :3, 0].tolist() == [0, 100, 101] and taps[1, :4, 0].tolist() == [3, 4, 5, 102]
    taps, counts = join_taps(a, torch.tensor([2, 2]), b, torch.tensor([1, 2]))  # uniform: a slice
    assert counts.tolist() == [3, 4] and taps[1, :4, 0].tolist() == [3, 4, 102, 103]


# ---- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["hf", "native"])
@pytest.mark.parametrize("with_draft", [False, True])
def test_greedy_with_lookup_equals_the_targets_own_decoding_fp32(target, runtime, with_draft):
    draft = tiny_draft(target) if with_draft else None
    engine = _engine(target, draft, runtime)
    prompts = [COPY, [5, 17, 33, 8, 9, 10], [7] * 23 + [3, 88]]
    for prompt in prompts:
        assert engine.generate(prompt, SamplingParams(max_new_tokens=60)).output_ids == hf_greedy(target, prompt, 60)
    look = engine.metrics.lookup
    assert look is not None and look.steps > 0 and 0 < look.accepted < look.verified
    # batched, the requests taking different proposers in one verify: each equals its solo run
    batched = _engine(target, draft, runtime, max_batch=8).generate_many(prompts, SamplingParams(max_new_tokens=60))
    assert [r.output_ids for r in batched] == [hf_greedy(target, p, 60) for p in prompts]


def test_lookup_steps_leave_the_draft_context_exactly_the_committed_tokens(target):
    draft = tiny_draft(target)
    engine = _engine(target, draft)
    engine.add_request(COPY, SamplingParams(max_new_tokens=80, ignore_eos=True))
    engine.add_request([3, 9, 4], SamplingParams(max_new_tokens=80, ignore_eos=True))
    engine._admit()
    engine._admit()
    for _ in range(12):
        engine.step()
    assert engine.metrics.lookup.steps > 0
    flush_context(draft, engine.batch)
    for b, req in enumerate(engine.running):
        committed = req.prompt_ids + req.output_ids[:-1]
        assert int(engine.batch.ctx.lengths[b]) == len(committed)
        clean = engine.target.new_state(1)
        _, taps = engine.target.forward(clean, torch.tensor([committed]))
        ctx = draft.new_context_cache(1, "cpu")  # the dtype decoding keeps it in (bf16 on the kernels)
        draft.extend_context(ctx, taps, torch.tensor([len(committed)]))
        tol = 1e-5 if ctx.layers[0].k.dtype == torch.float32 else 2e-2
        for mine, ref in zip(engine.batch.ctx.select(torch.tensor([b])).valid(), ctx.valid()):
            assert torch.allclose(mine.k.float(), ref.k.float(), atol=tol)
            assert torch.allclose(mine.v.float(), ref.v.float(), atol=tol)


@pytest.mark.parametrize("with_draft", [False, True])
def test_sampling_with_lookup_proposals_is_exact_chi_square(with_draft):
    """A lookup proposal is a point mass: rejection sampling against it reproduces the target's
    joint law of the first 3 tokens (chi-square at 0.001 over 3000 seeded generations)."""
    model = _flat_target()
    draft = tiny_draft(model, gamma=3, markov_rank=4, mask_token_id=5) if with_draft else None
    prompt = [1, 2, 4, 1, 2, 4, 1, 2]  # "1 2" occurred before: the lookup proposes "4 1 2 ..."
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s) for s in range(3000)]
    free = CostCurve.from_points([1, 4096], [1.0, 1.001])  # verification free at any batch: every match proposes
    engine = _engine(model, draft, max_batch=256, curve=free)
    reqs = engine.generate_many([prompt] * len(params), params)
    exact = _exact_joint(model, prompt, params[0], 3)
    look = engine.metrics.lookup
    assert look is not None and 0 < look.accepted < look.verified  # both branches ran
    assert chi_square_pvalue([r.output_ids for r in reqs], exact) > 1e-3


def test_lookup_tokens_are_marked_and_counted_apart_from_the_draft(target):
    engine = _engine(target, tiny_draft(target))
    req = engine.add_request(COPY, SamplingParams(max_new_tokens=40), marks=True)
    engine.run_until_done()
    kinds = {m.kind for m in req.marks}
    assert "lookup" in kinds
    assert all(m.source == "lookup" for m in req.marks if m.kind == "lookup")
    d = req.metrics.to_dict()
    assert d["lookup"]["accepted_tokens"] == sum(m.kind == "lookup" for m in req.marks)
    assert d["lookup"]["max_proposed"] == LOOKUP_MAX and len(d["lookup"]["conditional_accept_rates"]) == LOOKUP_MAX
    # the draft's own counters never see a lookup row
    assert d["accepted_tokens"] == sum(m.kind == "accepted" for m in req.marks)
    assert step_marks(3, [9, 4], 2, 2, 1, [9, 8], [0.9, 0.8], "lookup")[1].kind == "corrected"


def test_metrics_merge_and_refuse_lookup_rows_without_a_lookup_counter():
    a, b = SpecMetrics(2, lookup=SpecMetrics(LOOKUP_MAX)), SpecMetrics(2, lookup=SpecMetrics(LOOKUP_MAX))
    a.record(3, 3, 2, "lookup")
    b.record(5, 4, 4, "lookup")
    b.record(0, 0, 0, "plain")
    a.merge(b)
    assert a.lookup.accepted == 6 and a.lookup.steps == 2 and a.plain_steps == 1 and a.steps == 0
    with pytest.raises(ValueError, match="without lookup"):
        SpecMetrics(2).record(3, 3, 1, "lookup")


def test_a_plain_twin_has_no_lookup(target):
    engine = _engine(target, tiny_draft(target))
    assert engine.derive(speculative=False).lookup is None
    assert engine.derive().lookup is not None and engine.derive(lookup=False).lookup is None


# ---- where a user sees it ----------------------------------------------------------------------


def test_the_server_streams_lookup_marks_and_exports_each_proposer():
    from dspark.serve.app import create_app

    from tests.test_serve import LiveServer, metric, tiny_engine

    base = tiny_engine()
    policy = FullScheduler()
    policy.curve = FLAT
    engine = Engine(base.target, base.draft, base.tokenizer, base.eos_token_ids, policy=policy, lookup=LookupProposer())
    ref = tiny_engine()
    s = LiveServer(create_app(engine, model_name="tiny"))
    try:
        prompt = "one two three four one two three four one two three four one two"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "dspark": {"marks": True}}
        out = s.http.post("/v1/completions", json=body).raise_for_status().json()
        want = ref.generate(ref.encode(prompt), SamplingParams(max_new_tokens=40))
        assert out["choices"][0]["text"] == want.text  # lossless through the server
        kinds = [m["kind"] for m in out["dspark"]["tokens"]]
        m = s.scrape()
        looked = metric(m, "dspark_proposer_verify_steps_total", proposer="lookup")
        assert looked > 0 and metric(m, "dspark_proposer_verify_steps_total", proposer="draft") >= 0
        accepted = metric(m, "dspark_proposer_tokens_total", proposer="lookup", stage="accepted")
        assert accepted == kinds.count("lookup")
        assert metric(m, "dspark_proposer_reached_per_position_total", proposer="lookup", position="0") == looked
        stats = s.http.get("/v1/dspark/stats").raise_for_status().json()
        assert stats["lookup"]["verify_steps"] == looked and stats["lookup"]["accepted_tokens"] == accepted
    finally:
        s.close()


def test_a_server_without_a_draft_speculates_from_the_text_and_says_so():
    """--no-draft's engine (the lookup, no draft) through the server: the model card and the stats
    call it speculative, answers are plain decoding's, the lookup's tokens are counted."""
    from dspark.serve.app import create_app

    from tests.test_serve import LiveServer, tiny_engine

    base = tiny_engine()
    policy = FullScheduler()
    policy.curve = FLAT
    engine = Engine(
        base.target.view(), None, base.tokenizer, base.eos_token_ids, policy=policy, lookup=LookupProposer()
    )
    assert engine.speculative and engine.draft is None
    ref = tiny_engine()
    s = LiveServer(create_app(engine, model_name="tiny"))
    try:
        prompt = "one two three four one two three four one two three four one two"
        out = s.http.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        ).json()
        want = ref.generate(ref.encode(prompt), SamplingParams(max_new_tokens=40))
        assert out["choices"][0]["text"] == want.text and out["speculative"]["lookup"]["verify_steps"] > 0
        assert s.http.get("/v1/models").json()["data"][0]["speculative"] is True
        stats = s.http.get("/v1/dspark/stats").raise_for_status().json()
        assert stats["speculative"] and stats["verify_steps"] == 0 and stats["lookup"]["verify_steps"] > 0
    finally:
        s.close()


def test_the_flag_and_the_config_turn_lookup_off(monkeypatch, tmp_path):
    import argparse

    from dspark.api import EngineConfig
    from dspark.cli.engine_flags import add_engine_flags, engine_config

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_config(p.parse_args([])).lookup is True and EngineConfig().lookup is True
    assert engine_config(p.parse_args(["--no-lookup"])).lookup is False
    assert engine_config(p.parse_args(["--no-draft"])).no_draft is True and EngineConfig().no_draft is False


def test_the_copy_set_is_a_bench_set_apart_from_the_training_prompts():
    from dspark.bench.prompts import COPY, load_sets
    from dspark.train.prompts import load_prompts

    (copy,) = load_sets(None, [COPY], [], None)
    assert len(copy.prompts) >= 10
    trained = {p.key for p in load_prompts("train")} | {p.key for p in load_prompts("heldout")}
    from dspark.train.prompts import Prompt

    assert not {Prompt(t).key for t in copy.prompts} & trained


def _fixed_step(kind: str, fixed: float):
    from types import SimpleNamespace

    look = kind == "lookup"
    return SimpleNamespace(
        drafting=False,
        match=[2] if look else None,
        verified=[1 if look else 0],
        accepted=[1 if look else 0],
        t_draft=fixed / 2,
        t_other=fixed / 2,
        source=lambda b: kind,
    )


def test_a_lookup_steps_own_overhead_is_learned_and_priced():
    """A lookup step pays a few small ops a plain step does not: measured from the steps (their time
    outside the forward) and added to its price, so a proposal that only just paid on the curve
    alone is no longer made."""
    lookup = LookupProposer()
    ix = [LookupIndex(COPY)]
    assert lookup.extra_seconds == 0.0 and lookup.plan(ix, FLAT.step_time, None).any
    # one slow lookup step (a first call) among plain ones is not charged: it would price out every
    # later proposal, and no lookup step would run again to correct it
    for _ in range(FIXED_MIN):
        lookup.observe(_fixed_step("plain", 0.01))
    lookup.observe(_fixed_step("lookup", 9.0))
    assert lookup.extra_seconds == 0.0 and lookup.plan(ix, FLAT.step_time, None).any
    for _ in range(30):
        lookup.observe(_fixed_step("plain", 0.01))
        lookup.observe(_fixed_step("lookup", 9.0))  # far dearer than what the best proposal can win back
    assert lookup.extra_seconds == pytest.approx(8.99, rel=0.05)
    lookup.observe(_fixed_step("lookup", 30.0))  # one slow step (descheduled) does not raise the price
    assert lookup.extra_seconds == pytest.approx(8.99, rel=0.05)
    assert not lookup.plan(ix, FLAT.step_time, None).any
    # a lookup step not taken measures nothing: every PRICED_OUT_PROBE priced-out plans (then twice
    # as many) one is made anyway, to time the extra again; this one stays dear
    made = [lookup.plan(ix, FLAT.step_time, None).any for _ in range(3 * PRICED_OUT_PROBE)]
    assert [i for i, m in enumerate(made) if m] == [PRICED_OUT_PROBE - 2, 3 * PRICED_OUT_PROBE - 2]


def test_first_lookup_steps_slower_than_the_rest_do_not_price_the_lookup_out_for_good():
    """A process's first lookup steps can be slow (cold code paths): charged, they would price out
    every later proposal, and no lookup step would run to measure again. A probe does, and once it
    measures the step's real price the proposals come back."""
    lookup = LookupProposer()
    ix = [LookupIndex(COPY)]
    for _ in range(FIXED_MIN):
        lookup.observe(_fixed_step("lookup", 9.0))
        lookup.observe(_fixed_step("plain", 0.01))
    assert lookup.extra_seconds == pytest.approx(8.99)
    made = [lookup.plan(ix, FLAT.step_time, None).any for _ in range(PRICED_OUT_PROBE)]
    assert made == [False] * (PRICED_OUT_PROBE - 1) + [True]
    lookup.observe(_fixed_step("lookup", 0.02))  # the probe, warm
    assert lookup.extra_seconds == pytest.approx(0.01)
    assert all(lookup.plan(ix, FLAT.step_time, None).any for _ in range(5))
