"""Verification policies: how many drafted tokens each request sends to the target.

A policy is a VerifyPolicy: `decode_step` asks it whether to draft at all this step
(`should_draft`), then how many drafts of each request to verify (`verify_lengths`), and the
engine hands it every step's result (`observe`). docs/SCHEDULING.md explains the choices:
- `full`: n = g for every request;
- `threshold`: cut each block before the first slot whose (calibrated) confidence c_k is
  below a threshold;
- `adaptive`: the paper's load-aware scheduler (Algorithm 1, `admit`), which trades expected
  accepted tokens against verify steps per second from the target's profiled cost curve.

Every decision about slot k of a request may read only confidences of slots <= k of that
request (they depend on draft tokens before slot k), never later ones: that is what keeps
verification lossless, and why `admit` stops at the first non-improvement.
"""

from __future__ import annotations

from pathlib import Path

from dspark.engine.adaptive import (
    EMA,
    PROBE_SHARE,
    REALISED_MIN,
    RECHECK,
    SKIP_PROBE,
    SKIP_PROBE_MAX,
    AdaptiveScheduler,
    DraftPrior,
)
from dspark.engine.calibration import Calibration
from dspark.engine.costs import CostCurve, cost_curve_for, warn_if_flat
from dspark.engine.policy import (
    DEFAULT_THRESHOLD,
    POLICIES,
    FullScheduler,
    ThresholdScheduler,
    VerifyPolicy,
    admit,
    batch_tokens,
    draft_rows,
    threshold_lengths,
)
from dspark.errors import DSparkError

# the policies' names as the rest of dspark imports them: the factory below, the interface and
# the policies (engine/policy.py), the adaptive one and its settings (engine/adaptive.py)
__all__ = [
    "DEFAULT_THRESHOLD",
    "EMA",
    "POLICIES",
    "PROBE_SHARE",
    "REALISED_MIN",
    "RECHECK",
    "SKIP_PROBE",
    "SKIP_PROBE_MAX",
    "AdaptiveScheduler",
    "DraftPrior",
    "FullScheduler",
    "ThresholdScheduler",
    "VerifyPolicy",
    "admit",
    "batch_tokens",
    "draft_rows",
    "make_scheduler",
    "threshold_lengths",
]


# ---- factory -----------------------------------------------------------------------------


def make_scheduler(
    name: str,
    target,
    draft=None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    calibration: Calibration | str | Path | None = None,
    curve: CostCurve | str | Path | None = None,
    max_batch: int = 16,
    cache: bool = True,
    learn: bool = True,
    skip: bool = True,
    prior: DraftPrior | None = None,
) -> VerifyPolicy:
    """The `--verify full|threshold|adaptive` policy for a target and its draft.

    calibration: a Calibration or the path of a `dspark calibrate` file (None: raw head).
    curve (adaptive): a CostCurve or its JSON file; None profiles the target (cached on disk).
    max_batch: sizes the profiled grid up to max_batch * (gamma + 1) tokens.
    skip (adaptive): skip drafting on steps where earlier steps say it costs more than it returns.
    prior (adaptive): the load-time measurement of the draft (DraftPrior) to start from.
    """
    if name not in POLICIES:
        raise DSparkError(f"unknown verification policy {name!r} (choose from {', '.join(POLICIES)})")
    if name == "full":
        return FullScheduler()
    if draft is None:
        raise DSparkError(f"verification policy '{name}' needs a draft (this engine decodes without one)")
    if draft.confidence_head is None:
        raise DSparkError(f"verification policy '{name}' needs the draft's confidence head, and this draft has none")
    if calibration is not None and not isinstance(calibration, Calibration):
        calibration = Calibration.load(calibration)
    if calibration is not None:
        calibration.check_gamma(draft.spec.gamma)
    if name == "threshold":
        return ThresholdScheduler(threshold, calibration)
    if curve is None:
        curve = cost_curve_for(target, max_batch * (draft.spec.gamma + 1), cache=cache)
    else:
        curve = curve if isinstance(curve, CostCurve) else CostCurve.load(curve)
        warn_if_flat(curve)
    if prior is not None and prior.gamma != draft.spec.gamma:
        raise DSparkError(f"draft prior measured gamma {prior.gamma}, the draft drafts {draft.spec.gamma}")
    return AdaptiveScheduler(curve, calibration, learn=learn, skip=skip, prior=prior)
