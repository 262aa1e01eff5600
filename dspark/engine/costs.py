"""The cost curve: how long one verify step takes for B batch tokens on THIS target.

The adaptive scheduler weighs expected accepted tokens against steps per second,
SPS(B) = 1 / step_time(B). A missing or flat curve makes every extra token look free, so the
scheduler silently verifies everything (docs/DESIGN.md §6): the engine therefore profiles
its own target at start-up (a few timed forwards over a grid of token counts), caches the
result on disk, and warns loudly when the curve comes out flat.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark import progress
from dspark.engine.timing import now as clock
from dspark.errors import DSparkError
from dspark.jsonfile import read_json, write_json
from dspark.target.load import cache_dir

log = logging.getLogger("dspark")

CURVE_FORMAT = "dspark-cost-curve"
# Verifying the largest grid point costing less than this factor over a single token counts
# as flat: the scheduler would then see almost no price for verification.
FLAT_RATIO = 1.10
PROFILE_CONTEXT = 32  # committed tokens the scratch state holds (attention has something to read)
# how profile_cost_curve samples (part of a cached curve's identity): 2 = the small points get their
# repeats even where one pass of the large ones fills the budget; 3 = every point reads the
# target's argmax alone, as greedy verification does since docs/history/benchmarks.md "... greedy
# verification without fp32 logits";
# 4 = the points of up to SMALL_TOKENS tokens read SMALL_REPEATS samples
PROFILER = 4
# The 1- and 2-token points decide whether drafting pays at all (break-even is (phase + t2) / t1 - 1),
# and the least of 3 samples left their ratio changing from one start-up to the next on a 2-core VM;
# they cost a few ms each, so they take more samples than the large points (docs/SCHEDULING.md).
SMALL_TOKENS = 4
SMALL_REPEATS = 15
# A cached curve whose 1-token step is this many times what one costs now was profiled while the
# machine was busy (another job, a kernel build): every later start read the load's curve, nearly
# flat next to its slow step, and drafted where it does not pay. Each start times that step (a few
# ms) and profiles again past this ratio; a slower step now is today's load, which the adaptive
# policy's scales follow, and keeps the curve.
STALE_CURVE = 1.5
STALE_REPEATS = 7


@dataclass(frozen=True)
class CostCurve:
    """Step time (seconds) at a grid of batch-token counts; linear in between, linear extrapolation past the ends."""

    tokens: tuple[int, ...]  # strictly increasing, >= 1
    seconds: tuple[float, ...]  # non-decreasing, > 0
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise DSparkError("cost curve: tokens and seconds must be non-empty lists of the same length")
        if any(not isinstance(t, int) or t < 1 for t in self.tokens) or list(self.tokens) != sorted(set(self.tokens)):
            raise DSparkError(
                f"cost curve: tokens must be strictly increasing positive integers, got {list(self.tokens)}"
            )
        if any(not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0) for s in self.seconds):
            raise DSparkError(f"cost curve: seconds must be positive finite numbers, got {list(self.seconds)}")

    @classmethod
    def from_points(cls, tokens, seconds, meta: dict | None = None) -> CostCurve:
        """Sort by tokens and force step time non-decreasing (running max): more tokens never
        cost less, and a noisy dip would otherwise make some batch sizes look like bargains."""
        pts = sorted(zip((int(t) for t in tokens), (float(s) for s in seconds)))
        mono, top = [], 0.0
        for _, s in pts:
            top = max(top, s)
            mono.append(top)
        return cls(tuple(t for t, _ in pts), tuple(mono), dict(meta or {}))

    def step_time(self, tokens: int) -> float:
        ts, ss = self.tokens, self.seconds
        if len(ts) == 1:
            return ss[0]
        if tokens <= ts[0]:
            i = 0
        elif tokens >= ts[-1]:
            i = len(ts) - 2
        else:
            i = next(k for k in range(len(ts) - 1) if ts[k] <= tokens <= ts[k + 1])
        slope = (ss[i + 1] - ss[i]) / (ts[i + 1] - ts[i])
        # never below the cheapest measured step: extrapolating down to 0 tokens is not physical
        return max(ss[0], ss[i] + slope * (tokens - ts[i]))

    @property
    def ratio(self) -> float:
        """step time at the largest grid point / at the smallest."""
        return self.seconds[-1] / self.seconds[0]

    def is_flat(self) -> bool:
        return len(self.tokens) > 1 and self.ratio < FLAT_RATIO

    def to_json(self) -> dict:
        return {"format": CURVE_FORMAT, "tokens": list(self.tokens), "seconds": list(self.seconds), "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict) -> CostCurve:
        if not isinstance(data, dict) or data.get("format") != CURVE_FORMAT:
            raise DSparkError(f'not a cost curve file (expected "format": "{CURVE_FORMAT}")')
        return cls.from_points(data.get("tokens") or [], data.get("seconds") or [], data.get("meta") or {})

    def save(self, path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path) -> CostCurve:
        return cls.from_json(read_json(path, "cost curve"))


def default_grid(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to and including max_tokens."""
    if max_tokens < 1:
        raise DSparkError(f"cost curve: max_tokens must be >= 1, got {max_tokens}")
    grid, t = [], 1
    while t < max_tokens:
        grid.append(t)
        t *= 2
    return grid + [max_tokens]


