"""`dspark inspect` and `dspark convert`.

Imports of torch, safetensors and rich stay inside the functions: building the parser for
`dspark --help` imports this module and must stay fast.
"""

from __future__ import annotations

import argparse
import json

LAYOUT_CHOICES = ("anchor_first", "bonus_anchor")


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="draft checkpoint directory (config.json [+ model.safetensors]) or a config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        help="force the block-slot layout (experts only: a wrong layout runs and accepts almost nothing)",
    )


def run_inspect(args: argparse.Namespace) -> int:
    from dspark.formats.load import load_spec  # noqa: PLC0415

    spec = load_spec(args.path, layout=args.layout)
    if args.json:
        print(json.dumps(spec.to_json(), indent=2))
    else:
        _print_table(spec.to_json())
    return 0


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="draft checkpoint to read")
    p.add_argument("dst", help="new (or empty) directory to write")
    p.add_argument("--to", required=True, choices=("speculators", "deepspec"), help="family to write")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, help="force the source layout (experts only)")
    p.add_argument("--verifier", help="verifier name or path to record in a speculators config")


def run_convert(args: argparse.Namespace) -> int:
    from dspark.formats.convert import convert  # noqa: PLC0415

    out = convert(args.src, args.dst, args.to, layout=args.layout, verifier=args.verifier)
    print(
        f"wrote {out.format} draft to {args.dst}: {out.layout} (gamma {out.gamma}, "
        f"block_size {out.block_size}, hidden_state_indices {list(out.hidden_state_indices)})"
    )
    for warning in out.warnings:
        print(f"warning: {warning}")
    return 0


def _print_table(description: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    # Text, not markup: values and warnings contain brackets that rich would parse as styles.

    table = Table(title="DSpark draft", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in description.items():
        if key in ("warnings", "layer_attention"):
            continue
        table.add_row(key, Text(_cell(value)))
    for i, att in enumerate(description["layer_attention"]):
        window = "full" if att["sliding_window"] is None else f"sliding {att['sliding_window']}"
        table.add_row(f"layer {i}", Text(f"{window}, {'causal' if att['causal'] else 'bidirectional'} in block"))
    console = Console()
    console.print(table)
    for warning in description["warnings"]:
        console.print(Text("warning: ", style="yellow") + Text(warning), highlight=False)


def _cell(value) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return "-" if value is None else str(value)
