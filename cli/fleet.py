"""`fleet`: watch vLLM / SGLang servers' prefix caches through their KV events, and read what was seen.

    python -m cli fleet watch --pod NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,metrics=URL][,topic=T] ...
                              --db URL [--status-every SECONDS]
    python -m cli fleet state --db URL [--pod NAME ...] [--json] [--hashes]

`watch` runs the collector headless (fleet.collector) into the fleet index and the history database
(storage.write.fleet_sink through one WriterProcess) until SIGINT or SIGTERM, printing one status line on stderr
every `--status-every` seconds; on the signal it stops the collector, writes what is queued, marks its
sources closed and exits (0; 1 if history rows were lost). A database that takes no rows cannot hold it
up: after `STOP_TIMEOUT_S` the queued rows are dropped (counted, exit 1). Several watchers (and
consoles) can share a PostgreSQL database: each writes only its own sources' rows.

A pod that names a `metrics=` URL is scraped every few seconds into the history (KV usage, hit rate,
preemptions, running and waiting requests, capacity). The status line names each pod's health (live,
idle, down, unreachable: `fleet.health`); a pod whose PUB endpoint refuses the connection gets a hint,
since a server configured with `"endpoint": "tcp://127.0.0.1:PORT"` connects instead of binding.

`state` reads the database (whoever wrote it): per pod, the newest source's blocks held by medium and KV
group (`hashes` distinct, `blocks` physical copies), when it was last heard, and how its collector last
saw it: its health, link, lost batches and restarts, and whether the collector is still alive (a source
neither closed nor given a heartbeat for `--collector-lost-after` seconds, `HEARTBEAT_LOST_S` by default,
belongs to a collector that was killed);
`--hashes` adds the held hashes, `--json` prints one JSON document instead of text.

Bad arguments (a malformed --pod, a repeated pod name, an unknown pod for `state`): a message on stderr
and exit status 2. The database and the collector are imported in `run`, so `--help` stays light.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import threading
import time

from cli.usage import open_database
from fleet.source import PodSource, parse_pod

NAME = "fleet"
DEFAULT_STATUS_EVERY_S = 10.0
MAX_STATUS_EVERY_S = 3600.0
HEARTBEAT_LOST_S = 30.0  # a watching source whose status is older belongs to a collector that died
STOP_TIMEOUT_S = 10.0  # on SIGINT/SIGTERM, the longest wait for each of the pod threads, the sinks and the writer
# The cyclic garbage collector's thresholds while a watch runs. The collector allocates a few containers
# per block event (decoded events, index entries, history rows), and at full speed hundreds of thousands
# of rows wait in the writer's queue, so CPython's defaults (700, 10, 10) traverse them over and over:
# 5.4 s of a 14 s collector process's CPU into PostgreSQL in benchmarks/fleet.py. At (10_000, 10, 10)
# the young passes still took 1.1-1.2 s and the older ones 0.4-0.9 s of a run; at these, 0.7-0.8 s
# in all. The passes count containers allocated and not yet freed: a young pass after 100,000 more (so
# most rows are written and freed before a pass sees them), a middle one after 5 M, a full one after
# 100 M. Reference counting still frees every row as soon as it is written, and a young pass frees the
# cycles that became garbage while young; only a cycle dropped after it had grown old waits longer.
WATCH_GC_THRESHOLDS = (100_000, 50, 20)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="watch vLLM/SGLang prefix caches through their KV events")
    commands = parser.add_subparsers(dest="fleet_command", required=True)

    watch = commands.add_parser("watch", help="run the collector headless into the history database")
    watch.add_argument(
        "--pod",
        action="append",
        required=True,
        type=_pod,
        metavar="NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,metrics=URL][,topic=T]",
        help="a server to watch (repeat for each)",
    )
    watch.add_argument("--db", required=True, help="SQLAlchemy URL of the history database")
    watch.add_argument(
        "--status-every",
        type=_seconds,
        default=DEFAULT_STATUS_EVERY_S,
        metavar="SECONDS",
        help=f"one status line on stderr this often (default {DEFAULT_STATUS_EVERY_S:g})",
    )
    watch.set_defaults(run=run_watch)

    state = commands.add_parser("state", help="per pod, the blocks held, from the history database")
    state.add_argument("--db", required=True, help="SQLAlchemy URL of the history database")
    state.add_argument("--pod", action="append", default=None, help="only this pod (repeat for more)")
    state.add_argument("--json", action="store_true", help="one JSON document instead of text")
    state.add_argument("--hashes", action="store_true", help="also list the held hashes")
    state.add_argument(
        "--collector-lost-after",
        type=_seconds,
        default=HEARTBEAT_LOST_S,
        metavar="SECONDS",
        help=f"a watching source with no status for this long has a dead collector (default {HEARTBEAT_LOST_S:g})",
    )
    state.set_defaults(run=run_state)


def _pod(text: str) -> PodSource:
    try:
        return parse_pod(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= MAX_STATUS_EVERY_S:
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_STATUS_EVERY_S:g}] seconds, got {text}")
    return value


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


# --- watch ------------------------------------------------------------------------------------------


def run_watch(args: argparse.Namespace) -> int:
    """Watch until SIGINT/SIGTERM; returns the exit status (see the module docstring)."""
    names = [pod.name for pod in args.pod]
    if len(set(names)) != len(names):
        return _error(f"pod names must be unique: {names}")
    from fleet.collector import Collector
    from fleet.index import FleetIndex
    from storage.db import redacted_url
    from storage.write.fleet_sink import FleetStore
    from storage.write.writer_process import WriterProcess

    writer = open_database(WriterProcess, args.db)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_gc_thresholds = gc.get_threshold()
    gc.set_threshold(*WATCH_GC_THRESHOLDS)
    store = FleetStore(writer)
    index = FleetIndex()
    collector = Collector(args.pod, [index, store])
    print(f"fleet watch: collector {store.collector_id}, {len(names)} pods -> {redacted_url(args.db)}", file=sys.stderr)
    try:
        collector.start()
        while not stop.wait(args.status_every):
            print(status_line(collector, index, writer), file=sys.stderr, flush=True)
    finally:
        if collector.stop(timeout_s=STOP_TIMEOUT_S):
            store.close()
        else:  # the database takes no rows: closing the writer drops the rest (counted); the dispatcher ends
            print(f"error: the database took no rows for {STOP_TIMEOUT_S:g} s; what is queued is dropped",
                  file=sys.stderr)  # fmt: skip
        writer.close(timeout_s=STOP_TIMEOUT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        gc.set_threshold(*previous_gc_thresholds)
    print(status_line(collector, index, writer), file=sys.stderr, flush=True)
    lost = writer.stats().dropped
    if lost:
        print(f"error: {lost} history rows could not be written", file=sys.stderr)
        return 1
    return 0


def status_line(collector, index, writer) -> str:
    """One line: pods ready and by health, batches and block events seen, blocks held, lag, errors, the
    writer; then a hint for each pod whose endpoint refuses the connection."""
    from fleet.events import LinkState

    stats = collector.stats()
    pods = index.pods()
    writer_stats = writer.stats()
    lags = [pod.last_lag_s for pod in stats.values() if pod.last_lag_s is not None]
    health = ", ".join(f"{pod.pod} {pod.health.value}" for pod in pods)
    parts = [
        time.strftime("%H:%M:%S"),
        f"pods {sum(pod.ready for pod in stats.values())}/{len(stats)} ready",
        f"{sum(pod.stale for pod in pods)} stale ({health})",
        f"batches {sum(pod.num_batches for pod in stats.values()):,}",
        f"block events {sum(pod.num_block_events for pod in stats.values()):,}",
        f"held {sum(pod.num_blocks for pod in pods):,} blocks",
        f"lag max {max(lags) * 1e3:.0f} ms" if lags else "lag -",
        f"lost batches {sum(pod.num_lost_batches for pod in stats.values())}",
        f"restarts {sum(pod.num_restarts for pod in stats.values())}",
        f"feed errors {sum(pod.num_errors for pod in stats.values())}",
        f"db rows {writer_stats.written_other:,} written, {writer_stats.queued:,} queued, "
        f"{writer_stats.dropped:,} dropped",
    ]
    if writer_stats.last_error:
        parts.append(f"last db error: {writer_stats.last_error}")
    for source in collector.sources:
        if stats[source.name].link is LinkState.REFUSED:
            parts.append(
                f"{source.name}: nothing listens at {source.endpoint} (live batches cannot arrive; a vLLM "
                f"server binds its PUB socket only for an endpoint like tcp://*:PORT)"
            )
    return "fleet watch: " + ", ".join(parts)


# --- state ------------------------------------------------------------------------------------------


def run_state(args: argparse.Namespace) -> int:
    """Print what the database says each pod holds; returns the exit status."""
    from sqlalchemy.exc import SQLAlchemyError

    from storage.read import fleet_queries
    from storage import migrate
    from storage.db import existing_db_engine, redacted_url

    engine = open_database(existing_db_engine, args.db)  # connecting to a missing SQLite file would create an empty one
    try:
        if migrate.current_revision(engine) is None:
            return _error(f"{redacted_url(args.db)} holds no history (no schema)")
        sources = fleet_queries.latest_sources(engine, args.pod)
        missing = sorted(set(args.pod or ()) - set(sources["pod"]))
        if missing:
            return _error(f"no pod named {', '.join(missing)} in the database")
        summary = fleet_queries.held_summary(engine, sources["id"].tolist())
        hashes = {}
        if args.hashes:
            for source_id in sources["id"]:
                hashes[source_id] = fleet_queries.held_blocks(engine, source_id)["block_hash"].tolist()
    except SQLAlchemyError as exc:
        print(f"error: cannot read {redacted_url(args.db)}: {exc.__cause__ or exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    from fleet.events import LinkState
    from fleet.health import pod_health
    from fleet.index import DEFAULT_STALE_AFTER_S

    now = time.time()
    pods = []
    for source in sources.itertuples():
        groups = summary[summary["source_id"] == source.id]
        closed = not _missing(source.closed_at)
        status_at = None if _missing(source.status_at) else float(source.status_at)
        collector_alive = not closed and status_at is not None and now - status_at <= args.collector_lost_after
        heard_at = source.opened_at if _missing(source.last_received_at) else source.last_received_at
        link = None if _missing(source.link) else LinkState(source.link)
        health = pod_health(link, now - heard_at, DEFAULT_STALE_AFTER_S)
        pod = {
            "pod": source.pod,
            "source_id": source.id,
            "collector_id": source.collector_id,
            "endpoint": source.endpoint,
            "opened_at": source.opened_at,
            "closed_at": None if _missing(source.closed_at) else source.closed_at,
            "last_ts": None if _missing(source.last_ts) else source.last_ts,
            "watching": collector_alive,
            "status_at": status_at,
            "link": None if link is None else link.value,
            "health": health.value if collector_alive else None,
            "stale": not collector_alive or health.stale,
            "num_lost_batches": None if _missing(source.num_lost_batches) else int(source.num_lost_batches),
            "num_restarts": None if _missing(source.num_restarts) else int(source.num_restarts),
            "num_hashes": int(groups["hashes"].sum()),
            "num_blocks": int(groups["blocks"].sum()),
            "groups": [
                {"medium": g.medium, "group_idx": int(g.group_idx), "hashes": int(g.hashes), "blocks": int(g.blocks)}
                for g in groups.itertuples()
            ],
        }
        if args.hashes:
            pod["hashes"] = hashes[source.id]
        pods.append(pod)
    if args.json:
        print(json.dumps({"pods": pods}, indent=2))
    else:
        _print_text(pods)
    return 0


def _missing(value) -> bool:
    return value is None or value != value  # NaN from pandas


def _print_text(pods: list[dict]) -> None:
    if not pods:
        print("no pods in the database")
    for pod in pods:
        heard = "never heard" if pod["last_ts"] is None else f"last batch {_clock(pod['last_ts'])}"
        if pod["closed_at"] is not None:
            watching = f"closed {_clock(pod['closed_at'])}"
        elif pod["watching"]:
            watching = f"watching: {pod['health']}, link {pod['link']}"
        elif pod["status_at"] is None:
            watching = "no status from its collector (an older one, or one that died at once)"
        else:
            watching = f"its collector is silent since {_clock(pod['status_at'])} (killed?)"
        counts = ""
        if pod["num_lost_batches"] is not None:
            counts = f", lost batches {pod['num_lost_batches']}, restarts {pod['num_restarts']}"
        stale = ", STALE (the blocks may be out of date)" if pod["stale"] else ""
        print(
            f"{pod['pod']}: {pod['num_blocks']} blocks held ({pod['num_hashes']} hashes), {heard}, {watching}"
            f"{counts}{stale}"
        )
        for group in pod["groups"]:
            blocks, hashes = group["blocks"], group["hashes"]
            print(f"  {group['medium']} group {group['group_idx']}: {blocks} blocks ({hashes} hashes)")
        for block_hash in pod.get("hashes", ()):
            print(f"    {block_hash}")


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))
