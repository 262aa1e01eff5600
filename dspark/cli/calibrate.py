"""`dspark calibrate`: record full-verification steps on held-out prompts, fit Sequential
Temperature Scaling, print before/after per position, write the file `--calibration` reads."""

from __future__ import annotations

import argparse
import math

from rich.console import Console
from rich.table import Table

from dspark.api import build_engine
from dspark.cli.engine_flags import add_engine_flags, engine_config, print_notes, refuse_max_batch
from dspark.engine.calibration import Calibration, fit_sts, position_metrics, record_generations
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError
from dspark.prompts import encode_prompts, read_prompt_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target's chat template")
    p.add_argument(
        "--prompts", required=True, help="held-out prompts (JSONL or one per line), not the draft's training data"
    )
    p.add_argument("--out", required=True, help="calibration JSON to write (load it with --calibration FILE)")
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the recorded generations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests decoded together while recording (sets the engine's --max-batch; default 8)",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.25,
        help="share of prompts held out to report before/after metrics (0: report on the fitted data)",
    )


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.eval_fraction < 1.0:
        raise DSparkError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.concurrency < 1:
        raise DSparkError(f"--concurrency must be >= 1, got {args.concurrency}")
    refuse_max_batch(args, "calibrate", "--concurrency")
    prompts = read_prompt_file(args.prompts, args.limit)
    # recording always verifies every draft (record_generations): --verify does not change what is fitted
    engine = build_engine(engine_config(args, max_batch=args.concurrency, verify="full"))
    print_notes(engine)
    ids = encode_prompts(engine, prompts, args.chat)
    params = [
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed + i)
        for i in range(len(ids))
    ]
    rec, reqs = record_generations(engine, ids, params)
    fit_ids, eval_ids = split_requests([r.id for r in reqs], args.eval_fraction)
    z_fit, a_fit, v_fit = rec.arrays(fit_ids)
    z_ev, a_ev, v_ev = rec.arrays(eval_ids) if eval_ids else (z_fit, a_fit, v_fit)
    cal = fit_sts(z_fit, a_fit, v_fit)
    g = z_fit.shape[1]
    before = position_metrics(z_ev, a_ev, v_ev, [1.0] * g)
    after = position_metrics(z_ev, a_ev, v_ev, cal.temperatures)
    meta = {
        "target": args.target,
        "draft": str(args.draft or "bundled"),
        "sampling_temperature": args.temperature,
        "prompts": len(prompts),
        "records": {"fit": int(len(a_fit)), "eval": int(len(a_ev)) if eval_ids else 0},
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
