"""Batched decoding side by side: plain, and speculative with full / threshold / adaptive verification.

For each concurrency level c, every arm decodes the same c * requests_per_level requests with
at most c in flight (continuous batching: a finished request's slot goes to the next one),
EOS ignored so every arm produces the same number of tokens. Reported per (c, arm): output
tokens per second (prefill included, identical work in every arm; the fastest of `repeats`
runs, arms interleaved), mean acceptance length, drafts verified per step, the share of steps
that drafted at all, and the ratio to plain decoding at that concurrency.
"""

from __future__ import annotations

import time

import torch

from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.engine.scheduler import DEFAULT_THRESHOLD, AdaptiveScheduler, make_scheduler
from dspark.errors import DSparkError

ARMS = ("plain", "full", "threshold", "adaptive")
# Short, varied chat prompts (used when no prompt file is given).
DEFAULT_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a linked list.",
    "What is 17 times 23? Show your steps.",
    "Give three tips for writing clear emails.",
    "Summarise the plot of Romeo and Juliet briefly.",
    "List the planets of the solar system in order.",
    "How do I make a cup of green tea?",
    "Translate 'good morning, how are you?' into French.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn rain.",
    "Why do we have seasons on Earth?",
    "Describe how a bicycle works.",
    "What are prime numbers? Give five examples.",
    "Write a short story opening about a lighthouse keeper.",
    "How does a binary search work?",
    "Name three uses of the Fourier transform.",
)


def bench_batching(
    engine: Engine,
    prompts: list[list[int]],
    *,
    concurrency=(1, 4, 8, 16),
    arms=ARMS,
    max_new_tokens: int = 64,
    requests_per_level: int = 2,
    temperature: float = 0.0,
    seed: int = 0,
    threshold: float = DEFAULT_THRESHOLD,
    calibration=None,
    curve=None,
    skip: bool = True,
    on_row=None,
    repeats: int = 1,
) -> list[dict]:
    """engine: the built engine (its target and draft serve every arm); prompts: token ids.
    -> one dict per (concurrency, arm)."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise DSparkError(f"unknown arm(s) {unknown or arms} (choose from {', '.join(ARMS)})")
    if not prompts:
        raise DSparkError("bench-batch needs at least one prompt")
    if any(not isinstance(c, int) or c < 1 for c in concurrency) or not concurrency:
        raise DSparkError(f"concurrency levels must be positive integers, got {list(concurrency)}")
    if repeats < 1:
        raise DSparkError(f"repeats must be >= 1, got {repeats}")
    if requests_per_level < 1:
        raise DSparkError(f"requests_per_level must be >= 1, got {requests_per_level}")
    draft = engine.draft
    if draft is None and any(a != "plain" for a in arms):
        raise DSparkError("speculative arms need a draft")
    if "adaptive" in arms:  # profile (or load) the cost curve once, before anything is timed
        adaptive = make_scheduler("adaptive", engine.target, draft, curve=curve, max_batch=max(concurrency))
        assert isinstance(adaptive, AdaptiveScheduler)  # what make_scheduler makes of "adaptive"
        curve = adaptive.curve

    def arm_engine(arm: str, c: int) -> Engine:
        if arm == "plain":
            return engine.derive(speculative=False, max_batch=c)
        # a fresh policy per engine: the adaptive one's running timings belong to one load level
        policy = make_scheduler(
            arm,
            engine.target,
            draft,
            threshold=threshold,
            calibration=calibration,
            curve=curve,
            skip=skip,
            prior=engine.prior,
        )
        # `full`: the draft alone, every block verified; the others propose as the engine does (lookup too)
        return engine.derive(policy=policy, max_batch=c, lookup=False if arm == "full" else None)

    def params(i: int, n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed + i, ignore_eos=True)

    for arm in arms:  # warm-up: first forwards pay one-time allocation costs
        arm_engine(arm, 1).generate(prompts[0], params(0, 4))

    def run(arm: str, c: int, work) -> tuple[float, int, object]:
        eng = arm_engine(arm, c)
        reqs = [eng.add_request(p, params(i, max_new_tokens)) for i, p in enumerate(work)]
        with torch.inference_mode():
            t0 = time.perf_counter()
            eng.run_until_done()
            dt = time.perf_counter() - t0
        return dt, sum(len(r.output_ids) for r in reqs), eng.metrics

    rows = []
    for c in concurrency:
        work = [prompts[i % len(prompts)] for i in range(c * requests_per_level)]
        runs: dict[str, list] = {arm: [] for arm in arms}
        for _ in range(repeats):  # arms interleaved, so a burst of load hits every arm alike
            for arm in arms:
                runs[arm].append(run(arm, c, work))
        plain_tps = None
        for arm in arms:
            # the fastest run: load from other processes only ever adds time (as in the cost profile)
            dt, out, _ = min(runs[arm], key=lambda r: r[0])
            m = runs[arm][0][2]
            for _, _, other in runs[arm][1:]:
                m.merge(other)
            all_steps = m.steps + m.plain_steps
            row = {
                "concurrency": c,
                "arm": arm,
                "requests": len(work),
                "output_tokens": out,
                "seconds": round(dt, 4),
                "tokens_per_s": round(out / dt, 2),
                "repeats": repeats,
                # tokens a verify step commits; an arm that never verified has no such figure (None)
                "mean_accept_length": 1.0
                if arm == "plain" or draft is None
                else (round(m.mean_accept_length, 3) if m.steps else None),
                "verified_per_step": round(m.verified / m.steps, 3) if m.steps else 0.0,
                "drafted_per_step": round(m.drafted / m.steps, 3) if m.steps else 0.0,
                # share of decode steps that drafted at all (adaptive skips drafting when it does not pay)
                "drafting_steps": round(m.steps / all_steps, 3) if all_steps and arm != "plain" else 0.0,
            }
            if arm == "plain":
                plain_tps = row["tokens_per_s"]
            row["vs_plain"] = round(row["tokens_per_s"] / plain_tps, 3) if plain_tps else None
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
