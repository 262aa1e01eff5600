"""dspark: lossless DSpark speculative decoding, draft tools and measurements.

The command layer: all argparse and all printing live in this package, one module per command;
each builds its engine through dspark.api and calls the library.

Every DSparkError becomes one line on stderr and exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dspark.errors import DSparkError

# command -> (module in dspark.cli exposing add_arguments(parser) and run(args) -> int, help)
COMMANDS = {
    "inspect": ("inspect", "describe a draft checkpoint"),
    "convert": ("convert", "rewrite a draft for another family"),
    "train": ("train", "train a DSpark draft for a target (data, fit, export)"),
    "calibrate": ("calibrate", "fit per-position confidence temperatures (STS)"),
    "bench-batch": ("bench_batch", "batched decoding: plain vs full/threshold/adaptive"),
    "bench-runtime": ("bench_runtime", "target runtimes and weight formats side by side (decode speed, verify cost)"),
    "bench-serve": (
        "bench_serve",
        "soak dspark serve: a bounded request mix, errors, latency, memory, greedy outputs vs alone",
    ),
    "generate": ("generate", "generate text with speculative decoding"),
    "bench": ("bench", "measure transformers and dspark arms side by side"),
    "doctor": ("doctor", "check empirically that a draft predicts its target as its file says"),
    "serve": ("serve", "OpenAI-compatible HTTP server with speculative-decoding metrics"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command is listed; only the chosen one's module is imported and gets its flags (a
    command module imports torch and its library at the top: `dspark --help` must stay fast)."""
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        if name != only:
            sub.add_parser(name, help=help_text)
            continue
        mod = importlib.import_module(f"dspark.cli.{module}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


class _Stderr(logging.Handler):
    """The `dspark` logger's INFO lines (start-up steps and their times, what the load-time check
    found) as plain lines on this moment's stderr (a test's capture, a redirected stream). Silent
    where the root logger has handlers: a command that configures logging (serve) prints them its way."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            print(self.format(record), file=sys.stderr)


def show_library_log() -> None:
    """Once a process: the library's INFO lines on stderr (Python prints only warnings by default)."""
    log = logging.getLogger("dspark")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        log.addHandler(_Stderr())
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    show_library_log()
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in COMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except DSparkError as exc:
        print(f"dspark {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
