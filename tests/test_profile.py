"""Issue 7: speculation_profile.json is written only when its identities hold."""

from __future__ import annotations

import copy
import json

import pytest
from dspark.bench.profile import ProfileError, build_profile, checkpoint_id, validate_profile, write_profile
from dspark.engine.metrics import SpecMetrics

# (verified, accepted) per verify step of three requests, gamma 3
STEPS = [[(3, 0), (3, 1), (3, 3), (3, 2)], [(3, 3), (3, 0)], [(3, 1), (3, 3), (3, 3), (3, 0), (3, 2)]]


def _metrics(steps_per_request, gamma=3):
    reqs = []
    for steps in steps_per_request:
        m = SpecMetrics(gamma)
        for verified, accepted in steps:
            m.record(gamma, verified, accepted)
        reqs.append(m)
    total = SpecMetrics(gamma)
    for m in reqs:
        total.merge(m)
    return total, reqs


def _profile(steps=STEPS):
    total, reqs = _metrics(steps)
    return build_profile(
        total,
        per_request=reqs,
        block_size=3,
        draft_checkpoint={"id": checkpoint_id("/home/me/ckpts/org/my-draft")},
        target_model={"id": "org/target", "dtype": "bf16"},
        per_category={"a": (reqs[0], 1), "b": _merged(reqs[1:])},
        measurement_conditions={"temperature": 0.0},
    )


def _merged(reqs):
    m = SpecMetrics(reqs[0].gamma)
    for r in reqs:
        m.merge(r)
    return m, len(reqs)


def test_consistent_profile_is_built_written_and_read_back(tmp_path):
    p = _profile()
    # 11 steps; accepted counts 0:3, 1:2, 2:2, 3:4 -> lengths 1..4
    assert p["acceptance_length_histogram"] == {"1": 3, "2": 2, "3": 2, "4": 4}
    assert p["num_verify_steps"] == 11
    assert p["marginal_accept_rates"] == pytest.approx([8 / 11, 6 / 11, 4 / 11], abs=1e-6)
    assert p["conditional_accept_rates"] == pytest.approx([8 / 11, 6 / 8, 4 / 6], abs=1e-6)
    assert p["mean_accept_length"] == pytest.approx(1 + 18 / 11, abs=1e-6)
    # per request: mean of each request's own tau (not the per-step mean)
    per_req = [(4 + 6) / 4, (2 + 3) / 2, (5 + 9) / 5]
    assert p["mean_accept_length_per_request"] == pytest.approx(sum(per_req) / 3, abs=1e-6)
    assert p["draft_checkpoint"]["id"] == "org/my-draft"  # no local path in a published file
    assert p["validation"]["passed"] and p["validation"]["mean_consistency"]["passed"]
    assert set(p["per_category"]) == {"a", "b"} and p["per_category"]["b"]["num_requests"] == 2
    for key in (
        "method",
        "draft_checkpoint",
        "target_model",
        "num_speculative_tokens",
        "block_size",
        "verification_method",
        "conditional_accept_rates",
        "marginal_accept_rates",
        "mean_accept_length",
        "mean_accept_length_per_request",
        "acceptance_length_histogram",
        "per_category",
        "measurement_conditions",
        "validation",
    ):
        assert key in p
    path = write_profile(p, tmp_path)
    assert path.name == "speculation_profile.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(p))


def _refused(tmp_path, p, match):
    with pytest.raises(ProfileError, match=match):
        write_profile(p, tmp_path / "speculation_profile.json")
    assert not list(tmp_path.iterdir())  # nothing written, not even a temporary file


def test_mean_that_contradicts_the_marginals_is_refused(tmp_path):
    p = _profile()
    p["mean_accept_length"] += 0.05  # beyond the 0.02 tolerance
    _refused(tmp_path, p, r"1 \+ sum\(marginal_accept_rates\)")
    p = _profile()
    p["mean_accept_length"] += 0.015  # within tolerance: accepted
    validate_profile(p)


def test_increasing_marginals_are_refused(tmp_path):
    p = _profile()
    m = p["marginal_accept_rates"]
    m[1], m[2] = m[2], m[1]  # same sum, so only monotonicity can catch it
    _refused(tmp_path, p, "increase at position 2")


def test_histogram_that_does_not_count_the_steps_is_refused(tmp_path):
    p = _profile()
    p["num_verify_steps"] += 1
    _refused(tmp_path, p, "sums to 11 steps, but num_verify_steps is 12")
    p = _profile()
    p["acceptance_length_histogram"]["5"] = 1  # a length gamma 3 cannot produce
    p["num_verify_steps"] += 1
    _refused(tmp_path, p, "lengths in 1..4")
    p = _profile()
    h = p["acceptance_length_histogram"]
    h["1"], h["4"] = h["4"], h["1"]  # same total, another mean
    _refused(tmp_path, p, "histogram implies a mean")


def test_conditional_rates_must_multiply_to_the_marginals_under_full_verification(tmp_path):
    p = _profile()
    p["conditional_accept_rates"][1] = 0.5
    _refused(tmp_path, p, "disagree at position 1")


def test_partial_verification_conditionals_are_not_chained():
    """With a scheduler verifying fewer drafts, conditional rates are also conditioned on
    'verified', so their product exceeds the marginal: not an error."""
    steps = [[(1, 1), (3, 3), (2, 0), (3, 1)], [(3, 2), (1, 0)]]
    p = _profile(steps)
    assert p["full_verification"] is False
    chained = p["conditional_accept_rates"][0] * p["conditional_accept_rates"][1]
    assert chained > p["marginal_accept_rates"][1] + 0.05
    assert p["validation"]["passed"]


def test_bad_values_and_missing_keys_are_refused(tmp_path):
    for edit, match in (
        (lambda p: p["marginal_accept_rates"].__setitem__(0, float("nan")), "non-finite"),
        (lambda p: p["conditional_accept_rates"].__setitem__(0, 1.3), "outside"),
        (lambda p: p["marginal_accept_rates"].pop(), "list of num_speculative_tokens=3"),
        (lambda p: p.pop("target_model"), "lacks keys"),
        (lambda p: p["per_category"]["a"].__setitem__("mean_accept_length", 3.9), r"per_category\['a'\]"),
    ):
        p = copy.deepcopy(_profile())
        edit(p)
        _refused(tmp_path, p, match)


def test_building_from_inconsistent_counters_raises():
    total, reqs = _metrics(STEPS)
    total.steps += 2  # counters that no run could produce: more steps than histogram entries
    with pytest.raises(ProfileError):
        build_profile(total, per_request=reqs, block_size=3, draft_checkpoint={}, target_model={})
