"""`dspark bench-runtime`: target runtimes and weight formats side by side (dspark.bench.runtime)."""

from __future__ import annotations

import argparse

import torch

from dspark.bench.runtime import DEFAULT_ARMS, run as run_arms, table
from dspark.target.load import load_target
from dspark.target.native import resolve_weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated (default {DEFAULT_ARMS})")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=200, help="cached tokens under the verify-cost forwards")


def run(args) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    rows = run_arms(arms, args.threads, args.tokens, args.rounds, args.context)
    print(table(rows, args.threads, args.tokens, args.context))
    auto = resolve_weights(load_target("smollm2", "fp32", "cpu")[0], "auto", "cpu")
    print(f"\nweights='auto' picks {auto!r} for SmolLM2 here")
    return 0
