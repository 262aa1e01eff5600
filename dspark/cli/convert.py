"""`dspark convert`: rewrite a draft for the other checkpoint family (bit-exact tensors)."""

from __future__ import annotations

import argparse

from dspark.formats.convert import convert
from dspark.formats.load import LAYOUTS
from dspark.outlock import output_lock


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="draft checkpoint to read")
    p.add_argument("dst", help="new (or empty) directory to write")
    p.add_argument("--to", required=True, choices=("speculators", "deepspec"), help="family to write")
    p.add_argument("--layout", choices=LAYOUTS, help="force the source layout (experts only)")
    p.add_argument("--verifier", help="verifier name or path to record in a speculators config")


def run(args: argparse.Namespace) -> int:
    with output_lock(args.dst, "dspark convert"):  # two converts into one directory would mix their files
        out = convert(args.src, args.dst, args.to, layout=args.layout, verifier=args.verifier)
    print(
        f"wrote {out.format} draft to {args.dst}: {out.layout} (gamma {out.gamma}, "
        f"block_size {out.block_size}, hidden_state_indices {list(out.hidden_state_indices)})"
    )
    for warning in out.warnings:
        print(f"warning: {warning}")
    return 0
