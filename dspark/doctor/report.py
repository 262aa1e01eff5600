"""The doctor's settings, its data (texts, readings) and its report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.bench.paired import slot_weights
from dspark.formats.spec import DraftSpec

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_UNDECIDED = 0, 3, 4
MIN_GAIN = 0.03  # an alternative reading "better" gives this much more tokens per step (tau) ...
ALPHA = 0.01  # ... at this one-sided level, shared by every alternative and every look; and a
# reading is "not better" when a MIN_GAIN advantage is excluded at ALPHA shared by the looks
LL_MIN_GAIN = 0.05  # ... or gives the target's tokens this much more log-probability per slot (nats)
LOW_FIRST_SLOT = 0.05  # first-slot acceptance below this under every reading: barely predicts this target
EMBED_COSINE_MIN = 0.9  # a draft's own embed_tokens copy should be the target's
MAX_MASK_ALTERNATIVES = 3
ANCHOR_CHUNK = 96  # anchors per propose call (bounds the [anchors, rows, context] attention)

BUILTIN_PROMPTS = (
    "Explain step by step how to compute 17 times 23.",
    "Write a short Python function that checks whether a number is prime.",
    "Describe a sunny day at the beach in a few sentences.",
)
HELDOUT_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "prompts" / "heldout.jsonl"
PRETTY_LAYOUT = {"anchor_first": "anchor-first", "bonus_anchor": "bonus-anchor"}
FACTORS = ("layout", "hidden_state_indices", "mask_token_id")


@dataclass
class Budget:
    """How much text the sequential check may write: rounds of doubling size, up to max_tokens."""

    prompts: int = 4  # texts in the first round (then 2x, 4x, ... the first round)
    tokens: int = 64  # tokens the target writes per text
    max_tokens: int = 8192  # bound on the generated tokens over all rounds (the bundled draft's taps lie needs ~3 400)
    # load time: stop once no open alternative leads (by a margin, at z >= quiet_z) on either statistic
    stop_when_quiet: bool = False
    quiet_z: float = 1.0

    def rounds(self) -> list[int]:
        """Texts per round; the number of rounds is the number of looks the test pays for."""
        out, total, k = [], 0, self.prompts
        while total < self.max_tokens:
            k = min(k, math.ceil((self.max_tokens - total) / self.tokens))
            out.append(k)
            total += k * self.tokens
            k = self.prompts * 2 ** len(out)
        return out


# ---- data ------------------------------------------------------------------------------------


@dataclass
class Text:
    """One target-generated sequence and what one target forward over it yields."""

    ids: torch.Tensor  # [T]
    prompt_len: int
    argmax: torch.Tensor  # [T] target argmax at each position (predicts position + 1)
    taps: dict  # tap index -> [T, H] hidden state (input of that layer)


@dataclass
class Reading:
    """One way of reading the draft: the declared DraftSpec with some of FACTORS changed."""

    spec: DraftSpec
    shift: int = 0  # hidden_state_indices = declared + shift
    factors: tuple[str, ...] = ()  # which FACTORS differ from the declared reading
    label: str = ""  # the layout part of the name
    accepted: list = field(default_factory=list)  # per measured text: [anchors] drafts accepted (0..gamma)
    loglik: list = field(default_factory=list)  # per measured text: [anchors, gamma] log q(target token)

    @property
    def name(self) -> str:
        parts = {
            "layout": self.label,
            "hidden_state_indices": f"taps{self.shift:+d}",
            "mask_token_id": f"mask={self.spec.mask_token_id}",
        }
        return " ".join(parts[f] for f in self.factors) or "declared"

    @property
    def key(self) -> tuple:
        return (self.spec.layout, self.spec.query_slots, self.shift, self.spec.mask_token_id)

    @property
    def all_accepted(self) -> torch.Tensor:
        return torch.cat(self.accepted) if self.accepted else torch.zeros(0, dtype=torch.long)

    @property
    def anchors(self) -> int:
        return sum(int(a.numel()) for a in self.accepted)

    @property
    def accept_length(self) -> float:
        """1 + mean accepted drafts: the greedy acceptance length on the measured text."""
        a = self.all_accepted
        return 1.0 + float(a.float().mean()) if a.numel() else 1.0

    @property
    def mean_loglik(self) -> float:
        """Log-probability the draft gives the target's token per slot (teacher-forced; slots
        weighted as in the paired test), nats."""
        if not self.loglik:
            return float("nan")
        return float((torch.cat(self.loglik).double() @ slot_weights(self.spec.gamma)).mean())

    @property
    def per_slot(self) -> list[float]:
        """Conditional acceptance of slot k (accepted / reached), as the engine's metrics report it."""
        a = self.all_accepted
        out = []
        for k in range(self.spec.gamma):
            reached = int((a >= k).sum())
            out.append(int((a > k).sum()) / reached if reached else 0.0)
        return out


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str


