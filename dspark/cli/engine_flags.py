"""The flags of EngineConfig, shared by every command that decodes (generate, serve, bench,
bench-batch, calibrate, doctor, train eval): one definition, so a flag works everywhere."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from dspark.api import EngineConfig
from dspark.engine.scheduler import DEFAULT_THRESHOLD, POLICIES
from dspark.errors import DSparkError
from dspark.formats.load import LAYOUTS
from dspark.kernels import ACTIVATIONS, KERNELS
from dspark.model.fast import DRAFT_WEIGHTS
from dspark.target.load import DTYPE_CHOICES, RUNTIMES, SMOLLM2
from dspark.target.quant import WEIGHTS


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--target", default=SMOLLM2, help="HF model directory, or 'smollm2' (default)")
    g.add_argument("--draft", default=None, help="draft checkpoint directory (default: the bundled draft for smollm2)")
    g.add_argument("--no-spec", action="store_true", help="plain target decoding through the same code path")
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPE_CHOICES,
        help=f"target and draft dtype (default {d.dtype}; auto: bf16 where the hardware has it natively)",
    )
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument(
        "--runtime",
        default=d.runtime,
        choices=RUNTIMES,
        help="target runtime: auto (default: native where the architecture is supported, else hf), "
        "native (dspark's own), hf (transformers)",
    )
    g.add_argument(
        "--weights",
        default=d.weights,
        choices=WEIGHTS,
        help="native weight format (default auto: the model's own numbers, int4 where they are exact 4-bit)",
    )
    g.add_argument(
        "--draft-weights",
        default=d.draft_weights,
        choices=DRAFT_WEIGHTS,
        help="the draft's matrices on dspark's CPU kernels: auto (Q4_1 matrices, the head in Q8_0, the "
        "format the target runs its own head rows in), q4 (Q4_1 everywhere: the fewest bytes), q8 (Q8_0), "
        "bf16 (the draft's own numbers), fp32 (the draft's own numbers in fp32 through its modules: "
        "what auto gives with an explicit --dtype fp32)",
    )
    g.add_argument(
        "--activations",
        default=d.activations,
        choices=ACTIVATIONS,
        help="activations of dspark's int4 / Q8_0 CPU matmuls: auto (default: 8-bit per 32 inputs on AVX2, "
        "as llama.cpp runs the file, and on Intel Xeon with AMX; bf16 on other AVX-512 CPUs), int8, bf16 "
        "(closer to the model; slower on AVX2 and Intel)",
    )
    g.add_argument(
        "--kernels",
        default=d.kernels,
        choices=KERNELS,
        help="dspark's CPU kernels: auto (default: the best build this CPU has, with its AMX tiles where "
        "there are), amx, avx512 (without AMX tiles), avx2, generic (plain C++, any CPU), torch (none: "
        "torch's ops); each computes its "
        "own numbers (to compare and diagnose)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=None,
        help="force a block layout against the file (experts and diagnosis; warns loudly)",
    )
    g.add_argument(
        "--verify",
        choices=POLICIES,
        default=d.verify,
        help="verification policy (default: adaptive with a draft, full without)",
    )
    g.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help=f"confidence cut of --verify threshold (default {DEFAULT_THRESHOLD})",
    )
    g.add_argument("--calibration", default=None, help="STS file written by `dspark calibrate` (threshold, adaptive)")
    g.add_argument(
        "--cost-curve",
        default=None,
        help="--verify adaptive: cost-curve JSON (default: profile the target at start-up, cached)",
    )
    g.add_argument(
        "--always-draft",
        action="store_true",
        help="--verify adaptive: draft every step, even when earlier steps say it does not pay",
    )
    g.add_argument(
        "--max-batch", type=int, default=d.max_batch, help=f"requests decoded together (default {d.max_batch})"
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=d.prefill_chunk,
        help=f"prompt tokens prefilled per engine step (default {d.prefill_chunk}): a longer prompt is prefilled in "
        "chunks between the decode steps of the running requests, which it delays by one chunk a step",
    )
    g.add_argument(
        "--no-lookup",
        action="store_true",
        help="propose with the draft alone (default: also from the request's own text, the prompt and the output "
        "so far, chosen per request and step by expected tokens per second)",
    )
    g.add_argument(
        "--no-draft",
        action="store_true",
        help="speculate from the request's own text alone (lookup): no draft is loaded, so any target speculates "
        "(default: the draft and the lookup, chosen per request and step)",
    )
    g.add_argument("--no-check", action="store_true", help="skip the draft check at load time (a short doctor run)")


def no_draft_flag(args: argparse.Namespace) -> str | None:
    """The flag that loads no draft (--no-spec, --no-draft), for the commands that examine one."""
    return "--no-spec" if args.no_spec else "--no-draft" if args.no_draft else None


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig the flags describe; `overrides` are settings the command fixes itself."""
    config = EngineConfig(
        target=args.target,
        draft=args.draft,
        no_spec=args.no_spec,
        no_draft=args.no_draft,
        dtype=args.dtype,
        device=args.device,
        runtime=args.runtime,
        weights=args.weights,
        draft_weights=args.draft_weights,
        activations=args.activations,
        kernels=args.kernels,
        threads=args.threads,
        layout=args.layout,
        verify=args.verify,
        threshold=args.threshold,
        calibration=args.calibration,
        cost_curve=args.cost_curve,
        always_draft=args.always_draft,
        max_batch=args.max_batch,
        lookup=not args.no_lookup,
        prefill_chunk=args.prefill_chunk,
        check=not args.no_check,
    )
    return replace(config, **overrides)


def refuse_max_batch(args: argparse.Namespace, command: str, instead: str) -> None:
    """For commands whose own flags size the batch: a --max-batch they would ignore is an error."""
    if args.max_batch != EngineConfig().max_batch:
        raise DSparkError(f"{command} decodes as many requests together as {instead} says: drop --max-batch")


def print_notes(engine) -> None:
    """What build_engine chose for the user (dtype auto, ...): one line each, on stderr."""
    for note in engine.notes:
        print(note, file=sys.stderr)


def refuse_verify(args: argparse.Namespace, command: str, instead: str) -> None:
    """For commands whose arms choose the policies: a --verify they would ignore is an error."""
    if args.verify is not None:
        raise DSparkError(f"{command} runs the policies its arms name: {instead}")
