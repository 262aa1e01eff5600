"""`dspark bench-runtime`: target runtimes and weight formats side by side (dspark.bench.runtime)."""

from __future__ import annotations

import argparse

import torch

from dspark.api import default_draft
from dspark.bench.runtime import DEFAULT_ARMS, LLAMACPP, parse_arms, table
from dspark.bench.runtime import run as run_arms
from dspark.errors import DSparkError
from dspark.model.fast import DRAFT_WEIGHTS
from dspark.target.load import SMOLLM2, load_target
from dspark.target.quant import resolve_weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=SMOLLM2, help="'smollm2' (default) or a Hugging Face model directory")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help=f"comma-separated (default {DEFAULT_ARMS}; native-<weights>@torch runs torch's ops instead of "
        f"dspark's CPU kernels); also {LLAMACPP}: llama.cpp decoding the target's "
        "GGUF file (needs the optional extra llama-cpp-python)",
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=200, help="cached tokens under the verify-cost forwards")
    p.add_argument(
        "--draft",
        default=None,
        help="draft whose drafting phase the native arms time (default: the bundled draft for smollm2)",
    )
    p.add_argument("--no-draft", action="store_true", help="time no drafting phase")
    p.add_argument(
        "--prefill",
        default=None,
        help="prompt lengths whose prefill each arm times, comma-separated ('' for none; default 512,2000, "
        "those the target holds)",
    )
    p.add_argument(
        "--draft-weights",
        default="auto",
        choices=DRAFT_WEIGHTS,
        help="the draft's matrices on dspark's CPU kernels (as the engine flag)",
    )


def run(args) -> int:
    arms = parse_arms(args.arms)
    if args.no_draft and args.draft:
        raise DSparkError("--draft and --no-draft: choose one")
    draft = None if args.no_draft else (args.draft or default_draft(args.target))
    try:
        prefill = None if args.prefill is None else tuple(int(n) for n in args.prefill.split(",") if n.strip())
    except ValueError:
        raise DSparkError(f"--prefill {args.prefill!r}: comma-separated prompt lengths, e.g. 512,2000") from None
    rows = run_arms(
        arms,
        args.threads,
        args.tokens,
        args.rounds,
        args.context,
        args.target,
        args.device,
        None if draft is None else str(draft),
        args.draft_weights,
        prefill,
    )
    print(table(rows, args.threads, args.tokens, args.context, args.target))
    auto = resolve_weights(load_target(args.target, "fp32", args.device)[0], "auto", args.device)
    print(f"\nweights='auto' picks {auto!r} for this target here")
    return 0
