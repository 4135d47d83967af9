"""Builders and readers for the fleet-history tests (no tests here).

`held_copies` reads a source's held blocks from the database in the shape `FleetIndex.copies` returns,
so a test can compare the stored state with the index (and with vLLM's block pool) directly.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Engine, select

from fleet.events import BatchOrigin, BlockHash, BlockRemoved, BlockStored, EventBatch, KVEvent, PodBatch
from fleet.source import PodSource
from storage.read import fleet_queries
from storage.write.fleet_rows import parse_hash_text
from storage.schema import FLEET_BLOCKS, FLEET_EVENTS, FLEET_EVICTIONS


def pod_source(name: str = "a") -> PodSource:
    return PodSource(name, f"tcp://127.0.0.1:{5557 + len(name)}", f"tcp://127.0.0.1:{6557 + len(name)}", "kv-events")


def batch(pod: str, seq: int, *events: KVEvent, ts: float = 100.0) -> PodBatch:
    """A batch as the collector hands it on, received half a second after its publisher time."""
    return PodBatch(pod, seq, EventBatch(ts, tuple(events), 0), ts + 0.5, BatchOrigin.LIVE)


def stored(
    hashes: Iterable[BlockHash], parent: BlockHash | None = None, block_size: int = 4, group: int = 0
) -> BlockStored:
    """BlockStored of `hashes` in a chain after `parent`; block h holds tokens 10 * (h % 1000) + 0, 1, ..."""
    hashes = tuple(hashes)
    tokens = tuple(10 * (h % 1000 if isinstance(h, int) else len(h)) + j for h in hashes for j in range(block_size))
    return BlockStored(hashes, parent, tokens, block_size, "GPU", group)


def removed(*hashes: BlockHash, group: int = 0) -> BlockRemoved:
    return BlockRemoved(tuple(hashes), "GPU", group)


def held_copies(db: Engine, source_id: str) -> dict[tuple[str, int, BlockHash], int]:
    """The copies of every hash a source holds, by (medium, group, hash): `FleetIndex.copies`' shape."""
    frame = fleet_queries.held_blocks(db, source_id)
    return {
        (row.medium, int(row.group_idx), parse_hash_text(row.block_hash)): int(row.copies)
        for row in frame.itertuples()
    }


def held_rows(db: Engine, source_id: str) -> list[tuple]:
    """What a source holds: (n, hash text, copies, stored_at) per fleet_blocks row, by n."""
    columns = [FLEET_BLOCKS.c[name] for name in ("n", "block_hash", "copies", "stored_at")]
    with db.connect() as connection:
        statement = select(*columns).where(FLEET_BLOCKS.c.source_id == source_id).order_by(FLEET_BLOCKS.c.n)
        return [tuple(row) for row in connection.execute(statement)]


def evictions(db: Engine, source_id: str) -> list[tuple]:
    """Every eviction row of a source: (time, reason, hash text, age_s, copies_left), in insertion order."""
    table = FLEET_EVICTIONS.c
    with db.connect() as connection:
        statement = (
            select(table.time, table.reason, table.block_hash, table.age_s, table.copies_left)
            .where(table.source_id == source_id)
            .order_by(table.id)
        )
        return [tuple(row) for row in connection.execute(statement)]


def event_rows(db: Engine, source_id: str) -> list[tuple]:
    """Every fleet_events row of a source: (seq, kind, num_blocks, block_hashes), in insertion order."""
    table = FLEET_EVENTS.c
    with db.connect() as connection:
        statement = (
            select(table.seq, table.kind, table.num_blocks, table.block_hashes)
            .where(table.source_id == source_id)
            .order_by(table.id)
        )
        return [tuple(row) for row in connection.execute(statement)]
