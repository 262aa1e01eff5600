"""Calibration of `dspark doctor` on tiny trained drafts (docs/history/benchmarks.md, "Calibration").

Trains the tiny pattern target of tests/trained.py and eight drafts of it with dspark.train's
pieces (strong: 240 steps, weak: 90 steps; anchor-first and bonus-anchor; fc fitted to raw taps,
and to RMS-scaled taps with the scale folded in as `dspark train` does), writes each healthy
draft and its lying variants (layout flipped with block_size adjusted, taps shifted by -1 (+1 would
name a layer the 2-layer target lacks: a static failure), wrong mask token) as speculators files, and runs the
doctor's default check on several
prompt sets (seeded random prompts: the tiny target has no tokenizer). Prints one JSON line per
run and a markdown table.

    PYTHONPATH=. python scripts/doctor_calibration.py [--sets 3] [--out DIR]

With --draft (repeatable), real drafts of a real target instead: each draft file and its lying
variants (the same weights with an edited config.json: layout flipped with block_size and
speculative_tokens adjusted, aux_hidden_state_layer_ids - 1, mask_token_id 2) go through the
`dspark doctor` command exactly as a user runs it (default settings; --prompts adds a prompt file).

    PYTHONPATH=. python scripts/doctor_calibration.py --target smollm2 --draft DIR [--draft DIR2] [--prompts F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from dspark.api import EngineConfig, build_engine
from dspark.doctor.check import diagnose
from dspark.doctor.quick import quick_check
from dspark.doctor.readings import layout_readings
from dspark.doctor.report import EXIT_UNHEALTHY
from dspark.formats.convert import write_speculators
from tests.trained import TAPS, WEAK_STEPS, _train_draft, _train_target

LIES = {
    "none": lambda s: s,
    "layout flipped": lambda s: layout_readings(s)[1][0],
    "taps -1": lambda s: replace(s, hidden_state_indices=tuple(i - 1 for i in TAPS)),
    "mask 2": lambda s: replace(s, mask_token_id=2),
}


def _flip_layout(cfg: dict) -> None:
    gamma = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    cfg["sample_from_anchor"] = not cfg["sample_from_anchor"]
    cfg["block_size"] = gamma if cfg["sample_from_anchor"] else gamma + 1


CONFIG_LIES = {
    "none": lambda c: None,
    "layout flipped": _flip_layout,
    "taps -1": lambda c: c.update(aux_hidden_state_layer_ids=[i - 1 for i in c["aux_hidden_state_layer_ids"]]),
    "mask 2": lambda c: c.update(mask_token_id=2),
}


def real_drafts(args) -> None:
    """Each speculators draft and its config-edited lies through `dspark doctor --json`."""
    root = Path(args.out or tempfile.mkdtemp(prefix="doctor-cal-"))
    print(
        "| draft | true tau | lie | verdict | exit | generated tokens / anchors | wall s | load-time check |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    for draft in map(Path, args.draft):
        truth = None
        for lie, edit in CONFIG_LIES.items():
            if args.lies and lie.replace(" ", "") not in args.lies.split(","):
                continue
            path = root / f"{draft.name}-{lie.replace(' ', '')}"
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(draft, path)
            cfg = json.loads((path / "config.json").read_text())
            edit(cfg)
            (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            cmd = [sys.executable, "-m", "dspark", "doctor", "--target", args.target, "--draft", str(path), "--json"]
            cmd += ["--prompts", args.prompts] if args.prompts else []
            cmd += ["--threads", str(args.threads)] if args.threads else []
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            (root / f"{path.name}.json").write_text(proc.stdout)
            # the engine's load-time check (what `dspark generate` runs before decoding) on the same file
            load_time = "-"
            if not args.no_load_time:
                t1 = time.perf_counter()
                warned = quick_check(
                    build_engine(EngineConfig(target=args.target, draft=str(path), check=False, threads=args.threads))
                )
                load_time = f"{'warns' if warned else 'quiet'}, {time.perf_counter() - t1:.0f} s"
            try:
                r = json.loads(proc.stdout)
            except json.JSONDecodeError:
                print(
                    f"| {draft.name} | ? | {lie} | failed: {proc.stderr.strip().splitlines()[-1:]} "
                    f"| {proc.returncode} | | |"
                )
                continue
            readings = r.get("readings") or []
            declared = readings[0]["accept_length"] if readings else None
            truth = declared if lie == "none" else truth
            best = r.get("explained_by")
            verdict = r["verdict"] + (f" -> {best}" if best and r["verdict"] == "misread" else "")
            if best and r.get("found_by") == "weights":
                fits = r["fingerprint"]
                verdict += (
                    f" (by fc's weights: misfit {fits['declared']['misfit']:.3f} -> {fits[best]['misfit']:.3f}, "
                    f"correlation {fits[best]['correlation']:.2f})"
                )
            elif best and r["verdict"] == "misread":  # which statistic decided, and by how much
                c = next(x["vs_declared"] for x in readings if x["name"] == best)
                verdict += (
                    f" ({c['gain']:+.0%}, z {c['z']:.1f}; {c['loglik_gain']:+.3f} nats, z {c['loglik_z']:.1f}; "
                    f"by {c['by'] or 'the evidence reading'})"
                )
            t = r.get("text") or {}
            print(
                f"| {draft.name} | {truth if truth is None else round(truth, 2)} | {lie} | {verdict} | "
                f"{proc.returncode} | {t.get('generated_tokens')} / {t.get('anchors')} | {wall:.0f} | {load_time} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", type=int, default=3, help="prompt sets (seeds)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--draft", action="append", default=None, help="a real speculators draft (repeatable)")
    ap.add_argument("--target", default="smollm2", help="with --draft: the target")
    ap.add_argument("--prompts", default=None, help="with --draft: a prompt file the doctor uses first")
    ap.add_argument("--threads", type=int, default=None, help="with --draft: the doctor's --threads")
    ap.add_argument("--no-load-time", action="store_true", help="with --draft: skip the load-time check")
    ap.add_argument(
        "--lies",
        default=None,
        help="with --draft: comma-separated subset of none,layoutflipped,taps-1,mask2 (default: all)",
    )
    args = ap.parse_args()
    if args.draft:
        return real_drafts(args)
    torch.set_num_threads(1)
    root = Path(args.out or tempfile.mkdtemp(prefix="doctor-cal-"))
    model = _train_target()
    model.save_pretrained(root / "target")
    rows = []
    plan = [
        (strength, steps, layout, scaled)
        for scaled in (False, True)
        for strength, steps in (("strong", 240), ("weak", WEAK_STEPS))
        for layout in ("anchor_first", "bonus_anchor")
    ]
    for strength, steps, layout, scaled in plan:
        # scaled: fc fitted to taps / RMS and the scale folded in, as `dspark train` does (its weight fingerprint)
        draft = _train_draft(model, steps=steps, layout=layout, scaled=scaled)
        tensors = draft.own_state_dict()
        name = f"{strength}{'-scaled' if scaled else ''}"
        for lie, edit in LIES.items():
            path = root / f"{name}-{layout}-{lie.replace(' ', '')}"
            write_speculators(edit(draft.spec), tensors, path)
            for seed in range(1, args.sets + 1):
                g = torch.Generator().manual_seed(seed)
                prompts = [torch.randint(4, 64, (8,), generator=g).tolist() for _ in range(64)]
                t0 = time.perf_counter()
                r = diagnose(
                    build_engine(
                        EngineConfig(target=str(root / "target"), dtype="fp32", device="cpu", no_spec=True, check=False)
                    ),
                    str(path),
                    prompts=prompts,
                )
                row = {
                    "draft": f"tiny {name} {layout}",
                    "lie": lie,
                    "set": seed,
                    "true_tau": None,
                    "declared_tau": round(r.readings[0].accept_length, 2) if r.readings else None,
                    "verdict": r.verdict,
                    "exit": r.exit_code(),
                    "explained_by": r.best.name if r.best else None,
                    "found_by": r.found_by,
                    "anchors": r.texts.get("anchors"),
                    "seconds": round(time.perf_counter() - t0, 1),
                    "correct": (r.verdict == "healthy") if lie == "none" else (r.exit_code() == EXIT_UNHEALTHY),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    truth = {(r["draft"], r["set"]): r["declared_tau"] for r in rows if r["lie"] == "none"}
    print(
        "\n| draft | true tau | lie | verdict (per prompt set) | anchors | seconds (max) |\n|---|---|---|---|---|---|"
    )
    keys = sorted({(r["draft"], r["lie"]) for r in rows}, key=lambda k: (k[0], list(LIES).index(k[1])))
    for d, lie in keys:
        rs = [r for r in rows if r["draft"] == d and r["lie"] == lie]
        taus = [truth[(d, r["set"])] for r in rs]
        verdicts = ", ".join(r["verdict"] + (" (weights)" if r["found_by"] == "weights" else "") for r in rs)
        print(
            f"| {d} | {min(taus):.2f}-{max(taus):.2f} | {lie} | {verdicts} | "
            f"{'/'.join(str(r['anchors']) for r in rs)} | {max(r['seconds'] for r in rs):.1f} |"
        )


if __name__ == "__main__":
    main()
