"""`dspark calibrate` and `dspark bench-batch`.

torch, transformers and rich are imported inside the functions: `dspark --help` imports this
module to build its parser and must stay fast.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dspark.errors import DSparkError
from dspark.prompts import read_prompt_file


# ---- shared --------------------------------------------------------------------------------

def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2", help="HF model directory, or 'smollm2' (default)")
    p.add_argument("--draft", help="draft checkpoint (default: the bundled draft for smollm2)")
    p.add_argument("--dtype", default="bf16", help="fp32 | bf16 (default bf16)")
    p.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    p.add_argument("--layout", choices=("anchor_first", "bonus_anchor"), help="force the draft layout (experts only)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target's chat template")


def _encode(engine, prompt, chat: bool) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    return engine.encode(prompt, chat=chat)


def _load(args, max_batch: int):
    from dspark.api import load_engine

    return load_engine(args.target, args.draft, dtype=args.dtype, device=args.device, layout=args.layout,
                       max_batch=max_batch, threads=args.threads)


# ---- dspark calibrate ------------------------------------------------------------------------

def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    p.add_argument("--prompts", required=True, help="held-out prompts (JSONL or one per line), not the draft's training data")
    p.add_argument("--out", required=True, help="calibration JSON to write (load it with --calibration FILE)")
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the recorded generations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8, help="requests decoded together while recording")
    p.add_argument("--eval-fraction", type=float, default=0.25,
                   help="share of prompts held out to report before/after metrics (0: report on the fitted data)")


def run_calibrate(args: argparse.Namespace) -> int:
    from dspark.engine.calibration import Calibration, fit_sts, position_metrics, record_generations
    from dspark.engine.sampling import SamplingParams

    if not 0.0 <= args.eval_fraction < 1.0:
        raise DSparkError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.concurrency < 1:
        raise DSparkError(f"--concurrency must be >= 1, got {args.concurrency}")
    prompts = read_prompt_file(args.prompts, args.limit)
    engine = _load(args, args.concurrency)
    ids = [_encode(engine, p, args.chat) for p in prompts]
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed + i)
              for i in range(len(ids))]
    rec, reqs = record_generations(engine, ids, params)
    fit_ids, eval_ids = split_requests([r.id for r in reqs], args.eval_fraction)
    z_fit, a_fit, v_fit = rec.arrays(fit_ids)
    z_ev, a_ev, v_ev = rec.arrays(eval_ids) if eval_ids else (z_fit, a_fit, v_fit)
    cal = fit_sts(z_fit, a_fit, v_fit)
    g = z_fit.shape[1]
    before = position_metrics(z_ev, a_ev, v_ev, [1.0] * g)
    after = position_metrics(z_ev, a_ev, v_ev, cal.temperatures)
    meta = {
        "target": args.target, "draft": str(args.draft or "bundled"), "sampling_temperature": args.temperature,
        "prompts": len(prompts), "records": {"fit": int(len(a_fit)), "eval": int(len(a_ev)) if eval_ids else 0},
        "metrics_on": "held-out prompts" if eval_ids else "fitted data",
        "metrics": {"before": _clean(before), "after": _clean(after)},
    }
    Calibration(cal.temperatures, meta).save(args.out)
    print_calibration(cal.temperatures, before, after, meta["metrics_on"])
    print(f"wrote {args.out}: temperatures {[round(t, 3) for t in cal.temperatures]}")
    return 0


def split_requests(ids: list[str], eval_fraction: float) -> tuple[set[str], set[str]]:
    """Every k-th request (k = round(1 / fraction)) is held out; at least one stays for fitting."""
    if eval_fraction <= 0 or len(ids) < 2:
        return set(ids), set()
    k = max(2, round(1 / eval_fraction))
    held = {r for i, r in enumerate(ids) if i % k == k - 1}
    return set(ids) - held, held


def _clean(rows: list[dict]) -> list[dict]:
    """NaN (one-class AUC) -> null: JSON has no NaN."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]


def print_calibration(temps, before: list[dict], after: list[dict], where: str) -> None:
    """One column per drafted position (fits 80 columns up to gamma ~8), one row per figure."""
    from rich.console import Console
    from rich.table import Table

    def f(x) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    table = Table(title=f"confidence calibration: survival vs prefix acceptance ({where})")
    table.add_column("position", style="bold")
    for b in before:
        table.add_column(str(b["position"]), justify="right")
    table.add_row("samples", *(str(b["samples"]) for b in before))
    table.add_row("accept rate", *(f(b["accept_rate"]) for b in before))
    table.add_row("temperature", *(f"{t:.3g}" for t in temps), end_section=True)
    for key, name in (("ece", "ECE"), ("auc", "AUC"), ("brier", "Brier")):
        table.add_row(f"{name} before", *(f(b[key]) for b in before))
        table.add_row(f"{name} after", *(f(a[key]) for a in after), end_section=key != "brier")
    Console().print(table)


# ---- dspark bench-batch ------------------------------------------------------------------------

def add_bench_batch_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    p.add_argument("--prompts", help="prompt file (JSONL or one per line; default: built-in chat prompts)")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma-separated concurrency levels (default 1,4,8,16)")
    p.add_argument("--arms", default="plain,full,threshold,adaptive", help="comma-separated subset of the four arms")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=2, help="requests per level = this x concurrency")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per arm and level, arms interleaved; the fastest is reported (default 1)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=float, help="confidence threshold of the threshold arm (default 0.5)")
    p.add_argument("--calibration", help="`dspark calibrate` file for the threshold and adaptive arms")
    p.add_argument("--cost-curve", help="cost-curve JSON for the adaptive arm (default: profile and cache)")
    p.add_argument("--json", dest="json_out", help="also write the rows as JSON to this file")


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DSparkError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise DSparkError(f"{what} must be positive integers, got {text!r}")
    return vals


def run_bench_batch(args: argparse.Namespace) -> int:
    from dspark.bench.batching import DEFAULT_PROMPTS, bench_batching, print_table

    levels = _int_list(args.concurrency, "--concurrency")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    engine = _load(args, max(levels))
    raw = read_prompt_file(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    chat = args.chat or (not args.prompts and bool(getattr(engine.tokenizer, "chat_template", None)))
    prompts = [_encode(engine, p, chat) for p in raw]
    rows = bench_batching(
        engine.target.model, engine.draft, prompts, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids,
        concurrency=levels, arms=arms, max_new_tokens=args.max_new_tokens, requests_per_level=args.requests_per_level,
        temperature=args.temperature, seed=args.seed, threshold=args.threshold, calibration=args.calibration,
        curve=args.cost_curve, repeats=args.repeats,
    )
    print_table(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json_out}")
    return 0
