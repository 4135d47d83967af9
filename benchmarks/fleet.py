"""Fleet benchmark: KV events from vLLM's publisher through the collector into the fleet index and the
history database.

    .venv/bin/python benchmarks/fleet.py [--pods 16] [--steps 400] [--block-size 16] [--rate 100000]
                                         [--db-rate 50000] [--databases sqlite,postgresql] [--pg-url URL]

1. End to end. A child process runs `--pods` vLLM `ZmqEventPublisher`s on loopback ports (vLLM's own
   publisher, thread and encoding) and replays, as fast as they take them, event batches recorded from
   vLLM's own `KVCacheManager`: per engine step a few requests share a system prompt (prefix hits),
   finish, and later ones evict the LRU blocks (one BlockRemoved per block, as vLLM sends them). This
   process runs the collector (one subscriber thread per pod, one dispatcher) into a `FleetIndex`. It
   reports block events (hashes stored + hashes removed) per second from the first batch received to
   the last one applied, the same per second of the collector process's CPU time, and the lag of each
   batch behind its publisher (applied time - the batch's ts, stamped when the publisher took it).
   At the end it checks that every pod's index equals the block pool that produced its events.
   It runs twice: with the publishers taking batches as fast as they can (the throughput), and paced
   at `--rate` block events per second, the goal (the lag at that rate).
   Then the same with the database added: the collector feeds the index and a `FleetStore` (the
   storage sink: lifetimes, evictions, events) through one `EventWriter`, on SQLite and on PostgreSQL (a
   throwaway server from .ci/start-postgres unless --pg-url is given). The rate is block events from
   the first batch received to the moment the writer has committed the last one, and the database's
   lag per batch is the time its rows were written (just before their commit) minus the batch's ts.
   It checks that every pod's held blocks in the database equal its vLLM block pool. Unpaced, then
   paced at `--db-rate`.
2. Per batch, in this process, side by side: decoding with `fleet.decode.BatchDecoder` (types, bounds,
   both encodings) against msgspec decoding straight into vLLM's own `KVEventBatch` classes (what
   vLLM's subscriber example does: the floor for a Python consumer), and applying to the index.

The collector runs under `fleet watch`'s garbage-collector thresholds (cli/fleet.py `WATCH_GC_THRESHOLDS`).

Goals: >= 100,000 block events per second into the index and >= 50,000 into the database on the
2-core machine. The publishers take one core and the collector (with the writer thread and, for
PostgreSQL, the server) the other; numbers are noisy when other work shares the machine, so each run
also prints its rate per second of the collector process's CPU time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: this file would shadow the fleet package
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM logs to stdout by default

import msgspec  # noqa: E402

from cli.fleet import WATCH_GC_THRESHOLDS  # noqa: E402
from fleet.collector import Collector  # noqa: E402
from fleet.config import CollectorConfig  # noqa: E402
from fleet.decode import BatchDecoder  # noqa: E402
from fleet.events import BatchOrigin, PodBatch, PodReset  # noqa: E402
from fleet.index import FleetIndex  # noqa: E402
from fleet.source import PodSource  # noqa: E402
from storage.write.fleet_sink import FleetStore  # noqa: E402
from storage.write.writer import EventWriter  # noqa: E402

PROTOCOL = "FLEETBENCH "  # prefix of the child's lines meant for the parent
TOPIC = "kv-events"
NUM_WORKLOADS = 4  # distinct recorded workloads, shared round-robin by the pods


# --- the recorded workload (vLLM's KVCacheManager) ---------------------------------------------


def record_workload(seed: int, steps: int, block_size: int) -> tuple[list[list], dict]:
    """Drive vLLM's KVCacheManager through `steps` engine steps; returns (events per step, final cache).

    Each step: 1-3 new requests, half of them behind a shared system prompt, 256-1024 tokens each;
    the requests of the previous step finish. The pool holds about four steps' worth, so from the
    fifth step on each allocation evicts cached blocks.
    """
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    rng = random.Random(seed)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=4 * 3 * 1024 // block_size + 8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    manager = KVCacheManager(
        config,
        max_model_len=8192,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    hasher = get_request_block_hasher(block_size, sha256)
    system_prompt = [rng.randrange(32_000) for _ in range(384)]
    running: list = []
    steps_events: list[list] = []
    for step in range(steps):
        for request in running:
            manager.free(request)
        running = []
        for i in range(rng.randint(1, 3)):
            prompt = [rng.randrange(32_000) for _ in range(rng.randint(256, 1024))]
            if rng.random() < 0.5:
                prompt = system_prompt + prompt[: len(prompt) - 256]
            params = SamplingParams(max_tokens=1)
            params.update_from_generation_config({}, eos_token_id=100_000)
            request = Request(f"{step}-{i}", prompt, params, None, block_hasher=hasher)
            computed, num_cached, _ = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - num_cached, num_cached, computed) is None:
                raise RuntimeError("the benchmark's pool is too small for its workload")
            running.append(request)
        steps_events.append(manager.take_events())
    pool = manager.block_pool
    cached: dict[str, int] = {}
    for block in pool.blocks:
        key = block.block_hash
        if key is not None and pool.cached_block_hash_to_block.contain(key, block.block_id):
            name = repr((pool.medium, get_group_id(key), maybe_convert_block_hash(get_block_hash(key))))
            cached[name] = cached.get(name, 0) + 1
    return steps_events, cached


def num_block_events(events: list) -> int:
    return sum(len(getattr(event, "block_hashes", ())) for event in events)


# --- the child: vLLM's publishers ----------------------------------------------------------------


def run_publishers(args: argparse.Namespace) -> None:
    """The child process: record the workloads, bind the publishers, publish on "go"."""
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    workloads = [record_workload(seed, args.steps, args.block_size) for seed in range(NUM_WORKLOADS)]
    publishers = []
    for _ in range(args.pods):
        replay_port = free_port()
        publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            topic=TOPIC,
        )
        endpoint = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # vLLM does not report the bound port
        publishers.append((publisher, endpoint, f"tcp://127.0.0.1:{replay_port}"))
    report(
        {
            "pods": [
                {"endpoint": endpoint, "replay": replay, "cached": workloads[pod % NUM_WORKLOADS][1]}
                for pod, (_, endpoint, replay) in enumerate(publishers)
            ],
            "batches_per_pod": args.steps,
            "block_events": sum(
                num_block_events(events)
                for pod in range(args.pods)
                for events in workloads[pod % NUM_WORKLOADS][0]
            ),
        }
    )
    sys.stdin.readline()  # "go"
    began = time.time()
    sent = 0
    for step in range(args.steps):
        for pod, (publisher, _, _) in enumerate(publishers):
            events = workloads[pod % NUM_WORKLOADS][0][step]
            if args.rate:  # hold back until the rate allows this batch
                sent += num_block_events(events)
                time.sleep(max(0.0, began + sent / args.rate - time.time()))
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
    report({"began": began, "taken": time.time()})
    sys.stdin.readline()  # "exit": the parent is done (the replay sockets stay up until then)
    for publisher, _, _ in publishers:
        publisher.shutdown()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def report(message: dict) -> None:
    print(PROTOCOL + json.dumps(message), flush=True)


def read_report(child: subprocess.Popen) -> dict:
    for line in child.stdout:
        if line.startswith(PROTOCOL):
            return json.loads(line[len(PROTOCOL) :])
    raise RuntimeError(f"the publisher process ended (exit code {child.wait()})")


# --- the parent: the collector -------------------------------------------------------------------


class LagRecorder:
    """A sink that notes, per batch, how long after its publisher stamped it the index had it."""

    def __init__(self) -> None:
        self.lags_s: list[float] = []  # applied time - batch ts, per batch
        self.batch_ts: list[float] = []  # each batch's publisher time, in dispatch order
        self.first_received_at: float | None = None  # the earliest batch's arrival
        self.last_applied_at = 0.0  # when the latest batch was applied

    def open_pod(self, source: PodSource, at: float) -> None:
        pass

    def apply_batch(self, batch: PodBatch) -> None:
        now = time.time()
        if self.first_received_at is None:
            self.first_received_at = batch.received_at
        self.lags_s.append(now - batch.batch.ts)
        self.batch_ts.append(batch.batch.ts)
        self.last_applied_at = now

    def reset_pod(self, reset: PodReset) -> None:
        pass


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class TimedWriter(EventWriter):
    """The EventWriter, noting when the writer thread has written each row set (just before the commit)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.written_at: list[float] = []  # per submitted row set, in submission order
        self._timed: dict = {}

    def submit_rows(self, rows, num_rows, write, *, wait=False):
        timed = self._timed.get(write)
        if timed is None:

            def timed(connection, row_sets, write=write):
                write(connection, row_sets)
                now = time.time()
                self.written_at.extend([now] * len(row_sets))

            self._timed[write] = timed
        return super().submit_rows(rows, num_rows, timed, wait=wait)