@torch.inference_mode()
def forward_times(
    target,
    grid: list[int],
    *,
    repeats: int = 3,
    budget_s: float = math.inf,
    seed: int = 0,
    context: int = PROFILE_CONTEXT,
    small_repeats: int = 0,
) -> dict[int, list[float]]:
    """Seconds of target.forward of [1, T] random tokens for T in grid, greedy (the target's argmax
    alone), on a scratch state of `context` committed tokens (the timed entries dropped after each).

    One warm-up pass (first calls per shape pay one-time kernel set-up), then up to `repeats`
    passes, the points taking turns within each (a drifting machine moves them together). After
    the first timed pass a point is timed again only if that fits in the budget (the cheap small
    points, which decide whether drafting pays at all, get their repeats even where one pass of
    the large ones fills it: one sample of a 1-token step can be a descheduled one). When the
    warm-up alone overruns the budget (a loaded machine) its own timings are returned, with a
    warning, rather than making start-up slower still. small_repeats: the points of up to
    SMALL_TOKENS tokens take that many passes where it exceeds `repeats` (the budget still holds)."""
    gen = torch.Generator().manual_seed(seed)
    dev = target.device
    state = target.new_state(1)
    target.forward(state, torch.randint(4, target.vocab_size, (1, context), generator=gen).to(dev))
    target.commit(state, torch.tensor([context], device=dev))
    batches = {t: torch.randint(4, target.vocab_size, (1, t), generator=gen).to(dev) for t in grid}
    times: dict[int, list[float]] = {t: [] for t in grid}
    keep_none = torch.zeros(1, dtype=torch.long, device=dev)
    start = time.perf_counter()
    for rep in range(max(repeats, small_repeats) + 1):
        timed = 0
        for t in grid:
            if rep > repeats and t > SMALL_TOKENS:
                continue
            if rep >= 2 and time.perf_counter() + times[t][-1] - start > budget_s:
                continue
            timed += 1
            # greedy steps, plain or verifying, read the target's argmax alone (a sampled verify's
            # fp32 logits add a few %: the adaptive scheduler rescales the curve to observed steps)
            t0 = clock(dev)
            target.forward_argmax(state, batches[t])
            t1 = clock(dev)
            target.commit(state, keep_none)  # drop the pending entries: the scratch context stays as it was
            times[t].append(t1 - t0)
        now = time.perf_counter()
        if rep == 0 and now - start > budget_s:
            log.warning(
                "WARNING: profiling the verify cost curve overran its %.1fs budget in the warm-up pass "
                "(%.1fs): the machine looks loaded; using the warm-up timings (rough)",
                budget_s,
                now - start,
            )
            break
        if rep == 0:
            times = {t: [] for t in grid}  # warm-up timings include one-time set-up: drop them
        elif not timed:
            break
    return times


