"""`dspark bench-batch`: batched plain decoding vs full / threshold / adaptive verification."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dspark.api import build_engine
from dspark.bench.batching import DEFAULT_PROMPTS, bench_batching
from dspark.cli.engine_flags import add_engine_flags, engine_config, print_notes, refuse_max_batch, refuse_verify
from dspark.errors import DSparkError
from dspark.prompts import encode_prompts, read_prompt_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target's chat template")
    p.add_argument("--prompts", help="prompt file (JSONL or one per line; default: built-in chat prompts)")
    p.add_argument(
        "--concurrency",
        default="1,4,8,16",
        help="comma-separated concurrency levels (default 1,4,8,16; the largest sets --max-batch)",
    )
    p.add_argument(
        "--arms",
        default="plain,full,threshold,adaptive",
        help="comma-separated subset of the four arms (they take the place of --verify; --threshold, "
        "--calibration, --cost-curve and --always-draft configure theirs)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=2, help="requests per level = this x concurrency")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per arm and level, arms interleaved; the fastest is reported (default 1)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="also write the rows as JSON to this file")


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DSparkError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise DSparkError(f"{what} must be positive integers, got {text!r}")
    return vals


def run(args: argparse.Namespace) -> int:
    levels = _int_list(args.concurrency, "--concurrency")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    refuse_verify(args, "bench-batch", f"use --arms plain,{args.verify}")
    refuse_max_batch(args, "bench-batch", "--concurrency")
    engine = build_engine(engine_config(args, max_batch=max(levels), verify="full"))  # arms bring their policies
    print_notes(engine)
    raw = read_prompt_file(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    chat = args.chat or (not args.prompts and bool(getattr(engine.tokenizer, "chat_template", None)))
    rows = bench_batching(
        engine,
        encode_prompts(engine, raw, chat),
        concurrency=levels,
        arms=arms,
        max_new_tokens=args.max_new_tokens,
        requests_per_level=args.requests_per_level,
        temperature=args.temperature,
        seed=args.seed,
        threshold=args.threshold,
        calibration=args.calibration,
        curve=args.cost_curve,
        skip=not args.always_draft,
        repeats=args.repeats,
    )
    print_table(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json_out}")
    return 0


def print_table(rows: list[dict]) -> None:
    table = Table(title="batched decoding (acc len = mean acceptance length, bonus included)")
    for col in ("conc", "arm", "tok/s", "x plain", "acc len", "verif/step", "drafting", "tokens", "s"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["concurrency"]),
            r["arm"],
            f"{r['tokens_per_s']:.1f}",
            "-" if r["vs_plain"] is None else f"{r['vs_plain']:.2f}",
            "-" if r["mean_accept_length"] is None else f"{r['mean_accept_length']:.2f}",
            f"{r['verified_per_step']:.2f}",
            f"{r.get('drafting_steps', 0.0):.0%}",
            str(r["output_tokens"]),
            f"{r['seconds']:.2f}",
        )
    console = Console()
    if not console.is_terminal:  # piped or captured: rich would squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)
