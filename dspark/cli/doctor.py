"""`dspark doctor`: the doctor's check (dspark.bench.doctor) on the command line, and its report."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text as RText

from dspark.api import build_engine, resolve_draft
from dspark.bench.doctor import _PRETTY, Report, diagnose
from dspark.cli.engine_flags import add_engine_flags, engine_config, print_notes
from dspark.errors import DSparkError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument("--tokens", type=int, default=32, help="tokens the target generates per prompt (default 32)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt to generate from instead of the built-in ones (repeatable)")
    p.add_argument("--mask-candidates", default="", help="comma-separated extra mask token ids to try")
    p.add_argument("--strict", action="store_true", help="exit 3 on warnings too")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def run(args) -> int:
    if args.tokens < 2:
        raise DSparkError("--tokens must be >= 2")
    try:
        extra = [int(x) for x in args.mask_candidates.split(",") if x.strip()]
    except ValueError:
        raise DSparkError(f"--mask-candidates must be comma-separated integers, got {args.mask_candidates!r}") from None
    if args.no_spec:
        raise DSparkError("the doctor examines a draft: drop --no-spec")
    # The doctor builds the draft itself (from a spec it may find broken): the engine brings the
    # target, tokenizer and settings; --layout forces the declared reading the doctor starts from.
    draft = resolve_draft(args.target, args.draft, "")
    engine = build_engine(engine_config(args, no_spec=True, check=False))
    print_notes(engine)
    report = diagnose(engine, str(draft), new_tokens=args.tokens, prompts=args.prompt,
                      n_prompts=len(args.prompt) if args.prompt else 3, extra_masks=extra, layout=args.layout)
    if args.json:
        print(json.dumps(report.to_json(args.strict), indent=2))
    else:
        print_report(report)
    return report.exit_code(args.strict)


def print_report(report: Report) -> None:
    console = Console()
    d = report.declared
    console.print(RText(f"dspark doctor: draft {report.draft} on target {report.target}", style="bold"))
    console.print(RText(f"declared: {d.format}, {_PRETTY[d.layout]} ({d.layout_source}), gamma {d.gamma}, "
                        f"hidden_state_indices {list(d.hidden_state_indices)}, mask_token_id {d.mask_token_id}"))
    ct = Table(title="static checks")
    for col in ("check", "status", "detail"):
        ct.add_column(col)
    colors = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in report.checks:
        ct.add_row(c.name, RText(c.status, style=colors[c.status]), RText(c.detail))
    console.print(ct)
    if report.readings:
        t = report.texts
        rt = Table(title=f"teacher-forced agreement with the target ({t['generated_tokens']} generated tokens, "
                         f"{t['anchors']} anchors; tau = greedy acceptance length on this text)")
        rt.add_column("reading", no_wrap=True)
        rt.add_column("agree", justify="right")
        rt.add_column("per slot", no_wrap=True)
        rt.add_column("tau", justify="right")
        rt.add_column("vs declared")
        # The table shows the declared reading, each single change, and the explaining reading;
        # --json lists every combination.
        shown = [r for r in report.readings if len(r.factors) <= 1 or r is report.best]
        for r in shown:
            c = report.comparisons.get(r.name)
            vs = "-" if c is None else f"z {c['z']:+.1f}" + (" BETTER" if c["better"] else "")
            rt.add_row(r.name, f"{r.agreement:.2f}", " ".join(f"{x:.2f}".lstrip("0") for x in r.per_slot), f"{r.accept_length:.2f}",
                       RText(vs, style="red" if c and c["better"] else ""))
        console.print(rt)
    for w in report.warnings:
        console.print(RText("warning: ", style="yellow") + RText(w))
    for dgn in report.diagnoses:
        console.print(RText("UNHEALTHY: ", style="bold red") + RText(dgn))
    if report.healthy and report.readings and not report.warnings:
        console.print(RText("healthy: the declared reading is the best one tried", style="bold green"))
    elif report.healthy and report.readings:
        console.print(RText("no misreading found, but see the warnings above", style="yellow"))
    elif report.healthy:
        console.print(RText("no static check failed, but nothing was measured", style="yellow"))
    elif not report.diagnoses:
        console.print(RText("UNHEALTHY: a static check failed (see above)", style="bold red"))
