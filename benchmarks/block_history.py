"""How long a block's history takes to read back from a large stored history (SQLite, optionally PostgreSQL).

A pure-Python KV cache manager (no model) runs a random workload of prefix hits, forks with
copy-on-write and releases over a small pool (at most 64 requests holding blocks at once, as the
engine's default `max_num_seqs`), so every block has a long life story; its events go
through the writer into a fresh database. Then `storage.read.queries.block_timelines` is timed for one
block, and for the blocks of one request's fork family, against the size of the events table.

Run: `.venv/bin/python benchmarks/block_history.py [--events 200000] [--pg URL]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.block_pool import BlockPool  # noqa: E402
from engine.core.chain_keys import ChainKeys  # noqa: E402
from engine.core.events import EventLog  # noqa: E402
from engine.core.full_attention_manager import FullAttentionManager  # noqa: E402
from engine.core.namespace import CacheNamespace, NamespaceRoots  # noqa: E402
from storage.read import queries  # noqa: E402
from storage.db import db_engine  # noqa: E402
from storage.write.retention import RetentionPolicy  # noqa: E402
from storage.write.writer import EventWriter, RunInfo, WriterOptions  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 256
MAX_LIVE = 64  # requests holding blocks at once (the engine's default max_num_seqs)


def workload(num_events: int, seed: int = 0):
    """Batches of engine events from a random workload, until about `num_events` events."""
    rng = random.Random(seed)
    log = EventLog()
    m = FullAttentionManager(BlockPool(NUM_BLOCKS, BLOCK_SIZE, log), CacheNamespace("m", "r", "float32", BLOCK_SIZE, ("full",)), log)
    root = NamespaceRoots(m.namespace, [m.pool]).root_key(None)
    stems = [[rng.randrange(1000) for _ in range(BLOCK_SIZE * 4)] for _ in range(8)]
    live: list[str] = []
    made = 0
    counter = 0
    while made < num_events:
        log.step += 1
        counter += 1
        rid = f"r{counter}"
        roll = rng.random()
        if len(live) >= MAX_LIVE or (live and 0.3 <= roll < 0.6):
            m.free(live.pop(rng.randrange(len(live))))
        elif live and roll < 0.3:
            m.fork(rng.choice(live), rid)
            if m.can_append(rid, 3):
                m.append(rid, [1, 2, 3])
            live.append(rid)
        else:
            prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            hits = m.find_prefix_hit(prompt, ChainKeys(root, BLOCK_SIZE))
            new = prompt[len(hits) * BLOCK_SIZE :]
            if m.can_allocate(len(new), hits):
                m.allocate(rid, new, root_key=root, hits=hits)
                m.cache_full_blocks(rid)
                live.append(rid)
        events = log.take()
        made += len(events)
        yield events


def timed(call, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(url: str, num_events: int) -> None:
    options = WriterOptions(retention=RetentionPolicy(max_age_days=None, max_events=None, max_evictions=None))
    writer = EventWriter(url, options)
    run = writer.start_run(RunInfo(model="bench", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype="float32", device="cpu"))
    start = time.perf_counter()
    for events in workload(num_events):
        writer.submit(events)
    writer.close(timeout_s=600)
    written = writer.stats().written_events
    print(f"{url.split(':')[0]}: {written:,} events written in {time.perf_counter() - start:.1f} s")
    db = db_engine(url)
    one = timed(lambda: queries.block_timelines(db, run, [7]))
    rows = len(queries.block_timelines(db, run, [7])[7].rows)
    family = queries.fork_family(db, run, "r100")
    blocks = queries.request_blocks(db, run, family)[: queries.MAX_TIMELINE_BLOCKS]
    many = timed(lambda: queries.block_timelines(db, run, blocks, request_ids=family))
    print(f"  one block ({rows:,} rows): {one * 1000:.0f} ms; a fork family's {len(blocks)} blocks: {many * 1000:.0f} ms")
    db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--pg", default=None, help="also measure on this PostgreSQL URL (an empty database)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure(f"sqlite:///{Path(tmp) / 'history.sqlite'}", args.events)
    if args.pg:
        measure(args.pg, args.events)


if __name__ == "__main__":
    main()
