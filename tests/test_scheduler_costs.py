"""The verify cost curve: interpolation, profiling on a real (tiny) HFTarget, the on-disk
cache and its key, and the loud warning on a flat curve."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from dspark.engine import costs
from dspark.engine.costs import CostCurve, cache_path, cost_curve_for, curve_identity, default_grid, profile_cost_curve
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError
from dspark.target.hf import HFTarget

from tests.tiny import engine_for, hf_greedy, tiny_target


def test_interpolation_and_monotone_points():
    c = CostCurve.from_points([16, 1, 4], [0.030, 0.010, 0.009])  # a noisy dip at 4 tokens
    assert c.tokens == (1, 4, 16) and c.seconds == (0.010, 0.010, 0.030)
    assert c.step_time(10) == pytest.approx(0.020)
    assert c.step_time(28) == pytest.approx(0.050)  # past the grid: the last segment's slope
    assert c.step_time(1) == 0.010 and c.step_time(16) == pytest.approx(0.030)
    assert CostCurve((8,), (0.02,)).step_time(100) == 0.02
    assert default_grid(40) == [1, 2, 4, 8, 16, 32, 40] and default_grid(1) == [1]
    for bad in [((), ()), ((1, 1), (0.1, 0.2)), ((0,), (0.1,)), ((1,), (0.0,)), ((1, 2), (0.1,))]:
        with pytest.raises(DSparkError, match="cost curve"):
            CostCurve(*bad)


def test_profile_uses_a_scratch_state_and_leaves_the_target_usable():
    model = tiny_target()
    eng = engine_for(model)
    curve = profile_cost_curve(eng.target, [1, 8, 64], repeats=2, budget_s=5.0)
    assert curve.tokens == (1, 8, 64) and all(s > 0 for s in curve.seconds)
    assert curve.meta["repeats"] == 2 and curve.meta["context"] == costs.PROFILE_CONTEXT
    assert eng.generate([5, 6, 7], SamplingParams(max_new_tokens=8)).output_ids == hf_greedy(model, [5, 6, 7], 8)


def test_profile_respects_its_budget(caplog):
    target = HFTarget(tiny_target())
    curve = profile_cost_curve(target, [1, 2], repeats=100_000, budget_s=0.3)
    assert 1 <= curve.meta["repeats"] < 100_000 and curve.meta["profile_s"] < 1.5
    with caplog.at_level(logging.WARNING, logger="dspark"):
        rough = profile_cost_curve(target, [1, 2], repeats=50, budget_s=0.0)
    assert rough.meta["repeats"] == 1 and "overran" in caplog.text


def test_the_cheap_points_get_their_repeats_when_a_pass_fills_the_budget():
    """One timed pass of a large verify can fill the budget; the 1-token step, which decides whether
    drafting pays at all, must not then rest on one sample (a descheduled one read 2.3x its cost)."""
    import time

    class SlowAtLength:  # a forward of 64 tokens costs 100x one of 1-2 tokens
        device, vocab_size = "cpu", 50

        def new_state(self, batch):
            return None

        def forward(self, state, tokens, counts=None):
            time.sleep(0.002 if tokens.shape[1] < 64 else 0.2)

        forward_argmax = forward

        def commit(self, state, keep):
            pass

    curve = profile_cost_curve(SlowAtLength(), [1, 2, 64], repeats=3, budget_s=0.6)
    assert curve.meta["repeats"] == 3 and curve.meta["repeats_largest"] == 1
    # where a start-up profiles (cost_curve_for), the points that decide break-even take more samples
    more = profile_cost_curve(SlowAtLength(), [1, 2, 64], repeats=3, budget_s=0.8, small_repeats=costs.SMALL_REPEATS)
    assert more.meta["repeats"] == costs.SMALL_REPEATS and more.meta["repeats_largest"] <= 3


def test_cache_round_trip_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "STALE_CURVE", math.inf)  # the keys here; staleness has its own test
    target = HFTarget(tiny_target())
    first = cost_curve_for(target, 16)
    path = tmp_path / "cost-curves"
    assert len(list(path.iterdir())) == 1 and first.meta["cache_file"].startswith(str(path))

    def no_profiling(*a, **k):
        raise AssertionError("profiled although a cached curve exists")

    monkeypatch.setattr(costs, "profile_cost_curve", no_profiling)
    again = cost_curve_for(target, 16)
    assert again.seconds == first.seconds
    with pytest.raises(AssertionError):
        cost_curve_for(target, 16, refresh=True)
    ident = curve_identity(target, default_grid(16))
    for key, value in [
        ("threads", ident["threads"] + 1),
        ("dtype", "bfloat16"),
        ("device", "cuda:0"),
        ("config_sha256", "0" * 64),
        ("grid", [1, 2]),
    ]:
        assert cache_path({**ident, key: value}) != cache_path(ident), key
    bf16 = HFTarget(tiny_target(dtype=torch.bfloat16))
    assert curve_identity(bf16, default_grid(16))["dtype"] == "bfloat16"
    other = HFTarget(tiny_target(layers=2))
    assert curve_identity(other, default_grid(16))["config_sha256"] != ident["config_sha256"]


def test_a_cached_curve_profiled_on_a_busy_machine_is_profiled_again(tmp_path, monkeypatch, caplog):
    """A curve cached while another job ran reads every step slow and nearly flat, and every later
    start drafted where it does not pay: a start whose 1-token step is well under the cached one
    profiles again and rewrites the cache; one slower than the cache (today's load) keeps it."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    target = HFTarget(tiny_target())
    grid = default_grid(16)
    path = cache_path(curve_identity(target, grid))
    ident = curve_identity(target, grid)
    busy = CostCurve(tuple(grid), tuple(10.0 + 0.001 * t for t in grid), {"identity": ident})  # 10 s a step
    busy.save(path)
    with caplog.at_level(logging.INFO, logger="dspark"):
        fresh = cost_curve_for(target, 16)
    assert fresh.step_time(1) < 1.0 and CostCurve.load(path).step_time(1) == fresh.step_time(1)
    assert any("profiled on a busier machine" in r.getMessage() for r in caplog.records)
    quick = CostCurve(tuple(grid), tuple(1e-9 * t for t in grid), {"identity": ident})  # faster than any step now
    quick.save(path)

    def no_profiling(*a, **k):
        raise AssertionError("profiled again although the machine is only slower now")

    monkeypatch.setattr(costs, "profile_cost_curve", no_profiling)
    assert cost_curve_for(target, 16).seconds == quick.seconds


def test_flat_curve_warns_loudly_once(caplog):
    flat = CostCurve((1, 128), (0.020, 0.021))
    with caplog.at_level(logging.WARNING, logger="dspark"):
        assert costs.warn_if_flat(flat)
        assert costs.warn_if_flat(flat)
    msgs = [r.getMessage() for r in caplog.records if "flat" in r.getMessage()]
    assert len(msgs) == 1 and "verify (almost) everything" in msgs[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dspark"):
        assert not costs.warn_if_flat(CostCurve((1, 128), (0.020, 0.060)))
    assert not caplog.records


def test_curve_file_errors(tmp_path):
    with pytest.raises(DSparkError, match="does not exist"):
        CostCurve.load(tmp_path / "none.json")
    (tmp_path / "x.json").write_text('{"format": "something"}')
    with pytest.raises(DSparkError, match="not a cost curve"):
        CostCurve.load(tmp_path / "x.json")
