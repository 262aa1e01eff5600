"""A request as the engine holds it (prompt, sampling, output, counters, marks), what observes the
engine's steps, and a prompt being prefilled chunk by chunk."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dspark.engine.batch import StepResult
from dspark.engine.detok import Detokenizer
from dspark.engine.marks import TokenMark
from dspark.engine.metrics import SpecMetrics
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError

_ids = itertools.count()


@dataclass
class Prefilling:
    """A request whose prompt is being prefilled chunk by chunk (Engine.prefill_chunk)."""

    req: Request
    state: Any  # its target state, the committed chunks
    done: int = 0  # prompt tokens committed
    taps: list[torch.Tensor] = field(default_factory=list)  # the chunks' taps, for the draft context


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_tokens: Callable[[Request, list[int]], None] | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why a request ended with "error" (a fixed phrase; the log has the exception)
    metrics: SpecMetrics | None = None
    text: str | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_finish: float | None = None
    detok: Detokenizer | None = None  # None: the engine has no tokenizer
    marks: list[TokenMark] | None = None  # per output token, when asked for (engine/marks.py)
    steps: int = 0  # decode steps run for this request (its prefill is step 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def stream_text(self) -> str:
        """The text a stream may show now: once finished the final text (cut at a stop string),
        before that the incremental decode less the characters a stop string could begin with."""
        if self.finished and self.text is not None:
            return self.text
        if self.detok is None:
            raise DSparkError("streaming text needs a tokenizer: this engine has none (stream token ids)")
        self.detok.update(self.output_ids)
        return self.detok.streamable()


class StepObserver(Protocol):
    """Called after every decode step with its result and the running requests in row order
    (the verification policy is one; calibration records through another)."""

    def observe(self, res: StepResult, requests: list[Request]) -> None: ...


def request_metrics(req: Request) -> SpecMetrics:
    """A running request's own counters (add_request gives every request its own)."""
    if req.metrics is None:
        raise RuntimeError(f"request {req.id} has no metrics: requests enter the engine through add_request")
    return req.metrics
