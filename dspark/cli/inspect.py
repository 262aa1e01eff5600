"""`dspark inspect`: any DSpark draft read into one normalized description (a table or JSON)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dspark.formats.load import LAYOUTS, load_spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="draft checkpoint directory (config.json [+ model.safetensors]) or a config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        help="force the block-slot layout (experts only: a wrong layout runs and accepts almost nothing)",
    )


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.path, layout=args.layout)
    if args.json:
        print(json.dumps(spec.to_json(), indent=2))
    else:
        _print_table(spec.to_json())
    return 0


def _print_table(description: dict) -> None:
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
