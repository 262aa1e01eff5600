"""`dspark doctor`: the doctor's check (dspark.doctor) on the command line, and its report.

Exit codes: 0 healthy (every other reading is excluded from giving 3% more tokens per step or
0.05 nats more log-probability per slot to the target's tokens), 3 a misread or a
failed static check (and, with --strict, any warning), 4 undecided (the token bound was reached
before the comparison was decisive: rerun with a larger --max-tokens), 2 bad input.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text as RText

from dspark.api import build_engine, resolve_draft
from dspark.cli.engine_flags import add_engine_flags, engine_config, no_draft_flag, print_notes
from dspark.doctor.check import diagnose
from dspark.doctor.report import PRETTY_LAYOUT, Budget, Report
from dspark.errors import DSparkError
from dspark.prompts import read_prompt_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    b = Budget()
    p.epilog = (
        "exit status: 0 healthy, 3 misread (or a failed static check; any warning with --strict), "
        "4 undecided within --max-tokens, 2 bad input"
    )
    add_engine_flags(p)
    p.add_argument(
        "--tokens", type=int, default=b.tokens, help=f"tokens the target writes per text (default {b.tokens})"
    )
    p.add_argument(
        "--prompts-first",
        type=int,
        default=b.prompts,
        help=f"texts in the first round; each later round doubles the text (default {b.prompts})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=b.max_tokens,
        help=f"bound on the text generated while the comparison is undecided (default {b.max_tokens})",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt to generate from before the built-in ones (repeatable)",
    )
    p.add_argument("--prompts", default=None, help="a prompt file (.jsonl or .txt) used before the built-in prompts")
    p.add_argument("--mask-candidates", default="", help="comma-separated extra mask token ids to try")
    p.add_argument("--strict", action="store_true", help="exit 3 on warnings too")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def run(args) -> int:
    if args.tokens < 2:
        raise DSparkError("--tokens must be >= 2")
    if args.prompts_first < 1 or args.max_tokens < args.tokens:
        raise DSparkError("--prompts-first must be >= 1 and --max-tokens >= --tokens")
    try:
        extra = [int(x) for x in args.mask_candidates.split(",") if x.strip()]
    except ValueError:
        raise DSparkError(f"--mask-candidates must be comma-separated integers, got {args.mask_candidates!r}") from None
    if flag := no_draft_flag(args):
        raise DSparkError(f"the doctor examines a draft: drop {flag}")
    prompts = list(args.prompt or []) + (read_prompt_file(args.prompts) if args.prompts else [])
    # The doctor builds the draft itself (from a spec it may find broken): the engine brings the
    # target, tokenizer and settings; --layout forces the declared reading the doctor starts from.
    draft = resolve_draft(args.target, args.draft, "")
    engine = build_engine(engine_config(args, no_spec=True, check=False))
    print_notes(engine)
    report = diagnose(
        engine,
        str(draft),
        prompts=prompts or None,
        extra_masks=extra,
        layout=args.layout,
        budget=Budget(prompts=args.prompts_first, tokens=args.tokens, max_tokens=args.max_tokens),
    )
    if args.json:
        print(json.dumps(report.to_json(args.strict), indent=2))
    else:
        print_report(report)
    return report.exit_code(args.strict)


def print_report(report: Report) -> None:
    console = Console()
    d = report.declared
    console.print(RText(f"dspark doctor: draft {report.draft} on target {report.target}", style="bold"))
    console.print(
        RText(
            f"declared: {d.format}, {PRETTY_LAYOUT[d.layout]} ({d.layout_source}), gamma {d.gamma}, "
            f"block_size {d.block_size}, hidden_state_indices {list(d.hidden_state_indices)}, "
            f"mask_token_id {d.mask_token_id}"
        )
    )
    ct = Table(title="static checks")
    for col in ("check", "status", "detail"):
        ct.add_column(col)
    colors = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in report.checks:
        ct.add_row(c.name, RText(c.status, style=colors[c.status]), RText(c.detail))
    console.print(ct)
    if report.measured:
        t, th = report.texts, report.thresholds
        rt = Table(
            title=f"greedy acceptance on the target's own text ({t['generated_tokens']} generated tokens, "
            f"{t['prompts']} texts, {t['anchors']} anchors, {len(report.rounds)} rounds; "
            f"better = {th['min_gain']:.0%} more tokens per step or {th['loglik_min_gain']} nats more "
            f"log-probability per slot, at z >= {th['z_better']:.2f})"
        )
        rt.add_column("reading", no_wrap=True)
        rt.add_column("tau", justify="right")
        rt.add_column("slots 1-4", no_wrap=True)
        rt.add_column("loglik", justify="right")
        rt.add_column("fc misfit", justify="right")  # the weights' fingerprint of the taps (bench/fingerprint.py)
        # Two narrow tables instead of one wide one: they stay readable in an 80-column terminal.
        vt = Table(title="each reading against the declared one, paired on the same anchors")
        vt.add_column("reading", no_wrap=True)
        vt.add_column("tau gain (z)", justify="right", no_wrap=True)
        vt.add_column("nats gain (z)", justify="right", no_wrap=True)
        vt.add_column("status", no_wrap=True)
        # The declared reading, each single change, open ones and the explaining reading; --json lists all.
        shown = [r for r in report.readings if len(r.factors) <= 1 or r is report.best or r.name in report.undecided]
        for r in shown:
            rt.add_row(
                r.name,
                f"{r.accept_length:.2f}",
                " ".join(f"{x:.2f}".lstrip("0") for x in r.per_slot[:4]),
                f"{r.mean_loglik:.3f}",
                f"{report.fits[r.name].misfit:.3f}" if r.name in report.fits else "-",
            )
            cmp = report.comparisons.get(r.name)
            if cmp is not None:
                style = {"better": "bold red", "open": "yellow", "not better": ""}[cmp.status]
                vt.add_row(
                    r.name,
                    f"{cmp.gain:+.0%} ({cmp.z:+.1f})",
                    f"{cmp.ll_gain:+.3f} ({cmp.ll_z:+.1f})",
                    RText(cmp.status + (f" ({cmp.by})" if cmp.by else ""), style=style),
                )
        console.print(rt)
        console.print(vt)
    for w in report.warnings:
        console.print(RText("warning: ", style="yellow") + RText(w))
    for dgn in report.diagnoses:
        console.print(RText("UNHEALTHY: ", style="bold red") + RText(dgn))
    v = report.verdict
    if v == "healthy":
        extra = "" if not report.warnings else ", but see the warnings above"
        console.print(
            RText(
                f"healthy: no other reading gives {report.thresholds['min_gain']:.0%} more tokens per step "
                f"or {report.thresholds['loglik_min_gain']} nats more log-probability per slot "
                f"({report.texts['anchors']} anchors, {report.seconds:.0f} s){extra}",
                style="bold green",
            )
        )
    elif v == "undecided":
        rows = [
            f"{n} ({c.gain:+.0%}, z {c.z:+.1f}; {c.ll_gain:+.3f} nats, z {c.ll_z:+.1f})"
            for n, c in ((n, report.comparisons[n]) for n in report.undecided)
        ]
        console.print(
            RText(
                f"undecided after {report.texts['generated_tokens']} generated tokens: "
                f"{', '.join(rows)} neither clearly better nor excluded; rerun with a larger --max-tokens",
                style="bold yellow",
            )
        )
    elif v == "not measured":
        console.print(RText("undecided: no static check failed, but nothing was measured", style="bold yellow"))
    elif v == "unhealthy":
        console.print(RText("UNHEALTHY: a static check failed (see above)", style="bold red"))
