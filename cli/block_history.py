"""`block-history`: one block's life from the history database, one row per change of it.

    python -m cli block-history --db URL [--run RUN] --block N [--group full|sliding] [--json]

Reads the persisted events (`storage.read.queries.block_timeline`), so it works for any run the history
holds, after the console that ran it is gone. Each row: the engine step, the time, the event, the
request, the reference count and the holders after it, the block's state, and the marker where the
count reached zero ("no holder left: safe to reuse", or "evictable from here on" for a cached block).
A copy-on-write is one row: the release of the source (or the allocation of the copy) it made.
`--run` defaults to the newest run. Exit status: 0; 2 for an invalid option, a database URL that
cannot be used (or a SQLite file that is not there: reading creates none), an unknown run or a history
without runs; 1 when the database cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from cli.usage import open_database
from engine.core.config import MAX_NUM_BLOCKS

NAME = "block-history"
GROUPS = ("full", "sliding")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="one block's reference-count history from the history database")
    parser.add_argument("--db", required=True, help="SQLAlchemy URL of the history database")
    parser.add_argument("--run", dest="run_id", default=None, help="run id (default: the newest run)")
    parser.add_argument("--block", type=int, required=True, help="physical block id")
    parser.add_argument("--group", choices=GROUPS, default="full", help="KV group (sliding-window layers: sliding)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the block's history; returns the exit status (see the module docstring)."""
    if not 0 <= args.block < MAX_NUM_BLOCKS:
        print(f"error: --block must be a block id in [0, {MAX_NUM_BLOCKS})", file=sys.stderr)
        return 2
    from sqlalchemy.exc import SQLAlchemyError  # the history is read only by this command

    from storage.read import queries
    from storage.db import existing_db_engine, redacted_url

    db = open_database(existing_db_engine, args.db)
    try:
        run_id = args.run_id or queries.latest_run_id(db)
        if run_id is None:
            print(f"error: {redacted_url(args.db)} holds no runs", file=sys.stderr)
            return 2
        if args.run_id is not None and not queries.has_run(db, args.run_id):
            print(f"error: no run {args.run_id!r} in {redacted_url(args.db)}", file=sys.stderr)
            return 2
        timeline = queries.block_timelines(db, run_id, [args.block], args.group)[args.block]
    except SQLAlchemyError as exc:
        print(f"error: cannot read {redacted_url(args.db)}: {exc.__cause__ or exc}", file=sys.stderr)
        return 1
    finally:
        db.dispose()
    records = [row_record(row) for row in timeline.rows.itertuples(index=False)]
    if args.json:
        for record in records:
            print(json.dumps({"run_id": run_id, "group": args.group, "block_id": args.block, **record}))
    else:
        print_table(run_id, args, records)
    if not timeline.complete:
        print(
            "note: the stored history starts mid-life (older events were pruned) or lacks block lists; "
            "rows before the block's first stored allocation are left out",
            file=sys.stderr,
        )
    return 0


def row_record(row) -> dict:
    """One history row as plain JSON values."""
    return {
        "step": int(row.step),
        "time": float(row.time),
        "event": row.event,
        "request_id": row.request_id,
        "ref_count": int(row.ref_count),
        "holders": list(row.holders),
        "state": row.state,
        "marker": row.marker,
        "change": row.change,
        "event_id": int(row.event_id),
    }


def print_table(run_id: str, args: argparse.Namespace, records: list[dict]) -> None:
    print(f"block {args.block} ({args.group} group) of run {run_id}: {len(records)} changes")
    print(f"{'step':>6}  {'time (UTC)':<12}  {'event':<14}  {'request':<16}  {'ref':>3}  {'holders':<28}  change")
    for r in records:
        clock = datetime.fromtimestamp(r["time"], tz=UTC).strftime("%H:%M:%S.%f")[:12]
        holders = ", ".join(r["holders"]) or "—"
        change = r["change"] + (f"  [{r['marker']}]" if r["marker"] else "")
        print(f"{r['step']:>6}  {clock:<12}  {r['event']:<14}  {r['request_id'] or '—':<16}  {r['ref_count']:>3}  {holders:<28}  {change}")