@dataclass
class Report:
    target: str
    draft: str
    declared: DraftSpec
    checks: list[Check] = field(default_factory=list)
    readings: list[Reading] = field(default_factory=list)
    comparisons: dict = field(default_factory=dict)  # reading name -> Comparison (vs declared)
    diagnoses: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)
    thresholds: dict = field(default_factory=dict)
    best: Reading | None = None  # the reading that explains a misread file
    fits: dict = field(default_factory=dict)  # taps reading name -> fingerprint.TapFit (declared included)
    found_by: str = ""  # "behaviour" | "weights" (the fingerprint) when misread
    measured: bool = False
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        """ "misread" | "unhealthy" (a static check failed) | "healthy" | "undecided" | "not measured"."""
        if self.diagnoses:
            return "misread"
        if any(c.status == "fail" for c in self.checks):
            return "unhealthy"
        if not self.measured:
            return "not measured"
        open_ = [n for n, c in self.comparisons.items() if c.status != "not better"]
        return "undecided" if open_ else "healthy"

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"

    @property
    def undecided(self) -> list[str]:
        """Alternatives neither shown better nor excluded."""
        return [n for n, c in self.comparisons.items() if c.status == "open"]

    def exit_code(self, strict: bool = False) -> int:
        v = self.verdict
        if v in ("misread", "unhealthy"):
            return EXIT_UNHEALTHY
        if strict and (self.warnings or any(c.status == "warn" for c in self.checks)):
            return EXIT_UNHEALTHY
        if v == "healthy":
            return EXIT_HEALTHY
        return EXIT_UNDECIDED  # undecided, or nothing measured: never "healthy"

    def to_json(self, strict: bool = False) -> dict:
        s = self.declared
        return {
            "target": self.target,
            "draft": self.draft,
            "declared": {
                "format": s.format,
                "layout": s.layout,
                "layout_source": s.layout_source,
                "gamma": s.gamma,
                "block_size": s.block_size,
                "hidden_state_indices": list(s.hidden_state_indices),
                "mask_token_id": s.mask_token_id,
            },
            "text": self.texts,
            "rounds": self.rounds,
            "thresholds": self.thresholds,
            "checks": [vars(c) for c in self.checks],
            "readings": [
                {
                    "name": r.name,
                    "changes": list(r.factors),
                    "layout": r.spec.layout,
                    "gamma": r.spec.gamma,
                    "block_size": r.spec.query_slots,
                    "hidden_state_indices": list(r.spec.hidden_state_indices),
                    "mask_token_id": r.spec.mask_token_id,
                    "anchors": r.anchors,
                    "accept_length": round(r.accept_length, 4),
                    "per_slot_acceptance": [round(x, 4) for x in r.per_slot],
                    "loglik": round(r.mean_loglik, 4) if r.loglik else None,
                    **({"vs_declared": self.comparisons[r.name].to_json()} if r.name in self.comparisons else {}),
                }
                for r in self.readings
            ],
            "explained_by": self.best.name if self.best is not None else None,
            "found_by": self.found_by,
            "fingerprint": {n: f.to_json() for n, f in self.fits.items()},
            "verdict": self.verdict,
            "diagnoses": self.diagnoses,
            "warnings": self.warnings,
            "healthy": self.healthy,
            "seconds": round(self.seconds, 2),
            "exit_code": self.exit_code(strict),
        }