def bench_end_to_end(args: argparse.Namespace, rate: int, database: str | None = None) -> None:
    """One run: the child publishes as fast as its publishers take batches (rate 0), or at `rate`;
    into the index alone, or into the index and the database at URL `database`."""
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--publishers",
            f"--pods={args.pods}",
            f"--steps={args.steps}",
            f"--block-size={args.block_size}",
            f"--rate={rate}",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        setup = read_report(child)
        sources = [
            PodSource(f"pod-{i:02d}", pod["endpoint"], pod["replay"], topic=TOPIC)
            for i, pod in enumerate(setup["pods"])
        ]
        index = FleetIndex()
        lag = LagRecorder()
        writer = TimedWriter(database) if database is not None else None
        store = FleetStore(writer) if writer is not None else None
        sinks = [index, lag] if store is None else [index, store, lag]
        if writer is not None and not _wait(lambda: writer.stats().schema_ready, 120):
            raise RuntimeError(f"the database did not get its schema: {writer.stats().last_error}")
        with Collector(sources, sinks, CollectorConfig()) as collector:
            deadline = time.monotonic() + 30
            while any(stats.num_connects == 0 for stats in collector.stats().values()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the collector did not connect to every publisher")
                time.sleep(0.05)
            time.sleep(0.5)  # subscriptions reach the PUB sockets
            cpu_before = time.process_time()
            child.stdin.write("go\n")
            child.stdin.flush()
            published = read_report(child)
            last_seq = setup["batches_per_pod"] - 1
            deadline = time.monotonic() + 600
            while not all(
                name in index.pod_names() and index.pod(name).last_seq == last_seq
                for name in (s.name for s in sources)
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the index did not catch up within 10 minutes")
                time.sleep(0.005)
            if writer is not None:
                if not writer.flush(600):
                    raise RuntimeError("the writer did not catch up within 10 minutes")
                written_at = time.time()
            cpu_s = time.process_time() - cpu_before
            stats = collector.stats()
        child.stdin.write("exit\n")
        child.stdin.flush()
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()

    block_events = setup["block_events"]
    wall_s = lag.last_applied_at - lag.first_received_at
    publish_s = published["taken"] - published["began"]
    mismatched = [
        source.name
        for source, pod in zip(sources, setup["pods"], strict=True)
        if {repr(key): n for key, n in index.copies(source.name).items()} != pod["cached"]
    ]
    pace = f"paced at {rate:,} block events/s" if rate else "as fast as vLLM's publishers take them"
    into = "the index" if database is None else f"the index and {database.split(':')[0].split('+')[0]}"
    print(f"1. end to end into {into}, {pace}")
    print(f"   {args.pods} pods x {setup['batches_per_pod']} batches, {block_events:,} block events")
    print(f"   vLLM's publishers took them in {publish_s:.2f} s ({block_events / publish_s:,.0f} block events/s)")
    index_goal = " (goal >= 100,000)" if database is None else ""  # with a database, its writer shares the core
    print(f"   into the index in {wall_s:.2f} s: {block_events / wall_s:,.0f} block events/s{index_goal}")
    if writer is not None:
        db_s = written_at - lag.first_received_at
        db_lags = [done - ts for done, ts in zip(writer.written_at[args.pods :], lag.batch_ts, strict=True)]
        print(f"   into the database in {db_s:.2f} s: {block_events / db_s:,.0f} block events/s (goal >= 50,000)")
        print(
            f"   database lag behind the publisher per batch: median {statistics.median(db_lags) * 1e3:.0f} ms, "
            f"p99 {percentile(db_lags, 0.99) * 1e3:.0f} ms, max {max(db_lags) * 1e3:.0f} ms; "
            f"written {(written_at - published['taken']):.2f} s after the last publish(); "
            f"{writer.stats().written_other:,} rows in {writer.stats().written_batches:,} transactions, "
            f"{writer.stats().dropped} dropped"
        )
        mismatched += _database_mismatches(database, store, sources, setup["pods"])
        writer.close()
    print(f"   collector CPU {cpu_s:.2f} s: {block_events / cpu_s:,.0f} block events per CPU second")
    print(
        f"   index lag behind the publisher per batch: median {statistics.median(lag.lags_s) * 1e3:.1f} ms, "
        f"p99 {percentile(lag.lags_s, 0.99) * 1e3:.1f} ms, max {max(lag.lags_s) * 1e3:.1f} ms; "
        f"the last applied {(lag.last_applied_at - published['taken']) * 1e3:.0f} ms after the last publish()"
    )
    totals = {
        name: sum(getattr(pod_stats, name) for pod_stats in stats.values())
        for name in ("num_gaps", "num_replayed_batches", "num_lost_batches", "num_errors")
    }
    print("   " + ", ".join(f"{name.removeprefix('num_')} {n}" for name, n in totals.items()))
    verdict = "yes" if not mismatched else "NO: " + ", ".join(mismatched)
    what = "index" if database is None else "index and database"
    print(f"   {what} equal every pod's vLLM block pool: {verdict}")


def _database_mismatches(url: str, store: FleetStore, sources: list[PodSource], pods: list[dict]) -> list[str]:
    """The pods whose held blocks in the database differ from their vLLM block pool."""
    from storage.read import fleet_queries
    from storage.db import db_engine

    engine = db_engine(url)
    try:
        wrong = []
        for source, pod in zip(sources, pods, strict=True):
            held = fleet_queries.held_blocks(engine, store.source_ids()[source.name])
            stored = {
                repr((row.medium, int(row.group_idx), fleet_queries.parse_hash_text(row.block_hash))): int(row.copies)
                for row in held.itertuples()
            }
            if stored != pod["cached"]:
                wrong.append(f"{source.name} (database)")
        return wrong
    finally:
        engine.dispose()


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def fresh_databases(args: argparse.Namespace, scratch: Path, pg_dir: Path):
    """(name, URL factory) per backend asked for; each call of a factory gives an empty database. SQLite
    files go under `scratch`, a throwaway PostgreSQL server's cluster under `pg_dir` (its own temporary
    directory: as root the server runs as `postgres`, which cannot enter another root-only one)."""
    from sqlalchemy import create_engine
    from sqlalchemy.schema import CreateSchema, DropSchema

    counter = iter(range(1_000_000))
    found = []
    for name in args.databases.split(","):
        if name == "sqlite":
            found.append((name, lambda: f"sqlite:///{scratch / f'history-{next(counter)}.sqlite'}"))
        elif name == "postgresql":
            url = args.pg_url or _start_postgres(pg_dir)

            def fresh(url=url) -> str:
                engine = create_engine(url, isolation_level="AUTOCOMMIT")
                with engine.connect() as connection:
                    connection.execute(DropSchema("public", cascade=True, if_exists=True))
                    connection.execute(CreateSchema("public"))
                engine.dispose()
                return url

            found.append((name, fresh))
        else:
            raise SystemExit(f"unknown database {name!r}: sqlite, postgresql")
    return found


def _start_postgres(directory: Path) -> str:
    started = subprocess.run([str(ROOT / ".ci" / "start-postgres"), str(directory)], capture_output=True, text=True)
    if started.returncode != 0:
        raise SystemExit(f".ci/start-postgres failed: {started.stderr}")
    return started.stdout.split()[-1]


def bench_per_batch(args: argparse.Namespace) -> None:
    from vllm.distributed.kv_events import KVEventBatch

    events_per_step, _ = record_workload(0, args.steps, args.block_size)
    encoder = msgspec.msgpack.Encoder()
    payloads = [encoder.encode(KVEventBatch(ts=time.time(), events=events)) for events in events_per_step]
    block_events = sum(num_block_events(events) for events in events_per_step)
    vllm_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    fleet_decoder = BatchDecoder()

    def timed(function) -> float:
        best = float("inf")
        for _ in range(5):
            began = time.perf_counter()
            function()
            best = min(best, time.perf_counter() - began)
        return best

    vllm_s = timed(lambda: [vllm_decoder.decode(payload) for payload in payloads])
    fleet_s = timed(lambda: [fleet_decoder.decode(payload) for payload in payloads])
    batches = [fleet_decoder.decode(payload) for payload in payloads]

    def apply_all() -> None:
        index = FleetIndex()
        for seq, batch in enumerate(batches):
            index.apply_batch(PodBatch("a", seq, batch, batch.ts, BatchOrigin.LIVE))

    index_s = timed(apply_all)
    print(f"2. per batch ({len(payloads)} batches, {block_events:,} block events, best of 5)")
    print(f"   decode into vLLM's KVEventBatch (msgspec, typed): {block_events / vllm_s:,.0f} block events/s")
    print(
        f"   decode with fleet.decode.BatchDecoder:            {block_events / fleet_s:,.0f} block events/s "
        f"({fleet_s / vllm_s:.2f}x vLLM's decode time)"
    )
    print(f"   apply to the FleetIndex:                          {block_events / index_s:,.0f} block events/s")


def _stop_postgres(directory: Path) -> None:
    data = directory / "data"
    if not data.is_dir():
        return
    binaries = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if binaries:
        stop = [str(binaries[-1]), "-D", str(data), "stop", "-m", "fast"]
        subprocess.run(["runuser", "-u", "postgres", "--", *stop] if os.geteuid() == 0 else stop, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=16, help="simulated pods (vLLM publishers)")
    parser.add_argument("--steps", type=int, default=400, help="engine steps (batches) per pod")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--rate", type=int, default=100_000, help="block events/s of the paced run")
    parser.add_argument("--db-rate", type=int, default=50_000, help="block events/s of the paced database runs")
    parser.add_argument("--databases", default="sqlite,postgresql", help="backends of the database runs ('' for none)")
    parser.add_argument("--pg-url", default=None, help="an empty PostgreSQL database (default: a throwaway server)")
    parser.add_argument("--publishers", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.publishers:
        run_publishers(args)
        return
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} (shared with other work)")
    gc.set_threshold(*WATCH_GC_THRESHOLDS)  # the collector runs as `fleet watch` runs it
    bench_end_to_end(args, rate=0)
    bench_end_to_end(args, rate=args.rate)
    if args.databases:
        scratch = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
        pg_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-pg-"))
        try:
            for _, fresh in fresh_databases(args, scratch, pg_dir):
                bench_end_to_end(args, rate=0, database=fresh())
                bench_end_to_end(args, rate=args.db_rate, database=fresh())
        finally:
            _stop_postgres(pg_dir)
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(pg_dir, ignore_errors=True)
    bench_per_batch(args)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
