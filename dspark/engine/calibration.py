"""Sequential Temperature Scaling (STS) of the confidence head (docs/DESIGN.md §6).

The head's c_k = sigmoid(z_k) claims P(slot k accepted | slots < k accepted); schedulers act
on the prefix survival a_k = prod_{i<=k} c_i. Raw heads are miscalibrated (paper: 3-8% ECE
per position), so STS fits one temperature per slot, left to right: t_k is the grid value
minimising the ECE of prod_{i<=k} sigmoid(z_i / t_i) (earlier t_i already fixed) against the
realised prefix acceptance 1[first k drafts all accepted]. Runtime: c_k = sigmoid(z_k / t_k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.jsonfile import read_json, write_json

CALIBRATION_FORMAT = "dspark-calibration"
# log-spaced 0.05..20 plus exactly 1 (the raw head), so "no change" is always a candidate
TEMPERATURE_GRID = np.unique(np.concatenate([np.geomspace(0.05, 20.0, 121), [1.0]]))
ECE_BINS = 15
# Grid points whose ECE is within this of the best are ties, broken by the Brier score: ECE
# alone cannot tell a sharp calibrated head from a flat one whose bins happen to balance.
ECE_TIE = 0.002
MIN_SAMPLES = 20  # fewer labelled samples at a slot: keep its raw temperature (1.0)


@dataclass(frozen=True)
class Calibration:
    temperatures: tuple[float, ...]  # [g] one per drafted slot
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        ts = self.temperatures
        if not ts or any(not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0) for t in ts):
            raise DSparkError(f"calibration temperatures must be a non-empty list of positive numbers, got {list(ts)}")

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def check_gamma(self, gamma: int) -> None:
        if gamma != self.gamma:
            raise DSparkError(
                f"the calibration file has {self.gamma} temperatures but the draft proposes {gamma} tokens per "
                "block: it was fitted for another draft (run `dspark calibrate` for this one)"
            )

    def temperatures_for(self, g: int) -> tuple[float, ...]:
        """The temperatures of the first g slots; g may be below gamma (a step that drafted only
        the first g slots), never above."""
        if g > self.gamma:
            self.check_gamma(g)
        return self.temperatures[:g]

    def confidences(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """conf_logits [B, g] -> calibrated c [B, g] (float64)."""
        t = torch.tensor(self.temperatures_for(conf_logits.shape[-1]), dtype=torch.float64, device=conf_logits.device)
        return torch.sigmoid(conf_logits.double() / t)

    def to_json(self) -> dict:
        return {
            "format": CALIBRATION_FORMAT,
            "version": 1,
            "method": "sequential_temperature_scaling",
            "gamma": self.gamma,
            "temperatures": list(self.temperatures),
            **self.meta,
        }

    def save(self, path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path) -> Calibration:
        data = read_json(path, "calibration")
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise DSparkError(f'{path} is not a calibration file (expected "format": "{CALIBRATION_FORMAT}")')
        temps = data.get("temperatures")
        if not isinstance(temps, list):
            raise DSparkError(f'{path}: "temperatures" must be a list')
        if data.get("gamma") != len(temps):
            raise DSparkError(
                f'{path}: "gamma" ({data.get("gamma")}) differs from the number of temperatures ({len(temps)})'
            )
        meta = {k: v for k, v in data.items() if k not in ("format", "version", "method", "gamma", "temperatures")}
        return cls(tuple(temps), meta)


# ---- labels and metrics (numpy, float64) -------------------------------------------------


def prefix_labels(accepted: np.ndarray, verified: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """accepted, verified [N] -> (y [N, g], known [N, g]).

    y[i, k] = 1 when drafts 0..k were all accepted. It is known when slot k was verified, or
    when an earlier verified draft was rejected (then the prefix died before k); it is unknown
    only past a trimmed block whose every verified draft was accepted.
    """
    k = np.arange(gamma)[None, :]
    a, n = accepted[:, None], verified[:, None]
    y = (a > k).astype(np.float64)
    known = (k < n) | (a < n)
    return y, known


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def ece(pred: np.ndarray, y: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error: equal-width bins on [0, 1], weighted by their share of samples."""
    if pred.size == 0:
        return float("nan")
    idx = np.minimum((pred * bins).astype(np.int64), bins - 1)
    gap = np.abs(np.bincount(idx, weights=pred, minlength=bins) - np.bincount(idx, weights=y, minlength=bins))
    return float(gap.sum() / pred.size)


