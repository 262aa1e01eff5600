"""Start-up steps that say what they do: one line on the `dspark` logger (INFO) when a step that
can take more than a couple of seconds starts, one when it ends, with its time. The command layer
prints them (dspark.cli.main); a library caller sees them through logging as usual."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("dspark")
_listeners: list[Callable[[str], None]] = []  # told each step's start (dspark serve's /health reason)


@contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """Call `listener(start)` as each step starts, within the block (from the thread running the step)."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def started(start: str) -> None:
    """A step's start line ("<start> ..."), and its listeners told: `step` begins with it, and a step
    whose end line its caller writes (the load-time check's, dspark.api) calls it alone."""
    log.info("%s ...", start)
    for listener in list(_listeners):
        listener(start)


@contextmanager
def step(start: str, end: str) -> Iterator[dict]:
    """Log `start` ("... ...") now and `end` ("<end> in 2.3 s") when the block ends; a block that
    raises logs no end (its error says what happened). The block may add words to the end line:
    `with step(...) as done: done["detail"] = "..."` -> "<end> in 2.3 s (...)"."""
    started(start)
    t0 = time.perf_counter()
    said: dict = {}
    yield said
    detail = f" ({said['detail']})" if said.get("detail") else ""
    log.info("%s in %.1f s%s", end, time.perf_counter() - t0, detail)
