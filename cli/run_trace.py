"""`run-trace`: replay a JSONL workload through the engine and print one JSON line per finished request.

    python -m cli run-trace TRACE.jsonl [--model M] [--block-size N] [--num-blocks N] [--db URL] ...

The trace format and the lines printed are cli/trace.py's. With `--db URL` everything the replay ran
(run, events, evictions, request rows) is persisted there through a `storage.write.writer_process.WriterProcess`;
storage is imported only then. Exit status: 0; 2 for an invalid option, an unreadable trace or a bad
trace line (the replay stops there; the summary line is still printed); 1 when history rows could not
be written.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cli.engine_options import add_engine_options, engine_config
from cli.usage import open_database

NAME = "run-trace"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="replay a JSONL workload and print one JSON line per request")
    parser.add_argument("trace", help="path to the JSONL trace ('-' for stdin)")
    add_engine_options(parser)
    parser.add_argument("--db", default=None, help="SQLAlchemy URL: persist everything the replay ran there")
    parser.add_argument("--window-backtrack", type=int, default=0, help="extra window state kept when caching")
    parser.add_argument("--allow-approximate-replay", action="store_true")
    parser.add_argument(
        "--verify-replay", action="store_true", help="measure approximate replays against a full recompute"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Replay `args.trace`; returns the exit status (see the module docstring)."""
    try:
        config = engine_config(
            args,
            window_backtrack=args.window_backtrack,
            allow_approximate_replay=args.allow_approximate_replay,
            verify_replay=args.verify_replay,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.db is not None:  # the history is optional: storage is imported only when asked for
        from storage.db import db_engine

        open_database(db_engine, args.db).dispose()  # before anything starts: a bad URL fails at once
    try:
        source = sys.stdin.buffer if args.trace == "-" else open(args.trace, "rb")  # lines decoded one by one
    except OSError as exc:
        print(f"error: cannot read the trace: {exc}", file=sys.stderr)
        return 2
    writer = None
    if args.db is not None:
        from storage.write.writer_process import WriterProcess

        writer = WriterProcess(args.db)  # before the model loads
    # torch loads here, for the command that runs the engine, not for `python -m cli --help`.
    from cli.trace import TraceError, replay, summary_record
    from engine.core.errors import KVTierError
    from engine.engine import Engine

    status = 0
    try:
        with source:
            try:
                engine = Engine(config)
            except KVTierError as exc:  # the disk tier's directory, refused at start
                print(f"error: {exc}", file=sys.stderr)
                return 2
            if writer is not None:
                from storage.write.recorder import record_engine

                record_engine(engine, writer)
            try:
                replay(engine, source, _emit)
            except TraceError as exc:
                print(f"error: {exc}", file=sys.stderr)
                status = 2
        _emit(summary_record(engine))
        engine.stop()  # a disk tier gets the pool's cached blocks: the next run on its directory starts warm
    finally:
        if writer is not None:
            writer.close()  # also when the replay fails: the rows handed over so far are written
    stats = None if writer is None else writer.stats()
    if stats is not None and stats.dropped:
        from storage.db import redacted_url

        print(f"error: {stats.dropped} history rows could not be written to {redacted_url(args.db)} "
              f"(last error: {stats.last_error})", file=sys.stderr)  # fmt: skip
        status = status or 1
    return status


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)
