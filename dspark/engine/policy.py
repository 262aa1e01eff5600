"""The verification policy interface and the two policies without a cost model.

A policy is a VerifyPolicy: `decode_step` asks it whether to draft at all this step
(`should_draft`), how deep (`draft_depth`), then how many drafts of each request to verify
(`verify_lengths`), and the engine hands it every step's result (`observe`). `full` verifies
every drafted token; `threshold` cuts each block before the first slot whose (calibrated)
confidence is below a threshold; `admit` is Algorithm 1, which the adaptive policy
(engine/adaptive.py) runs. docs/SCHEDULING.md explains the choices.

Every decision about slot k of a request may read only confidences of slots <= k of that
request (they depend on draft tokens before slot k), never later ones: that is what keeps
verification lossless, and why `admit` stops at the first non-improvement.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from dspark.engine.batch import Batch, Proposal, StepResult
from dspark.engine.calibration import Calibration
from dspark.engine.costs import CostCurve
from dspark.errors import DSparkError

POLICIES = ("full", "threshold", "adaptive")
DEFAULT_THRESHOLD = 0.5


# ---- Algorithm 1 -------------------------------------------------------------------------


def batch_tokens(n: np.ndarray) -> int:
    """Tokens the target computes to verify n [R] drafts per request: the target runs one padded
    [R, 1 + max n] block (each request also runs its anchor), so R * (1 + max n)."""
    return int(len(n) * (1 + (n.max() if len(n) else 0)))


def admit(surv: np.ndarray | list[list[float]], sps: Callable[[int], float], *, early_stop: bool = True) -> np.ndarray:
    """Algorithm 1: survivals [R, g] (prefix survival of each drafted slot) -> verify lengths n [R].

    Start from the anchors alone (B = R tokens, expected committed tokens tau = R: each
    request commits at least the target's own next token). Admit candidates in survival
    order, each adding its survival to tau and its tokens to B; Theta = tau * SPS(B) is
    expected committed tokens per second. Stop at the first candidate that does not raise
    Theta (early_stop=True, lossless). early_stop=False scans every candidate and keeps the
    best prefix: a global search, whose decision about a slot then depends on later slots'
    confidences and so on the very draft token being verified. That biases the output
    (docs/SCHEDULING.md, tests/test_scheduler.py); it exists to show that, never to decode.

    Candidates are whole depths j = 1..g (slot j of every request at once): the target computes
    R * (1 + max n) tokens anyway (batch_tokens), so once one request verifies depth j every
    other request's slot j is free. The paper's per-(request, slot) candidates price
    B = sum(1 + n_r), which only an engine with variable-length attention computes; judging a
    padded batch that way would stop far too early (docs/SCHEDULING.md). Depths keep the
    admitted set a set of prefixes and read only survivals up to the depth being decided.
    """
    # plain floats: the policy runs this every drafting step, right after a forward evicted the
    # interpreter's working set, where each array op costs several times what it does warm
    rows = surv.tolist() if isinstance(surv, np.ndarray) else surv
    R = len(rows)
    g = len(rows[0]) if R else 0
    depth = 0
    if g:
        tau = float(R)
        best = tau * sps(R)  # batch_tokens: R requests at depth j run R * (1 + j) tokens
        for j in range(g):
            for r in range(R):
                tau += rows[r][j]
            theta = tau * sps(R * (j + 2))
            if theta > best:
                best, depth = theta, j + 1
            elif early_stop:
                break
    return np.full(R, depth, dtype=np.int64)


def threshold_lengths(conf: np.ndarray, threshold: float) -> np.ndarray:
    """conf [R, g] per-slot confidences -> n [R]: slots before the first one below threshold."""
    below = conf < threshold
    return np.where(below.any(axis=1), below.argmax(axis=1), conf.shape[1]).astype(np.int64)


# ---- policies the engine calls ---------------------------------------------------------


class VerifyPolicy:
    """The interface decode_step and the engine call; subclasses decide `verify_lengths`."""

    name = "?"

    def __init__(self, calibration: Calibration | None = None, curve: CostCurve | None = None):
        self.calibration = calibration
        # the target's measured step time by verified tokens: an adaptive policy's own, or given to
        # another policy for the lookup proposer, which prices its proposals with it
        self.curve = curve

    def plain_seconds(self, tokens: int) -> float:
        """Expected seconds of a step that verifies `tokens` target tokens without drafting."""
        if self.curve is None:
            raise DSparkError(f"verification policy '{self.name}' has no cost curve (the lookup proposer needs one)")
        return self.curve.step_time(tokens)

    def draft_expectation(self, R: int) -> tuple[float, float] | None:
        """(committed tokens/s drafting, the draft's expected accepted tokens per request) at R
        requests, when the policy prices drafting; None when it drafts whatever the cost."""
        return None

    def should_draft(self, batch: Batch) -> bool:
        """Before any draft exists: whether this step drafts at all (False: a plain target step)."""
        return True

    def draft_depth(self, batch: Batch) -> int | None:
        """After should_draft: how many slots are worth drafting this step (None: all g). The
        draft head and the Markov walk run once per slot, so slots that will not be verified
        are not drafted."""
        return None

    def verify_lengths(self, prop: Proposal, batch: Batch) -> torch.Tensor:
        """n [B]: how many of each request's drafted tokens the target verifies (0..g)."""
        raise NotImplementedError

    def observe(self, res: StepResult, requests: list) -> None:
        """After the step: its StepResult and the running requests in row order."""

    def confidences(self, prop: Proposal) -> np.ndarray:
        """Proposal -> calibrated per-slot confidences c [B, g] (float64, CPU)."""
        z = self._conf_logits(prop).detach()
        c = self.calibration.confidences(z) if self.calibration is not None else torch.sigmoid(z.double())
        return c.cpu().numpy()

    def _conf_logits(self, prop: Proposal) -> torch.Tensor:
        if prop.conf_logits is None:
            raise DSparkError(
                f"verification policy '{self.name}' needs the draft's confidence head, and this draft has none"
            )
        return prop.conf_logits

    def survivals(self, prop: Proposal) -> list[list[float]]:
        """Proposal -> prefix survivals [B][g] (the product of the calibrated confidences up to each
        slot), as plain floats: what `confidences` gives, without an array op on a few numbers."""
        z = self._conf_logits(prop).tolist()
        g = len(z[0]) if z else 0
        temps = self.calibration.temperatures_for(g) if self.calibration is not None else (1.0,) * g
        out = []
        for row in z:
            acc, surv = 1.0, []
            for v, t in zip(row, temps):
                x = v / t  # a stable logistic: exp never overflows
                acc *= 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
                surv.append(acc)
            out.append(surv)
        return out

    def _lengths(self, n: np.ndarray, batch: Batch) -> torch.Tensor:
        return torch.as_tensor(n, dtype=torch.long).to(batch.anchors.device)

    def __repr__(self) -> str:
        return f"<{self.name} verification>"


class FullScheduler(VerifyPolicy):
    name = "full"

    def verify_lengths(self, prop: Proposal, batch: Batch) -> torch.Tensor:
        B, g = prop.tokens.shape
        return torch.full((B,), g, dtype=torch.long, device=batch.anchors.device)


class ThresholdScheduler(VerifyPolicy):
    name = "threshold"

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, calibration: Calibration | None = None):
        if not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
            raise DSparkError(f"verification threshold must be a probability in [0, 1], got {threshold!r}")
        super().__init__(calibration)
        self.threshold = float(threshold)

    def verify_lengths(self, prop: Proposal, batch: Batch) -> torch.Tensor:
        return self._lengths(threshold_lengths(self.confidences(prop), self.threshold), batch)


def draft_rows(res: StepResult) -> list[int]:
    """The rows of a step result whose tokens the draft proposed (the others: lookup or none)."""
    sources = getattr(res, "sources", None)
    if sources is not None:
        return [b for b, s in enumerate(sources) if s == "draft"]
    return [b for b, d in enumerate(res.drafted) if d > 0]
