"""The load-time check (`dspark.api` runs it): the doctor's statistic on a short sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.doctor.check import measure
from dspark.doctor.report import Budget

QUICK_BUDGET = Budget(prompts=4, tokens=64, max_tokens=3072, stop_when_quiet=True)


@dataclass
class QuickCheck:
    """What the load-time check found: warnings (empty: nothing found) and, when it measured, the
    drafts greedy verification accepted at each anchor of the declared reading (what the engine
    will run), which an adaptive policy starts from (scheduler.DraftPrior)."""

    warnings: list[str]
    accepted: torch.Tensor | None = None  # [anchors] 0..gamma


def quick_check(engine, *, budget: Budget | None = None, prompt: str | list[int] | None = None) -> QuickCheck:
    """The doctor's cheap version for load time.

    The same statistic and thresholds as the doctor on a short sample (QUICK_BUDGET) and fewer
    readings (layout x taps, single mask changes). On SmolLM2 with its weak drafts it costs about
    24 s on one Zen 4 core when no alternative leads (8 texts, 732 tokens; docs/BENCHMARKS.md).
    Leaves the engine as it found it."""
    draft = engine.draft
    if draft is None:
        return QuickCheck([])
    out = []
    bad = [n for n, p in draft.named_parameters() if n not in draft.borrowed and not bool(torch.isfinite(p).all())]
    if bad:
        return QuickCheck([f"draft weights hold NaN/inf ({', '.join(bad[:4])}): its proposals are meaningless"])
    if draft.fc.weight.dtype != engine.target.dtype:
        out.append(f"draft runs in {draft.fc.weight.dtype} but the target in {engine.target.dtype}")
    prompts = [prompt] if prompt is not None else None
    budget = budget or QUICK_BUDGET
    report = measure(
        engine.target,
        draft,
        engine.tokenizer,
        eos=engine.eos_token_ids,
        prompts=prompts,
        budget=budget,
        full_grid=False,
    )
    out += [f"LIKELY MISREAD: {d} (run `dspark doctor` for the full check)" for d in report.diagnoses]
    out += report.warnings
    declared = report.readings[0].all_accepted if report.readings else None
    return QuickCheck(out, declared if declared is not None and declared.numel() else None)
