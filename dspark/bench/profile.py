"""`speculation_profile.json`: a portable summary of how well a draft is accepted.

The keys follow NVIDIA Model-Optimizer's speculation profile (schema 1.0), so tools that read
those profiles (capacity simulators, synthetic rejection samplers) read ours:
- `conditional_accept_rates[i]` = P(draft i+1 accepted | drafts 1..i accepted);
- `marginal_accept_rates[i]`    = P(drafts 1..i+1 all accepted), per verify step;
- `mean_accept_length`          = tokens committed per verify step, bonus included;
- `acceptance_length_histogram` = {acceptance length (1 = no draft accepted): verify steps}.

Unlike Model-Optimizer, which records a failed identity and writes anyway, a profile that
breaks an identity is refused (`ProfileError`): a consumer would silently simulate a draft
that was never measured.
"""

from __future__ import annotations

import math
from pathlib import Path

from dspark.errors import DSparkError
from dspark.jsonfile import write_json

SCHEMA_VERSION = "1.0"
METHOD = "dspark"
MEAN_TOLERANCE = 0.02
# Rates are rounded to 6 decimals when written; monotonicity must survive that rounding.
MONOTONE_SLACK = 1e-6

REQUIRED_KEYS = (
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
)


class ProfileError(DSparkError):
    """The acceptance statistics contradict themselves: the profile is not written."""


def checkpoint_id(path) -> str | None:
    """The last two path components (`org/name`): a published profile must not carry local paths."""
    if not path:
        return None
    parts = [p for p in str(path).replace("\\", "/").split("/") if p]
    return "/".join(parts[-2:]) if parts else None


def rates_from_metrics(m) -> dict:
    """SpecMetrics (or its merge over requests) -> the profile's acceptance block."""
    hist = {str(a + 1): int(n) for a, n in enumerate(m.histogram)}
    return {
        "conditional_accept_rates": [round(x, 6) for x in m.conditional],
        "marginal_accept_rates": [round(x, 6) for x in m.marginal],
        "mean_accept_length": round(m.mean_accept_length, 6),
        "acceptance_length_histogram": hist,
        "num_verify_steps": int(m.steps),
        # False when a scheduler verified fewer drafts than proposed: conditional rates are then
        # conditioned on "verified" too and no longer multiply up to the marginals.
        "full_verification": m.verified == m.gamma * m.steps,
    }


def build_profile(
    metrics,
    *,
    per_request: list,
    draft_checkpoint: dict,
    target_model: dict,
    block_size: int,
    per_category: dict | None = None,
    measurement_conditions: dict | None = None,
    verification_method: str = "longest_prefix",
) -> dict:
    """Assemble and validate a profile from merged SpecMetrics and the per-request SpecMetrics.

    per_category: {name: SpecMetrics merged over that category's requests}.
    """
    per_req = [r.mean_accept_length for r in per_request if r.steps]
    profile = {
        "schema_version": SCHEMA_VERSION,
        "measured": metrics.steps > 0,
        "method": METHOD,
        "draft_checkpoint": draft_checkpoint,
        "target_model": target_model,
        "num_speculative_tokens": int(metrics.gamma),
        "block_size": int(block_size),
        # A block-parallel draft re-plans the whole block when K changes: rates at one K do not
        # extrapolate to another (Model-Optimizer's "measured_per_k").
        "max_supported_k": int(metrics.gamma),
        "accept_length_model": "measured_per_k",
        "verification_method": verification_method,
        **rates_from_metrics(metrics),
        "mean_accept_length_per_request": round(sum(per_req) / len(per_req), 6) if per_req else None,
        "per_category": {
            name: {**rates_from_metrics(m), "num_requests": n} for name, (m, n) in (per_category or {}).items()
        },
        "measurement_conditions": measurement_conditions or {},
    }
    profile["accept_length_by_k"] = {str(metrics.gamma): profile["mean_accept_length"]}
    profile["validation"] = validate_profile(profile)
    return profile


