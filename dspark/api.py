"""The Python API: load a target and a draft into an Engine in one call.

    from dspark.api import load_engine
    from dspark.engine.sampling import SamplingParams
    eng = load_engine("smollm2")                       # bundled draft, bf16
    req = eng.generate(eng.encode("Hi!", chat=True), SamplingParams(max_new_tokens=64))
    print(req.text, req.metrics.to_dict())
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dspark.bench.doctor import quick_check
from dspark.engine.engine import Engine
from dspark.errors import DSparkError
from dspark.target.hf import HFTarget
from dspark.target.load import SMOLLM2, default_device, load_target, parse_dtype
from dspark.target.text import encode_prompt, eos_ids

log = logging.getLogger("dspark")
BUNDLED_DRAFT = Path(__file__).parent / "assets" / "smollm2-draft"


def default_draft(target: str) -> Path | None:
    """The project's own draft is used whenever the target is smollm2 and no draft is given."""
    if target == SMOLLM2 and (BUNDLED_DRAFT / "config.json").exists():
        return BUNDLED_DRAFT
    return None


def resolve_draft(target: str, draft: str | None, alternative: str) -> Path:
    """The draft a command runs: the one given, else the bundled one for smollm2, else an error
    naming what the user can do instead (`alternative`)."""
    path = draft or default_draft(target)
    if path is None:
        raise DSparkError(f"no draft given for target {target!r} (pass --draft PATH{alternative})")
    return Path(path)


class DSparkEngine(Engine):
    """Engine plus tokenizer conveniences (chat template, decode)."""

    def encode(self, prompt, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise DSparkError("this target has no tokenizer: pass token ids")
        return encode_prompt(self.tokenizer, prompt, chat)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_engine(
    target: str = SMOLLM2,
    draft: str | None = None,
    *,
    no_spec: bool = False,
    dtype: str = "bf16",
    device: str | None = None,
    layout: str | None = None,
    scheduler=None,
    max_batch: int = 16,
    threads: int | None = None,
    check: bool = True,
) -> DSparkEngine:
    """check: run the doctor's cheap empirical check once the draft is loaded and log loudly
    what it finds (layout / taps / mask token that behave better than declared). It costs about
    as much as decoding 128 tokens, more (up to 1536 tokens) only while another reading could
    still be better (dspark.bench.doctor.QUICK_BUDGET)."""
    from dspark.model.load import load_draft

    if threads:
        torch.set_num_threads(threads)
    device = device or default_device()
    parse_dtype(dtype, device)
    model, tokenizer = load_target(target, dtype, device)
    d = None
    if not no_spec:
        d = load_draft(str(resolve_draft(target, draft, ", or --no-spec")), model, layout=layout)
    engine = DSparkEngine(HFTarget(model), d, tokenizer, eos_ids(model, tokenizer), scheduler=scheduler,
                          max_batch=max_batch)
    if check and d is not None:
        t0 = time.perf_counter()
        warnings = quick_check(engine)
        cost = f"load-time draft check: {time.perf_counter() - t0:.1f} s (disable: --no-check, check=False)"
        for warning in warnings:
            log.warning("WARNING: draft check: %s", warning)
        (log.warning if warnings else log.info)(cost)
    return engine
