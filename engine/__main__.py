"""Command line: `python -m engine run-trace TRACE.jsonl [--model ...] [--db URL]`."""

from __future__ import annotations

import argparse
import json
import sys

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.engine import Engine
from engine.trace import TraceError, replay, summary_record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run-trace", help="replay a JSONL workload and print one JSON line per request")
    run.add_argument("trace", help="path to the JSONL trace ('-' for stdin)")
    run.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local model directory")
    run.add_argument("--block-size", type=int, default=16)
    run.add_argument("--num-blocks", type=int, default=None)
    run.add_argument("--device", default="auto")
    run.add_argument("--dtype", default="float32")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--db", default=None, help="SQLAlchemy URL: persist everything the replay ran there")
    run.add_argument("--attention-override", default=None, help="'sliding:W' or 'hybrid:W' (even layers sliding)")
    run.add_argument("--window-backtrack", type=int, default=0, help="extra window state kept when caching")
    run.add_argument("--allow-approximate-replay", action="store_true")
    run.add_argument("--verify-replay", action="store_true", help="measure approximate replays against a full recompute")
    args = parser.parse_args(argv)

    try:
        config = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            seed=args.seed,
            attention_override=args.attention_override,
            window_backtrack=args.window_backtrack,
            allow_approximate_replay=args.allow_approximate_replay,
            verify_replay=args.verify_replay,
        )
    except ValueError as exc:
        parser.error(str(exc))
    engine = Engine(config)
    writer = None
    if args.db is not None:
        from storage.recorder import record_engine  # the history is optional: import it only when asked
        from storage.writer_process import WriterProcess

        writer = WriterProcess(args.db)
        record_engine(engine, writer)

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)

    source = sys.stdin if args.trace == "-" else open(args.trace, encoding="utf-8")
    status = 0
    with source:
        try:
            replay(engine, source, emit)
        except TraceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 2
    emit(summary_record(engine))
    if writer is not None:
        writer.close()
        lost = writer.stats().dropped
        if lost:
            print(f"error: {lost} history rows could not be written to {args.db}", file=sys.stderr)
            status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
