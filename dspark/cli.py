"""`dspark` command line: argument parsing only; each command calls into the packages.

Every DSparkError becomes one line on stderr and exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dspark.errors import DSparkError

# command name -> module exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "inspect": ("dspark.formats.commands", "inspect", "describe a draft checkpoint"),
    "convert": ("dspark.formats.commands", "convert", "rewrite a draft for another family"),
    "train": ("dspark.train.commands", "train", "train a DSpark draft for a target (data, fit, export)"),
    "calibrate": ("dspark.engine.commands", "calibrate", "fit per-position confidence temperatures (STS)"),
    "bench-batch": ("dspark.engine.commands", "bench_batch", "batched decoding: plain vs full/threshold/adaptive"),
    "generate": ("dspark.generate", "generate", "generate text with speculative decoding"),
    "bench": ("dspark.bench.command", "bench", "measure transformers and dspark arms side by side"),
    "doctor": ("dspark.bench.doctor_report", "doctor", "check empirically that a draft predicts its target as its file says"),
    "serve": ("dspark.serve.commands", "serve", "OpenAI-compatible HTTP server with speculative-decoding metrics"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """All commands for --help; only the chosen one otherwise (its module alone is imported)."""
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, attr, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(mod, f"add_{attr}_arguments")(p)
        p.set_defaults(_run=getattr(mod, f"run_{attr}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in COMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except DSparkError as exc:
        print(f"dspark {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
