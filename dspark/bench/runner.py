"""The measuring core of `dspark bench`: arms, interleaved runs, forward-pass timing, aggregation.

Every arm decodes the same prompts on the same loaded target. Prompts are taken one at a
time (a group of `concurrency` prompts for batched arms) and every arm runs on it before the
next prompt starts, in an order rotated per prompt: a burst of machine noise then lands on
all arms alike instead of on whichever arm happened to run during it.

Time is split by what ran, not by where the engine's own timers sit: a forward hook on the
target model times every target forward pass (prefill and verification, HF `generate` too);
the draft's time is the engine's draft time (block forward, heads, context update). Engine
overhead = wall time - target forwards - draft; it includes mask building, logits casts,
acceptance, cache commits, scheduling and bookkeeping.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from dspark.engine.metrics import SpecMetrics
from dspark.engine.sampling import SamplingParams
from dspark.engine.timing import now
from dspark.errors import DSparkError
from dspark.target.native import NativeTarget

ARM_KINDS = {
    "hf": "transformers generate",
    "lookup": "transformers prompt-lookup",
    "plain": "dspark plain",
    "full": "dspark full",
    "threshold": "dspark threshold",
    "adaptive": "dspark adaptive",
}
SPECULATIVE = ("full", "threshold", "adaptive")
OVERHEAD_BUDGET = 0.10  # the engine's own time per step must stay under this share of the step


@dataclass(frozen=True)
class Arm:
    kind: str
    concurrency: int = 1

    @property
    def name(self) -> str:
        return self.kind if self.concurrency == 1 else f"{self.kind}@{self.concurrency}"

    @property
    def label(self) -> str:
        base = ARM_KINDS[self.kind]
        return base if self.concurrency == 1 else f"{base} x{self.concurrency}"

    @property
    def speculative(self) -> bool:
        return self.kind in SPECULATIVE

    @property
    def engine(self) -> bool:
        return self.kind not in ("hf", "lookup")


def default_arms(concurrency: int) -> str:
    return "hf,lookup,plain,full,adaptive" + (f",adaptive@{concurrency}" if concurrency > 1 else "")


def parse_arms(text: str) -> list[Arm]:
    """'hf,lookup,plain,full,adaptive,adaptive@4' -> arms (name@N = N requests decoded together)."""
    arms: list[Arm] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        kind, _, conc = item.partition("@")
        if kind not in ARM_KINDS:
            raise DSparkError(
                f"unknown bench arm {kind!r} (choose from {', '.join(ARM_KINDS)}; add @N for N concurrent requests)"
            )
        try:
            c = int(conc) if conc else 1
        except ValueError:
            raise DSparkError(f"bench arm {item!r}: concurrency after '@' must be an integer") from None
        if c < 1:
            raise DSparkError(f"bench arm {item!r}: concurrency must be >= 1")
        if c > 1 and not Arm(kind).engine:
            raise DSparkError(f"bench arm {item!r}: transformers arms run one request at a time")
        arm = Arm(kind, c)
        if arm in arms:
            raise DSparkError(f"bench arm {item!r} is listed twice")
        arms.append(arm)
    if not arms:
        raise DSparkError("no bench arms given")
    return arms


class ForwardTimer:
    """Seconds spent inside the target's forward passes (every call, whoever makes it): a hook on
    the HF module (HF generate, the hf runtime) and, for the native runtime, which never calls
    that module, a timing wrapper around the forward its four forwards run (`_forward`) for as long
    as the timer is open."""

    def __init__(self, module: torch.nn.Module, device):
        self.device, self.seconds, self.calls, self._t0 = device, 0.0, 0, 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]
        self._native_forward = NativeTarget._forward
        timer = self

        @functools.wraps(self._native_forward)  # the same signature for whoever inspects it
        def timed(target, *args, **kwargs):
            timer._pre()
            try:
                return timer._native_forward(target, *args, **kwargs)
            finally:
                timer._post()

        # patched for the timer's life; setattr because mypy refuses assigning a method
        setattr(NativeTarget, "_forward", timed)  # noqa: B010

    def _pre(self, *_):
        self._t0 = now(self.device)

    def _post(self, *_):
        self.seconds += now(self.device) - self._t0
        self.calls += 1

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        setattr(NativeTarget, "_forward", self._native_forward)  # noqa: B010  (see above)

    def __enter__(self) -> ForwardTimer:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


@dataclass
class Chunk:
    """One arm on one prompt (or one group of prompts decoded together)."""

    arm: str
    set: str
    indices: list[int]  # prompt indices within the set
    outputs: list[list[int]]
    metrics: list[SpecMetrics | None]
    wall_s: float
    target_s: float
    draft_s: float = 0.0
    verify_s: float = 0.0  # the engine's verify span (target forward + its input/output handling)
    other_s: float = 0.0  # the engine's step time outside draft and verify spans


class HFRunner:
    """transformers `generate` on the very model the engine arms use (greedy or sampled)."""

    def __init__(self, model, eos: tuple[int, ...], pad: int, lookup_tokens: int | None):
        self.model, self.eos, self.pad, self.lookup = model, eos, pad, lookup_tokens

    def __call__(self, prompts, params):
        (ids,), (p,) = prompts, params
        x = torch.tensor([ids], device=self.model.device)
        kw = dict(
            max_new_tokens=p.max_new_tokens,
            do_sample=not p.greedy,
            pad_token_id=self.pad,
            eos_token_id=None if p.ignore_eos else list(self.eos),
        )
        if p.greedy:
            # the model's generation_config may carry sampling defaults: greedy must not see them
            kw.update(temperature=None, top_k=None, top_p=None)
        else:
            kw.update(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
            torch.manual_seed(p.seed if p.seed is not None else 0)
        if self.lookup:
            kw["prompt_lookup_num_tokens"] = self.lookup
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), **kw)
        return [out[0, len(ids) :].tolist()], [None]


class EngineRunner:
    """One engine arm (each arm's engine is derived from the one built engine: same loaded target)."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, prompts, params):
        if len(prompts) == 1:
            reqs = [self.engine.generate(prompts[0], params[0])]
        else:
            reqs = self.engine.generate_many(prompts, params)
        spec = self.engine.speculative
        return [r.output_ids for r in reqs], [r.metrics if spec else None for r in reqs]


def run_chunk(runner, arm: Arm, set_name: str, indices, prompts, params, timer: ForwardTimer, device) -> Chunk:
    m = getattr(runner, "engine", None)
    m = m.metrics if m is not None else None
    before = (m.t_draft, m.t_verify, m.t_other) if m is not None else (0.0, 0.0, 0.0)
    t_target = timer.seconds
    t0 = now(device)
    outputs, metrics = runner(prompts, params)
    wall = now(device) - t0
    chunk = Chunk(arm.name, set_name, list(indices), outputs, metrics, wall, timer.seconds - t_target)
    if m is not None:
        _engine_spans(chunk, runner.engine, before)
    return chunk


def _engine_spans(chunk: Chunk, engine, before: tuple[float, float, float]) -> None:
    """The engine's draft / verify / other spans since `before` (its metrics' running totals)."""
    m = engine.metrics
    # without a draft the engine's "draft" span is only bookkeeping: overhead, not a model pass
    chunk.draft_s = m.t_draft - before[0] if engine.draft is not None else 0.0
    chunk.verify_s, chunk.other_s = m.t_verify - before[1], m.t_other - before[2]


def side_by_side(engines, ids: list[int], params, first: int = 0, timer: ForwardTimer | None = None, device="cpu"):
    """One request on each engine, the engines taking one step each in turn, the first to step
    rotating every step -> (requests, seconds each engine spent in its steps, seconds of target
    forward within them: 0 without a timer). Whole runs timed one after the other differ by
    several percent on a shared machine from drift alone; steps in turn put the same drift on
    every arm, and rotating (rather than reversing) the order gives every arm every position."""
    reqs = [e.add_request(ids, params) for e in engines]
    n = len(engines)
    wall, target = [0.0] * n, [0.0] * n
    i = first
    while any(e.has_work() for e in engines):
        for k in range(n):
            j = (i + k) % n
            if engines[j].has_work():
                t_fwd, t0 = timer.seconds if timer else 0.0, now(device)
                engines[j].step()
                wall[j] += now(device) - t0
                target[j] += (timer.seconds - t_fwd) if timer else 0.0
        i += 1
    return reqs, wall, target


def _engine_chunks(arms: list[Arm], runners: dict, set_name: str, i: int, ids, params, timer, device, first: int):
    """The engine arms on one prompt, side by side (`side_by_side`), as one Chunk each."""
    engines = [runners[a.name].engine for a in arms]
    before = [(e.metrics.t_draft, e.metrics.t_verify, e.metrics.t_other) for e in engines]
    reqs, wall, target = side_by_side(engines, ids, params, first, timer, device)
    chunks = []
    for a, e, r, b, w, t in zip(arms, engines, reqs, before, wall, target):
        c = Chunk(a.name, set_name, [i], [r.output_ids], [r.metrics if e.speculative else None], w, t)
        _engine_spans(c, e, b)
        chunks.append(c)
    return chunks


def interleaved(
    arms: list[Arm], runners: dict, sets, encoded: dict, params_for, timer, device, progress=None
) -> list[Chunk]:
    """Run every arm on every prompt, prompt group by prompt group, arm order rotated per prompt.
    Engine arms decoding one request at a time run side by side (`side_by_side`), where the
    first of them comes in the rotated order; other arms (transformers) run whole."""
    group = max(a.concurrency for a in arms)
    single = [a for a in arms if a.concurrency == 1]
    batched = [a for a in arms if a.concurrency > 1]
    chunks: list[Chunk] = []
    turn = 0
    for ps in sets:
        ids = encoded[ps.name]
        for g0 in range(0, len(ids), group):
            idx = list(range(g0, min(g0 + group, len(ids))))
            for i in idx:
                order = single[turn % len(single) :] + single[: turn % len(single)] if single else []
                stepped = [a for a in order if isinstance(runners[a.name], EngineRunner)]
                for arm in order:
                    if arm in stepped and len(stepped) > 1:
                        if arm is not stepped[0]:
                            continue  # ran with the first engine arm
                        new = _engine_chunks(stepped, runners, ps.name, i, ids[i], params_for(i), timer, device, turn)
                    else:
                        new = [
                            run_chunk(runners[arm.name], arm, ps.name, [i], [ids[i]], [params_for(i)], timer, device)
                        ]
                    for c in new:
                        chunks.append(c)
                        if progress:
                            progress(c)
                turn += 1
            for arm in batched:
                for c0 in range(0, len(idx), arm.concurrency):
                    sub = idx[c0 : c0 + arm.concurrency]
                    chunks.append(
                        run_chunk(
                            runners[arm.name],
                            arm,
                            ps.name,
                            sub,
                            [ids[i] for i in sub],
                            [params_for(i) for i in sub],
                            timer,
                            device,
                        )
                    )
                    if progress:
                        progress(chunks[-1])
    return chunks


# ---- aggregation -------------------------------------------------------------------------------


@dataclass
class ArmStats:
    arm: Arm
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    metrics: SpecMetrics | None = None
    per_request: list[SpecMetrics] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    seconds_per_request: list[float] = field(default_factory=list)

    def add(self, c: Chunk) -> None:
        self.requests += len(c.indices)
        self.tokens += sum(len(o) for o in c.outputs)
        self.wall_s += c.wall_s
        self.target_s += c.target_s
        self.draft_s += c.draft_s
        self.verify_s += c.verify_s
        self.other_s += c.other_s
        for i, out, m in zip(c.indices, c.outputs, c.metrics):
            self.outputs[i] = out
            if m is not None:
                self.per_request.append(m)
                if self.metrics is None:
                    self.metrics = SpecMetrics(m.gamma)
                self.metrics.merge(m)
        self.seconds_per_request.append(c.wall_s / max(1, len(c.indices)))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.target_s - self.draft_s)

    def to_dict(self, baseline: ArmStats | None) -> dict:
        w = self.wall_s or 1.0
        d = {
            "arm": self.arm.name,
            "label": self.arm.label,
            "concurrency": self.arm.concurrency,
            "requests": self.requests,
            "generated_tokens": self.tokens,
            "seconds": round(self.wall_s, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "ratio_to_baseline": None,
            "same_output_as_baseline": None,
            "time_s": {
                "wall": round(self.wall_s, 4),
                "target_forward": round(self.target_s, 4),
                "draft": round(self.draft_s, 4),
                "overhead": round(self.overhead_s, 4),
                "engine_verify_span": round(self.verify_s, 4),
                "engine_other_span": round(self.other_s, 4),
            },
            "time_fraction": {
                "target_forward": round(self.target_s / w, 4),
                "draft": round(self.draft_s / w, 4),
                "overhead": round(self.overhead_s / w, 4),
            },
            "overhead_pct": round(100 * self.overhead_s / w, 2),
            "overhead_within_budget": self.overhead_s / w < OVERHEAD_BUDGET if self.arm.engine else None,
        }
        if baseline is not None and baseline.tokens_per_second > 0:
            d["ratio_to_baseline"] = round(self.tokens_per_second / baseline.tokens_per_second, 4)
            common = [i for i in self.outputs if i in baseline.outputs]
            if common:
                same = sum(self.outputs[i] == baseline.outputs[i] for i in common)
                d["same_output_as_baseline"] = round(same / len(common), 4)
        if self.metrics is not None:
            md = self.metrics.to_dict()
            md.pop("time_s", None)  # the engine's own split is reported above, next to the hook timings
            d["acceptance"] = md
            d["mean_accept_length_per_request"] = [round(m.mean_accept_length, 4) for m in self.per_request]
        return d


def aggregate(chunks: list[Chunk], arms: list[Arm], set_names: list[str]) -> dict[str, dict[str, ArmStats]]:
    """{set name or "all": {arm name: ArmStats}} (the "all" row pools every prompt of every set)."""
    table = {s: {a.name: ArmStats(a) for a in arms} for s in [*set_names, "all"]}
    by_name = {a.name: a for a in arms}
    offset: dict[str, int] = {}
    start = 0
    for s in set_names:  # prompt indices of "all" stay unique across sets
        offset[s] = start
        start += 1 + max((i for c in chunks if c.set == s for i in c.indices), default=-1)
    for c in chunks:
        table[c.set][c.arm].add(c)
        shifted = Chunk(
            c.arm,
            "all",
            [i + offset[c.set] for i in c.indices],
            c.outputs,
            c.metrics,
            c.wall_s,
            c.target_s,
            c.draft_s,
            c.verify_s,
            c.other_s,
        )
        table["all"][by_name[c.arm].name].add(shifted)
    return table


def sampling_params(
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None, ignore_eos: bool
):
    def params_for(i: int) -> SamplingParams:
        # The same seed for every arm on prompt i: sampled arms see the same randomness budget.
        s = None if temperature == 0 else (seed or 0) + i
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=s,
            ignore_eos=ignore_eos,
        )

    return params_for
