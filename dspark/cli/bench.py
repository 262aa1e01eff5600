"""`dspark bench`: plain transformers, prompt lookup and dspark arms, side by side in one run.

    dspark bench --target smollm2 --dataset-dir ../shared/datasets --limit 10 --max-new-tokens 128 --out bench-out

Writes under --out: results.json (everything), results.md (tables), acceptance_per_position.png,
speedup.png and speculation_profile.json (validated; from the `full` arm when it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dspark.api import build_engine
from dspark.bench.machine import load_average, machine_info
from dspark.bench.profile import ProfileError, build_profile, checkpoint_id, write_profile
from dspark.bench.prompts import load_sets
from dspark.bench.report import markdown, plots
from dspark.bench.runner import (
    EngineRunner,
    ForwardTimer,
    HFRunner,
    aggregate,
    default_arms,
    interleaved,
    parse_arms,
    sampling_params,
)
from dspark.bench.runtime import parse_arms as parse_runtime_arms
from dspark.bench.runtime import run as runtime_arms
from dspark.bench.runtime import table as runtime_table
from dspark.cli.engine_flags import add_engine_flags, engine_config, print_notes, refuse_max_batch, refuse_verify
from dspark.engine.scheduler import DEFAULT_THRESHOLD, make_scheduler
from dspark.errors import DSparkError
from dspark.prompts import encode_prompts
from dspark.target.load import SMOLLM2

DEFAULT_CONCURRENCY = 4
RUNTIME_CONTEXT = 200  # cached tokens under the runtime arms' verify-cost forwards


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument(
        "--dataset-dir",
        default=None,
        help='folder of {"turns": [...]} JSONL sets (gsm8k, math500, aime25, humaneval, mbpp)',
    )
    p.add_argument(
        "--sets",
        default=None,
        help="comma-separated prompt sets to run (default: every set found, then 'chat', then --prompts files)",
    )
    p.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="FILE",
        help="extra prompt set: JSONL with 'turns' or 'prompt', or text one prompt a line (repeatable)",
    )
    p.add_argument("--limit", type=int, default=10, help="prompts per set (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="base seed when sampling (prompt i uses seed + i in every arm)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of through the chat template")
    p.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"requests decoded together by the batched adaptive arm (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--arms",
        default=None,
        help="comma-separated arms among hf, lookup, plain, full, threshold, adaptive; NAME@N decodes N "
        "requests together (default: hf,lookup,plain,full,adaptive,adaptive@CONCURRENCY); the arms "
        "take the place of --verify, and --threshold, --calibration, --cost-curve, --always-draft "
        "configure theirs",
    )
    p.add_argument("--baseline", default="hf", help="arm that ratios are taken against (default hf)")
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of the lookup arm")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of every arm")
    p.add_argument(
        "--runtimes",
        default=None,
        metavar="ARMS",
        help="also measure target runtimes side by side (e.g. hf-bf16,hf-fp32,native-bf16,native-auto; llamacpp with "
        "the optional extra llama-cpp-python): "
        "plain-decoding tokens/s against transformers generate, engine overhead and the cost of an "
        "8-token verify against a 1-token step, in results.json/md under 'runtimes'",
    )
    p.add_argument("--runtime-rounds", type=int, default=3, help="alternated rounds of the runtime arms")
    p.add_argument("--out", required=True, help="output folder (created)")


def _check_args(args) -> None:
    if args.limit < 1:
        raise DSparkError("--limit must be >= 1")
    if args.max_new_tokens < 1:
        raise DSparkError("--max-new-tokens must be >= 1")
    if args.concurrency < 1:
        raise DSparkError("--concurrency must be >= 1")
    if args.lookup_tokens < 1:
        raise DSparkError("--lookup-tokens must be >= 1")
    if args.runtime_rounds < 1:
        raise DSparkError("--runtime-rounds must be >= 1")
    if args.runtimes is not None:
        parse_runtime_arms(args.runtimes)


def reproduce_command(args) -> str:
    """The command line that repeats this run (from the parsed flags, so it is canonical)."""
    parts = ["dspark", "bench", "--target", args.target]
    if args.draft:
        parts += ["--draft", args.draft]
    parts += ["--dtype", args.dtype]
    if args.runtime != "hf":
        parts += ["--runtime", args.runtime]
    for flag in ("device", "layout", "threads", "calibration", "cost_curve", "dataset_dir", "sets"):
        v = getattr(args, flag)
        if v is not None:
            parts += [f"--{flag.replace('_', '-')}", str(v)]
    for f in args.prompts:
        parts += ["--prompts", f]
    parts += ["--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens)]
    if args.temperature:
        parts += [
            "--temperature",
            str(args.temperature),
            "--top-k",
            str(args.top_k),
            "--top-p",
            str(args.top_p),
            "--seed",
            str(args.seed),
        ]
    if args.threshold != DEFAULT_THRESHOLD:
        parts += ["--threshold", str(args.threshold)]
    for flag in ("no_spec", "no_draft", "always_draft", "no_check", "ignore_eos", "no_chat", "no_warmup"):
        if getattr(args, flag):
            parts.append(f"--{flag.replace('_', '-')}")
    parts += [
        "--concurrency",
        str(args.concurrency),
        "--arms",
        args.arms_resolved,
        "--baseline",
        args.baseline,
        "--lookup-tokens",
        str(args.lookup_tokens),
    ]
    if args.runtimes:
        parts += ["--runtimes", args.runtimes, "--runtime-rounds", str(args.runtime_rounds)]
    parts += ["--out", args.out]
    return " ".join(shlex.quote(p) for p in parts)


def _target_id(target: str) -> str | None:
    return "HuggingFaceTB/SmolLM2-135M-Instruct" if target == SMOLLM2 else checkpoint_id(target)


def build_runners(arms, engine, args) -> dict:
    """One runner per arm, all on the built engine's loaded target: transformers arms call its
    model, dspark arms are engines derived from it (plain, or the draft with the arm's policy)."""
    model, tokenizer = engine.target.model, engine.tokenizer
    eos = engine.eos_token_ids
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = pad if pad is not None else (eos[0] if eos else 0)
    runners: dict[str, HFRunner | EngineRunner] = {}
    for arm in arms:
        if arm.kind in ("hf", "lookup"):
            runners[arm.name] = HFRunner(model, eos, pad, args.lookup_tokens if arm.kind == "lookup" else None)
        elif not arm.speculative:
            runners[arm.name] = EngineRunner(engine.derive(speculative=False, max_batch=arm.concurrency))
        else:
            policy = make_scheduler(
                arm.kind,
                engine.target,
                engine.draft,
                threshold=args.threshold,
                calibration=args.calibration,
                curve=args.cost_curve,
                max_batch=arm.concurrency,
                skip=not args.always_draft,
                prior=engine.prior,
            )
            # a `full` arm verifies the draft's every block, the draft alone: the reference for the
            # draft's acceptance (and the speculation profile); the others propose as the engine does, and
            # with --no-draft the full arm is the lookup alone
            lookup = False if arm.kind == "full" and engine.draft is not None else None
            runners[arm.name] = EngineRunner(engine.derive(policy=policy, max_batch=arm.concurrency, lookup=lookup))
    return runners


def run(args) -> int:
    _check_args(args)
    args.arms_resolved = args.arms or default_arms(args.concurrency)
    arms = parse_arms(args.arms_resolved)
    names = [a.name for a in arms]
    if args.baseline not in names:
        raise DSparkError(f"--baseline {args.baseline!r} is not among the arms {names}")
    speculative = any(a.speculative for a in arms)
    if args.no_spec and speculative:
        raise DSparkError(
            "--no-spec leaves only the arms without a draft (hf, lookup, plain): drop the others from --arms"
        )
    if args.no_draft:
        if not speculative:
            raise DSparkError("--no-draft speculates from the text alone in the 'full' arm: add full to --arms")
        if any(a.kind in ("threshold", "adaptive") for a in arms):
            raise DSparkError(
                "--no-draft loads no draft, and the threshold and adaptive arms size a draft's block: keep plain, "
                "hf, lookup and full in --arms"
            )
    refuse_verify(args, "bench", f"add {args.verify} to --arms")
    refuse_max_batch(args, "bench", "the arms (NAME@N)")
    sets = load_sets(args.dataset_dir, args.sets.split(",") if args.sets else None, args.prompts, args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    engine = build_engine(
        engine_config(args, no_spec=not speculative, max_batch=max(a.concurrency for a in arms), verify="full")
    )  # the arms bring their own policies
    print_notes(engine)
    config, tokenizer, draft = engine.config, engine.tokenizer, engine.draft
    if tokenizer is None:
        raise DSparkError(f"target {args.target!r} has no tokenizer: bench feeds text prompts")
    draft_path = config.draft
    args.dtype = config.dtype  # "auto" written out: results name the dtype that ran
    device = config.device
    machine = machine_info(device)
    load = machine["load_average_start"]
    cores = os.cpu_count()
    if load and cores and load[0] > 0.5 * cores:
        print(
            f"note: load average {load[0]} on {cores} cores before the run: other work shares this "
            "machine, tokens/s will be noisy (ratios suffer less: arms are interleaved)",
            file=sys.stderr,
        )
    runners = build_runners(arms, engine, args)

    chat = not args.no_chat and bool(getattr(tokenizer, "chat_template", None))
    if not args.no_chat and not chat:
        print("note: the target's tokenizer has no chat template: prompts are fed raw", file=sys.stderr)
    # a `prompt_ids` record is fed as it is, as every other command that reads prompt files feeds it
    encoded = {ps.name: encode_prompts(engine, ps.prompts, chat) for ps in sets}
    params_for = sampling_params(
        args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.ignore_eos
    )

    model = engine.target.model
    timer = ForwardTimer(model, device)
    try:
        if not args.no_warmup:
            # First calls allocate caches and pick kernels: keep that out of every arm's numbers.
            first = encoded[sets[0].name][0]
            warm = replace(params_for(0), max_new_tokens=min(8, args.max_new_tokens))
            for arm in arms:
                runners[arm.name]([first] * arm.concurrency, [warm] * arm.concurrency)
        total = sum(len(v) for v in encoded.values())
        print(
            f"bench: {len(arms)} arms x {total} prompts ({', '.join(f'{s.name} {len(s.prompts)}' for s in sets)})",
            file=sys.stderr,
        )
        chunks = interleaved(arms, runners, sets, encoded, params_for, timer, device, progress=_progress)
    finally:
        timer.close()
    runtimes = None
    if args.runtimes:
        rt_arms = parse_runtime_arms(args.runtimes)
        threads = torch.get_num_threads()
        print(f"bench: runtime arms {', '.join(rt_arms)}", file=sys.stderr)
        rows = runtime_arms(
            rt_arms, threads, args.max_new_tokens, args.runtime_rounds, RUNTIME_CONTEXT, args.target, device
        )
        runtimes = {
            "threads": threads,
            "tokens": args.max_new_tokens,
            "context": RUNTIME_CONTEXT,
            "rows": rows,
            "table": runtime_table(rows, threads, args.max_new_tokens, RUNTIME_CONTEXT, args.target),
        }
    machine["load_average_end"] = load_average()
    table = aggregate(chunks, arms, [s.name for s in sets])
    profile_arm = _profile_arm(arms) if draft is not None else None  # the draft's per-position profile
    results: dict[str, Any] = {
        "command": reproduce_command(args),
        "machine": machine,
        "config": {
            "target": args.target,
            "draft": str(draft_path) if draft_path else None,
            "dtype": args.dtype,
            "layout": draft.spec.layout if draft is not None else None,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "chat": chat,
            "limit": args.limit,
            "arms": names,
            "baseline": args.baseline,
            "lookup_tokens": args.lookup_tokens,
            "warmup": not args.no_warmup,
            "prompt_sets": {s.name: {"prompts": len(s.prompts), "source": s.source} for s in sets},
        },
        "gamma": draft.spec.gamma if draft is not None else None,
        "profile_arm": profile_arm.name if profile_arm else None,
        "sets": {
            s: {"arms": {n: st.to_dict(arms_stats[args.baseline]) for n, st in arms_stats.items()}}
            for s, arms_stats in table.items()
        },
    }
    if runtimes is not None:
        results["runtimes"] = runtimes
    if args.temperature > 0:
        # sampled arms draw from different random streams: equal text says nothing about losslessness
        for block in results["sets"].values():
            for arm in block["arms"].values():
                arm["same_output_as_baseline"] = None
    files = {"results_json": out / "results.json", "results_md": out / "results.md"}
    refused = None
    if profile_arm is not None:
        profiled = table["all"][profile_arm.name].metrics
        if profiled is None or profiled.steps == 0:
            results["profile_skipped"] = f"arm {profile_arm.name} made no verify step (every request ended at prefill)"
            print(f"note: no speculation profile: {results['profile_skipped']}", file=sys.stderr)
        else:
            try:
                files["profile"] = _write_profile(args, table, profile_arm, draft, draft_path, machine, sets, out, chat)
            except ProfileError as exc:
                # keep the measurements (they show what went wrong), then fail the command
                refused, results["profile_error"] = exc, str(exc)
    for p in plots(results, out):
        files[p.stem] = p
    results["files"] = {k: str(v) for k, v in files.items()}
    files["results_json"].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    md = markdown(results)
    files["results_md"].write_text(md, encoding="utf-8")
    print(md)
    print(f"wrote {', '.join(str(v) for v in files.values())}", file=sys.stderr)
    if refused is not None:
        raise refused
    return 0


def _progress(chunk) -> None:
    tok = sum(len(o) for o in chunk.outputs)
    where = f"{chunk.set} #{chunk.indices[0]}" + (f"-{chunk.indices[-1]}" if len(chunk.indices) > 1 else "")
    print(
        f"  {where:<16} {chunk.arm:<12} {tok:>5} tok {chunk.wall_s:7.2f} s  {tok / max(chunk.wall_s, 1e-9):7.1f} tok/s",
        file=sys.stderr,
    )


def _profile_arm(arms):
    """The arm whose acceptance describes the draft: full verification at batch 1 when measured."""
    spec = [a for a in arms if a.speculative]
    if not spec:
        return None
    return min(spec, key=lambda a: (a.kind != "full", a.concurrency))


def _write_profile(args, table, arm, draft, draft_path, machine, sets, out: Path, chat: bool) -> Path:
    overall = table["all"][arm.name]
    spec = draft.spec
    profile = build_profile(
        overall.metrics,
        per_request=overall.per_request,
        draft_checkpoint={
            "id": checkpoint_id(str(draft_path)),
            "format": spec.format,
            "layout": spec.layout,
            "layout_source": spec.layout_source,
            "hidden_state_indices": list(spec.hidden_state_indices),
            "mask_token_id": spec.mask_token_id,
            "markov_head_type": spec.markov_head_type,
        },
        target_model={"id": _target_id(args.target), "dtype": args.dtype},
        block_size=spec.block_size,
        per_category={
            s.name: (table[s.name][arm.name].metrics, table[s.name][arm.name].requests)
            for s in sets
            if table[s.name][arm.name].metrics is not None
        },
        measurement_conditions={
            "engine": "dspark",
            "arm": arm.name,
            "verify_policy": arm.kind,
            "concurrency": arm.concurrency,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": args.ignore_eos,
            "chat_template": chat,
            "datasets": {s.name: len(s.prompts) for s in sets},
            "dtype": args.dtype,
            "device": machine["device"],
            "hardware": machine["gpu"] or machine["cpu"],
            "torch_threads": machine["torch_threads"],
            "torch": machine["torch"],
            "transformers": machine["transformers"],
            "date": machine["date"],
        },
    )
    return write_profile(profile, out / "speculation_profile.json")