def profile_cost_curve(
    target, grid: list[int], *, repeats: int = 3, budget_s: float = 3.0, seed: int = 0, small_repeats: int = 0
) -> CostCurve:
    """The cost curve of `target` over grid (`forward_times` within budget_s, on a scratch state
    of PROFILE_CONTEXT tokens): the minimum per point, because load from other processes only
    ever adds time, and the adaptive scheduler rescales the whole curve to observed steps anyway.
    A [1, T] forward costs what a padded [R, T/R] verify costs (the projections see R*T/R rows
    either way; the attention share is small at these lengths)."""
    start = time.perf_counter()
    times = forward_times(target, grid, repeats=repeats, budget_s=budget_s, seed=seed, small_repeats=small_repeats)
    meta = {
        "repeats": len(times[grid[0]]),
        "repeats_largest": len(times[grid[-1]]),
        "context": PROFILE_CONTEXT,
        "profile_s": round(time.perf_counter() - start, 3),
    }
    return CostCurve.from_points(grid, [min(times[t]) for t in grid], meta)


def curve_identity(target, grid: list[int]) -> dict:
    """What a cached curve is valid for: the model (name + config hash), the runtime, its weight
    format (an int4 native step costs a fraction of an HF bf16 one), its kernels, dtype, device,
    threads."""
    cfg = target.config
    config_json = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return {
        "model": str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "model")),
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        "runtime": type(target).__name__,
        "weights": getattr(target, "weights", None),
        "head": getattr(target, "head_format", None),
        # dspark's kernels change what a verify costs against a 1-token step (docs/BENCHMARKS.md):
        # the int4 kernel, and the extension's norms / attention / RoPE build
        "int4_kernel": target.int4_kernels() if hasattr(target, "int4_kernels") else None,
        "extension": target.extension() if hasattr(target, "extension") else None,
        # weights in 2 MB pages stream faster (hugepages.into_huge_pages)
        "huge_pages": getattr(target, "huge_pages", None),
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "grid": list(grid),
        "torch": torch.__version__,
        "profiler": PROFILER,
    }


def cache_path(identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(identity["model"]).name or "model")[:60]
    return cache_dir() / "cost-curves" / f"{name}-{identity['dtype']}-{digest}.json"


def warn_if_flat(curve: CostCurve) -> bool:
    if not curve.is_flat():
        return False
    if curve.meta.get("flat_warned"):
        return True  # once per curve: a benchmark builds many schedulers on the same curve
    curve.meta["flat_warned"] = True
    log.warning(
        "WARNING: the verify cost curve is flat (%d tokens cost %.2fx one token): the adaptive scheduler "
        "will see no price for verification and verify (almost) everything. Re-profile on a quiet machine "
        "(delete %s) or pass a measured curve.",
        curve.tokens[-1],
        curve.ratio,
        curve.meta.get("cache_file", "the cached curve"),
    )
    return True


def cost_curve_for(
    target, max_tokens: int, *, cache: bool = True, refresh: bool = False, budget_s: float = 3.0
) -> CostCurve:
    """The cached curve for this target/dtype/device/threads, profiled (and cached) when absent."""
    grid = default_grid(max_tokens)
    ident = curve_identity(target, grid)
    path = cache_path(ident)
    curve = None
    if cache and not refresh and path.exists():
        try:
            curve = CostCurve.load(path)
            if curve.meta.get("identity") != ident:
                curve = None  # a digest collision or a hand-edited file: profile afresh
        except DSparkError as exc:
            log.warning("ignoring unreadable cost curve cache %s: %s", path, exc)
        if curve is not None:
            now_s = min(forward_times(target, [1], repeats=STALE_REPEATS)[1])
            if curve.step_time(1) > STALE_CURVE * now_s:
                log.info(
                    "the cached cost curve was profiled on a busier machine (1 token %.1f ms, %.1f ms now): "
                    "profiling it again",
                    curve.step_time(1) * 1e3,
                    now_s * 1e3,
                )
                curve = None
    if curve is None:
        progress.started(
            f"profiling the verify cost curve (once per target, runtime and thread count; about {budget_s:.0f} s)"
        )
        curve = profile_cost_curve(target, grid, budget_s=budget_s, small_repeats=SMALL_REPEATS)
        curve = CostCurve(curve.tokens, curve.seconds, {**curve.meta, "identity": ident})
        if cache:
            curve.save(path)
        log.info("profiled verify cost curve in %.2fs: %s", curve.meta["profile_s"], describe(curve))
    curve.meta["cache_file"] = str(path)
    warn_if_flat(curve)
    return curve


def describe(curve: CostCurve) -> str:
    return ", ".join(f"{t} tok {s * 1e3:.1f} ms" for t, s in zip(curve.tokens, curve.seconds))