def _check_block(block: dict, k: int, where: str) -> tuple[dict, list[str]]:
    """Identities of one acceptance block (top level or one category). Returns (report, errors)."""
    errors: list[str] = []
    cond, marg = block.get("conditional_accept_rates"), block.get("marginal_accept_rates")
    mean, hist, steps = (
        block.get("mean_accept_length"),
        block.get("acceptance_length_histogram"),
        block.get("num_verify_steps"),
    )
    for name, vec in (("conditional_accept_rates", cond), ("marginal_accept_rates", marg)):
        if not isinstance(vec, list) or len(vec) != k:
            errors.append(f"{where}{name} must be a list of num_speculative_tokens={k} rates, got {vec!r}")
            continue
        bad = [x for x in vec if not (isinstance(x, (int, float)) and math.isfinite(x))]
        if bad:
            errors.append(f"{where}{name} holds non-finite values {bad}")
        elif any(not 0.0 <= x <= 1.0 for x in vec):
            errors.append(f"{where}{name} holds values outside [0, 1] (not a probability): {vec}")
    if errors:
        return {"passed": False}, errors
    assert isinstance(cond, list) and isinstance(marg, list)  # both checked in the loop above
    if not (isinstance(mean, (int, float)) and math.isfinite(mean)):
        return {"passed": False}, [f"{where}mean_accept_length must be a finite number, got {mean!r}"]

    implied = 1.0 + sum(marg)
    delta = abs(implied - mean)
    consistency = {
        "implied_mean_accept_length": round(implied, 6),
        "reported_mean_accept_length": round(mean, 6),
        "abs_delta": round(delta, 6),
        "tolerance": MEAN_TOLERANCE,
        "passed": delta <= MEAN_TOLERANCE,
    }
    if not consistency["passed"]:
        errors.append(
            f"{where}mean_accept_length {mean:.4f} != 1 + sum(marginal_accept_rates) = {implied:.4f} "
            f"(|delta| {delta:.4f} > {MEAN_TOLERANCE})"
        )

    violations = [
        {"position": i, "value": marg[i], "previous": marg[i - 1]}
        for i in range(1, k)
        if marg[i] > marg[i - 1] + MONOTONE_SLACK
    ]
    if violations:
        v = violations[0]
        errors.append(
            f"{where}marginal_accept_rates increase at position {v['position']} "
            f"({v['previous']} -> {v['value']}): a survival function cannot increase"
        )

    # Under full verification P(first i+1 accepted) = prod of conditionals up to i: both
    # vectors must describe one law.
    chain, prod = [], 1.0
    for i in range(k):
        prod *= cond[i]
        chain.append(abs(prod - marg[i]))
    if block.get("full_verification") and max(chain, default=0.0) > MEAN_TOLERANCE:
        i = max(range(k), key=chain.__getitem__)
        errors.append(
            f"{where}conditional and marginal rates disagree at position {i}: "
            f"prod(conditional[:{i + 1}]) differs from marginal by {chain[i]:.4f}"
        )

    hist_report: dict = {"passed": False}
    if not isinstance(hist, dict) or not hist:
        errors.append(f"{where}acceptance_length_histogram must be a non-empty {{length: steps}} object, got {hist!r}")
    else:
        try:
            h = {int(a): int(n) for a, n in hist.items()}
        except (TypeError, ValueError):
            errors.append(f"{where}acceptance_length_histogram keys and counts must be integers, got {hist!r}")
            h = None
        if h is not None:
            total = sum(h.values())
            hist_report = {"histogram_total": total, "num_verify_steps": steps, "passed": total == steps}
            if any(a < 1 or a > k + 1 for a in h) or any(n < 0 for n in h.values()):
                errors.append(f"{where}acceptance_length_histogram needs lengths in 1..{k + 1} and counts >= 0: {hist}")
                hist_report["passed"] = False
            elif total != steps:
                errors.append(
                    f"{where}acceptance_length_histogram sums to {total} steps, but num_verify_steps is {steps}"
                )
            elif total:
                hist_mean = sum(a * n for a, n in h.items()) / total
                hist_report["histogram_mean_accept_length"] = round(hist_mean, 6)
                if abs(hist_mean - mean) > MEAN_TOLERANCE:
                    errors.append(
                        f"{where}acceptance_length_histogram implies a mean of {hist_mean:.4f}, "
                        f"but mean_accept_length is {mean:.4f}"
                    )
                    hist_report["passed"] = False
    report = {
        "mean_consistency": consistency,
        "marginal_monotonicity": {"passed": not violations, "violations": violations},
        "histogram_total": hist_report,
    }
    return report, errors


def validate_profile(profile: dict) -> dict:
    """Check every identity; raise ProfileError listing all failures, else return the validation block."""
    missing = [k for k in REQUIRED_KEYS if k not in profile and k != "validation"]
    if missing:
        raise ProfileError(f"speculation profile lacks keys {missing}")
    k = profile["num_speculative_tokens"]
    if not isinstance(k, int) or k < 1:
        raise ProfileError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    report, errors = _check_block(profile, k, "")
    for name, block in (profile.get("per_category") or {}).items():
        sub, sub_errors = _check_block(block, k, f"per_category[{name!r}].")
        report.setdefault("per_category", {})[name] = sub
        errors += sub_errors
    if errors:
        raise ProfileError("speculation profile refused: " + "; ".join(errors))
    report["passed"] = True
    return report


def write_profile(profile: dict, path) -> Path:
    """Validate (again: the dict may have been edited since it was built), then write atomically."""
    profile = dict(profile)
    profile["validation"] = validate_profile(profile)
    path = Path(path)
    if path.is_dir():
        path = path / "speculation_profile.json"
    return write_json(path, profile, indent=2)
