"""`python -m cli COMMAND ...`: one dispatcher, one module per command.

    run-trace       replay a JSONL workload through the engine (cli/run_trace.py)
    analyze         what a cache of given sizes would hit on a workload, and why it misses (cli/analyze.py)
    block-history   one block's reference-count history from the history database (cli/block_history.py)
    fleet           watch vLLM/SGLang prefix caches through their KV events; read what was seen (cli/fleet.py)
    serve           the OpenAI-compatible API on one engine, writing the history (cli/serve.py)
    why             why a request missed the prefix cache, from the history (cli/why.py)

A command module exposes `add_parser(subparsers)`, which adds its subcommand and sets `run` as that
parser's default, and `run(args) -> int`, the exit status. Command modules import at the top only what
their arguments need (no torch, no storage), so `--help` and commands that never run the engine stay
light; what a command runs it imports in `run`. A command that cannot honour an option raises
`cli.usage.UsageError`: printed as `error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from engine.openmp import set_openmp_defaults

from cli import analyze, block_history, fleet, run_trace, serve, why
from cli.usage import UsageError

COMMANDS: tuple[ModuleType, ...] = (run_trace, analyze, block_history, fleet, serve, why)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m cli", commands=COMMANDS) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the chosen command and return its exit status."""
    # How OpenMP workers wait (engine/openmp.py); torch reads it when a command first loads it.
    set_openmp_defaults()
    parser = argparse.ArgumentParser(prog=prog)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in commands:
        command.add_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
