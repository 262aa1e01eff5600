"""The fuzzing budgets of the hypothesis tests: each property runs at the default suite's budget
and, under the `slow` marker, at 2 000 examples (docs/RELIABILITY.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

SLOW_EXAMPLES = 2000


def budgets(fast: settings) -> list:
    """pytest params: `fast` as it is, and `fast` at SLOW_EXAMPLES in the slow suite."""
    return [
        pytest.param(fast, id="fast"),
        pytest.param(settings(fast, max_examples=SLOW_EXAMPLES), id="slow", marks=pytest.mark.slow),
    ]


def holds(budget: settings, strategy, check) -> None:
    """check(example) for the examples hypothesis draws from strategy within budget (what check
    returns is dropped: hypothesis wants None)."""

    def run(example) -> None:
        check(example)

    budget(given(strategy)(run))()