def auc(pred: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC (Mann-Whitney, ties count half); NaN when only one class is present."""
    pos = int(y.sum())
    neg = y.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(pred, return_inverse=True, return_counts=True)
    # average rank of each distinct value (1-based), then the positives' rank sum
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0
    rank_sum = avg_rank[inverse][y > 0.5].sum()
    return float((rank_sum - pos * (pos + 1) / 2.0) / (pos * neg))


def brier(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((pred - y) ** 2)) if pred.size else float("nan")


def survivals(conf_logits: np.ndarray, temperatures) -> np.ndarray:
    """conf_logits [N, g] -> prefix survivals [N, g] = cumprod of sigmoid(z_k / t_k)."""
    return np.cumprod(sigmoid(conf_logits / np.asarray(temperatures, dtype=np.float64)[None, :]), axis=1)


def position_metrics(conf_logits: np.ndarray, accepted: np.ndarray, verified: np.ndarray, temperatures) -> list[dict]:
    """Per slot k: samples, base rate, ECE / AUC / Brier of the survival a_k against 1[prefix 0..k accepted]."""
    y, known = prefix_labels(accepted, verified, conf_logits.shape[1])
    surv = survivals(conf_logits, temperatures)
    out = []
    for k in range(conf_logits.shape[1]):
        m = known[:, k]
        p, t = surv[m, k], y[m, k]
        out.append(
            {
                "position": k + 1,
                "samples": int(m.sum()),
                "accept_rate": float(t.mean()) if t.size else float("nan"),
                "ece": ece(p, t),
                "auc": auc(p, t),
                "brier": brier(p, t),
            }
        )
    return out


def fit_sts(
    conf_logits: np.ndarray, accepted: np.ndarray, verified: np.ndarray, grid: np.ndarray = TEMPERATURE_GRID
) -> Calibration:
    """conf_logits [N, g], accepted [N], verified [N] (records of full-verification steps) -> Calibration."""
    z = np.asarray(conf_logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise DSparkError(f"calibration needs records of shape [N, gamma] with N > 0, got {list(z.shape)}")
    accepted, verified = np.asarray(accepted), np.asarray(verified)
    y, known = prefix_labels(accepted, verified, z.shape[1])
    prev = np.ones(z.shape[0])  # survival through slot k-1 under the temperatures fitted so far
    temps = []
    for k in range(z.shape[1]):
        m = known[:, k]
        best_t = 1.0
        if m.sum() >= MIN_SAMPLES:
            # [T, N_k] survivals for every candidate temperature at once
            cand = prev[m][None, :] * sigmoid(z[m, k][None, :] / grid[:, None])
            eces = np.array([ece(c, y[m, k]) for c in cand])
            briers = ((cand - y[m, k][None, :]) ** 2).mean(axis=1)
            ties = eces <= eces.min() + ECE_TIE
            best_t = float(grid[ties][np.argmin(briers[ties])])
        temps.append(best_t)
        prev = prev * sigmoid(z[:, k] / best_t)
    return Calibration(tuple(temps))


# ---- collecting records from the engine -----------------------------------------------------


class StepRecorder:
    """Engine step observer: one record per (step, request) of (raw conf logits [g], verified, accepted)."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.logits: list[list[float]] = []
        self.verified: list[int] = []
        self.accepted: list[int] = []

    def observe(self, res, requests) -> None:
        if res.conf_logits is None:
            raise DSparkError("the draft has no confidence head: there is nothing to calibrate")
        z = res.conf_logits.float().cpu().tolist()
        for b, req in enumerate(requests):
            self.request_ids.append(req.id)
            self.logits.append(z[b])
            self.verified.append(int(res.verified[b]))
            self.accepted.append(int(res.accepted[b]))

    def arrays(self, ids: set[str] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(conf_logits [N, g], accepted [N], verified [N]) of the records of `ids` (all when None)."""
        rows = [i for i, r in enumerate(self.request_ids) if ids is None or r in ids]
        z = np.asarray([self.logits[i] for i in rows], dtype=np.float64)
        if not rows:
            z = z.reshape(0, len(self.logits[0]) if self.logits else 0)
        acc = np.asarray([self.accepted[i] for i in rows], dtype=np.int64)
        ver = np.asarray([self.verified[i] for i in rows], dtype=np.int64)
        return z, acc, ver


def record_generations(engine, prompts: list[list[int]], params: list) -> tuple[StepRecorder, list]:
    """Run the prompts with full verification (every slot's acceptance is observed), recording every
    step. The recording engine is derived from `engine` (same target and draft, its own policy and
    metrics): the caller's engine and policy are left as they were."""
    if engine.draft is None:
        raise DSparkError("calibration needs a draft (got an engine without one)")
    if engine.draft.confidence_head is None:
        raise DSparkError("the draft has no confidence head: there is nothing to calibrate")
    rec = StepRecorder()
    recording = engine.derive(lookup=False)  # full verification of the draft's blocks alone
    recording.observers.append(rec)
    return rec, recording.generate_many(prompts, params)
