"""`why`: why a request's prompt tokens were not served from the prefix cache, from the history.

    python -m cli why --db URL --request ID [--run RUN] [--json]     one request (analysis/why.py's causes)
    python -m cli why --db URL --run RUN --summary [--json]          every request of a run: tokens missed by cause

A request id is what the console shows and what the API returns as a response's `id`; without `--run` the
newest run holding that id is read. The decoded text windows use the run's model's tokenizer (from
`--data-dir`, default the console's); a model without one shows token ids. Exit status: 0; 2 for a
database URL that cannot be used, an unknown request or run, or a request whose prompt the history does
not hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

NAME = "why"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="why a request missed the prefix cache (or a run's misses by cause)")
    parser.add_argument("--db", required=True, help="SQLAlchemy URL of the history")
    parser.add_argument("--request", default=None, help="the request id (a response's id for API requests)")
    parser.add_argument("--run", dest="run_id", default=None, help="the run (default: the newest holding the request)")
    parser.add_argument("--summary", action="store_true", help="every request of --run: tokens missed by cause")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the model's tokenizer is cached")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Explain one request or summarise a run; returns the exit status (see the module docstring)."""
    if (args.request is None) != args.summary:
        print("error: give --request ID, or --run RUN --summary", file=sys.stderr)
        return 2
    if args.summary and args.run_id is None:
        print("error: --summary needs --run", file=sys.stderr)
        return 2
    from sqlalchemy.exc import SQLAlchemyError

    from storage.db import DatabaseUrlError, db_engine

    try:
        db = db_engine(args.db)
    except DatabaseUrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = _summary(db, args) if args.summary else _one(db, args)
    except (LookupError, ValueError, SQLAlchemyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        db.dispose()
    print(json.dumps(result.as_json(), indent=2) if args.json else render(result.as_json()))
    return 0


def _one(db: Any, args: argparse.Namespace) -> Any:
    from analysis.why import diagnose
    from storage.read.why import find_request, latest_eviction, requests_before

    request = find_request(db, args.request, args.run_id)
    if request is None:
        where = f" in run {args.run_id}" if args.run_id else ""
        raise LookupError(f"no request {args.request!r}{where} in the history")
    earlier = requests_before(db, request.arrival_time)
    return diagnose(request, earlier, lambda *key: latest_eviction(db, *key), _decoder(request.model, args.data_dir))


def _summary(db: Any, args: argparse.Namespace) -> Any:
    from analysis.why import summarize
    from storage.read.why import latest_eviction, requests_before, run_requests

    requests = run_requests(db, args.run_id)
    if not requests:
        raise LookupError(f"no requests of run {args.run_id!r} in the history")
    others = [r for r in requests_before(db, requests[-1].arrival_time) if r.run_id != args.run_id]
    summary, _ = summarize(args.run_id, requests, others, lambda *key: latest_eviction(db, *key),
                           _decoder(requests[0].model, args.data_dir))  # fmt: skip
    return summary


def _decoder(model: str, data_dir: Path | None) -> Any:
    from analysis.why import Decoder
    from engine.core.config import default_data_dir
    from serving.prompts import load_tokenizer

    return Decoder.of(load_tokenizer(model, data_dir or default_data_dir()))


def render(result: dict[str, Any]) -> str:
    """A diagnosis or a run summary as text."""
    if "by_cause" in result:
        lines = [f"run {result['run_id']}: {result['requests']} requests, {result['prompt_tokens']} prompt tokens, "
                 f"{result['cached_tokens']} served from the cache"]  # fmt: skip
        for cause, counts in result["by_cause"].items():
            if counts["requests"]:
                missed = counts["missed_tokens"]
                lines.append(f"  {cause:<10} {counts['requests']:>6} requests  {missed:>9} tokens missed")
        if result["unexplained"]:
            lines.append(f"  {result['unexplained']} requests without a recorded prompt")
        return "\n".join(lines)
    lines = [f"{result['request_id']} (run {result['run_id']}): {result['cause']}; {result['cached_tokens']} of "
             f"{result['prompt_tokens']} prompt tokens served from the cache, {result['reusable_tokens']} reusable, "
             f"{result['missed_tokens']} missed (first not served: token {result['position']})"]  # fmt: skip
    if result["match"]:
        match = result["match"]
        shared = match["shared_tokens"]
        lines.append(f"  earlier request {match['request_id']} (run {match['run_id']}) shared {shared} tokens")
    if result["divergence"]:
        d = result["divergence"]
        lines += [f"  diverged at token {d['position']} after {d['before']!r}", f"    ours:   {d['ours']!r}",
                  f"    theirs: {d['theirs']!r}"]  # fmt: skip
        lines += [f"  {note}" for note in d["notes"]]
    if result["eviction"]:
        e = result["eviction"]
        lines.append(f"  evicted at {e['at']:.3f} ({e['reason']}), block {e['block']}")
    if result["namespace"]:
        lines += [f"  {name}: ours {pair[0]!r}, theirs {pair[1]!r}" for name, pair in result["namespace"].items()]
    if result["wait"]:
        w = result["wait"]
        lines.append(f"  waited {w['seconds'] * 1000:.1f} ms for {w['request_id']} to compute the shared prefix")
    if result["window"]:
        lines.append(f"  sliding-window state replayed from token {result['window']['r']}")
    lines += [f"  {note}" for note in result["notes"]]
    return "\n".join(lines)
