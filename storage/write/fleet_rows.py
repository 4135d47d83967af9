"""Turn a collector's batches into rows of the fleet tables: events, held blocks, the eviction log.

Pure Python, no SQL (storage.write.fleet_bulk writes what this builds). The storage layer depends on the fleet
package only through the types it persists, `fleet.events` and `fleet.source`, as it depends on the
engine only through `engine.core.events` (tests/test_layering.py checks both).

Per source the builder keeps what `fleet.index` keeps per group, reduced to what a lifetime needs:
(medium, group_idx, hash) -> `_Life(copies, n, stored_at)`. The rule is the index's copy counting:

    BlockStored of a hash not held   lifetime n opens: a fleet_blocks row (copies 1, stored_at = ts)
    BlockStored of a held hash       copies += 1 (vLLM does not de-duplicate)
    BlockRemoved of a held hash      copies -= 1, an eviction row ("removed", age ts - stored_at,
                                     copies_left); at 0 the lifetime ends and its fleet_blocks row goes
    BlockRemoved of a hash not held  an eviction row of unknown age (a feed joined late, or a gap)
    AllBlocksCleared                 every held hash ends: an eviction row each ("cleared", copies_left 0)
    PodReset (a restarted server)    the same, reason "reset"

Rows are built per unit of work (`FleetRows`: one batch, a reset, a pod opened, a pod's status or
metrics scrape, the collector closing).
A lifetime that opens and ends in one unit never reaches fleet_blocks; one that opens in a unit is
inserted as it stands at the unit's end; one opened earlier gets an update of its copies (`changed`;
only duplicated blocks change copies) or a delete (`ended`), and a clear or reset deletes every held
row of the source numbered below its next n (`ended_below`), so a later lifetime in the same
transaction is never touched.

One `fleet_events` row per event, but consecutive BlockRemoved events of one batch and one (medium,
group) become one row holding all their hashes: vLLM sends one BlockRemoved per evicted block, and the
run says exactly what the events said (a removal carries nothing but its hash), in a fraction of the rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import groupby

from fleet.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    PodBatch,
    PodMetrics,
    PodReset,
    PodStatus,
)
from fleet.source import PodSource

_HEX_PREFIX = "0x"


class FleetEventKind(enum.StrEnum):
    """What a `fleet_events` row records."""

    STORED = "stored"  # a BlockStored
    REMOVED = "removed"  # a BlockRemoved
    CLEARED = "cleared"  # an AllBlocksCleared
    RESET = "reset"  # the collector found the server restarted (fleet.events.PodReset)


class RemovalReason(enum.StrEnum):
    """Why a copy left a pod's cache (a `fleet_evictions` row)."""

    REMOVED = "removed"  # a BlockRemoved: an eviction
    CLEARED = "cleared"  # the pod's prefix cache was reset (AllBlocksCleared)
    RESET = "reset"  # the pod's server restarted


def hash_text(block_hash: BlockHash) -> str:
    """A hash as the fleet tables store it: an int in decimal, bytes as "0x" and hex digits."""
    if isinstance(block_hash, bytes):
        return _HEX_PREFIX + block_hash.hex()
    return str(block_hash)


def parse_hash_text(text: str) -> BlockHash:
    """The inverse of `hash_text`.

    Raises:
        ValueError: not a text `hash_text` makes.
    """
    if text.startswith(_HEX_PREFIX):
        return bytes.fromhex(text[len(_HEX_PREFIX) :])
    return int(text)


def source_id(collector_id: str, pod: str) -> str:
    """The `fleet_sources.id` of a pod as one collector watches it."""
    return f"{collector_id}/{pod}"


@dataclass
class FleetRows:
    """The rows of one unit of work, in the column orders of storage.schema. Values are driver-ready but
    for the JSON columns (fleet_events.block_hashes, fleet_blocks.token_ids), which hold the Python lists:
    storage.write.fleet_bulk encodes them the way each dialect's bulk path takes them."""

    sources: list[tuple] = field(default_factory=list)  # FLEET_SOURCE_COLUMNS rows the others need (if missing)
    events: list[list] = field(default_factory=list)  # FLEET_EVENT_COLUMNS
    opened: dict[int, list] = field(default_factory=dict)  # lifetime n -> FLEET_BLOCK_COLUMNS row (one source)
    changed: list[tuple] = field(default_factory=list)  # (source_id, n, copies) of earlier lifetimes
    ended: list[tuple] = field(default_factory=list)  # (source_id, n) of earlier lifetimes
    ended_below: list[tuple] = field(default_factory=list)  # (source_id, n): every held row numbered below n
    evictions: list[tuple] = field(default_factory=list)  # FLEET_EVICTION_COLUMNS
    source_closes: list[tuple] = field(default_factory=list)  # (source_id, closed_at)
    statuses: list[tuple] = field(default_factory=list)  # (source_id, *FLEET_SOURCE_STATUS_COLUMNS)
    metrics: list[tuple] = field(default_factory=list)  # FLEET_METRICS_COLUMNS
    num_block_events: int = 0  # blocks stored plus blocks removed in the batch it holds
    num_new_sources: int = 0  # of `sources`, the ones this unit introduces (the rest are written already)

    @property
    def num_rows(self) -> int:
        """Rows inserted, updated or deleted (a delete of every row below n counts one)."""
        return (
            self.num_new_sources
            + len(self.events)
            + len(self.opened)
            + len(self.changed)
            + len(self.ended)
            + len(self.ended_below)
            + len(self.evictions)
            + len(self.source_closes)
            + len(self.statuses)
            + len(self.metrics)
        )


@dataclass(slots=True)
class _Life:
    """An open lifetime of one hash in one (medium, group)."""

    copies: int  # physical blocks holding it now (>= 1)
    n: int  # its number in the source
    stored_at: float  # publisher time it opened
    pending: list | None  # its fleet_blocks row while the unit it opened in is being built


@dataclass
class _Source:
    """What the builder keeps of one watched pod."""

    row: tuple  # its fleet_sources row
    held: dict[tuple[str, int, BlockHash], _Life] = field(default_factory=dict)  # open lifetimes
    next_n: int = 0  # the number the next lifetime gets

    @property
    def id(self) -> str:
        return self.row[0]


# Positions in a FLEET_BLOCK_COLUMNS row a change of copies fills.
_COPIES = 8
_REMOVED_EVENT = FleetEventKind.REMOVED.value
_REMOVED = RemovalReason.REMOVED.value


class FleetRowBuilder:
    """Rows for one collector's pods. Not thread-safe: the collector's dispatcher is its one caller."""

    def __init__(self, collector_id: str) -> None:
        """Args:
        collector_id: this collector's id (the prefix of its sources' ids).
        """
        self.collector_id = collector_id  # names this collector's rows
        self._sources: dict[str, _Source] = {}  # by pod name
        self._unit_lives: list[_Life] = []  # lifetimes opened in the unit being built (their rows pending)

    def source_ids(self) -> dict[str, str]:
        """Each opened pod's fleet_sources id, by pod name."""
        return {pod: source.id for pod, source in self._sources.items()}

    def num_lifetimes(self, pod: str) -> int:
        """Lifetimes a pod's hashes have opened so far (held ones included); 0 for an unknown pod."""
        source = self._sources.get(pod)
        return 0 if source is None else source.next_n

    def open(self, pod: PodSource, at: float) -> FleetRows:
        """The row of a newly watched pod (a pod opened again keeps its source and its state)."""
        source = self._sources.get(pod.name)
        if source is None:
            row = (
                source_id(self.collector_id, pod.name),
                self.collector_id,
                pod.name,
                pod.endpoint,
                pod.replay_endpoint,
                pod.topic,
                pod.metrics_url,
                at,
                None,
            )
            source = self._sources[pod.name] = _Source(row)
        return FleetRows(sources=[source.row], num_new_sources=1)

    def batch(self, batch: PodBatch) -> FleetRows:
        """The rows of one batch, in event order.

        Raises:
            KeyError: the pod was never opened.
        """
        source = self._sources[batch.pod]
        rows = FleetRows(sources=[source.row])
        ts = batch.batch.ts
        head = [source.id, batch.seq, ts, batch.received_at, batch.origin.value]
        for run_key, run in groupby(batch.batch.events, key=_run_key):
            if run_key is not None:  # consecutive removals of one (medium, group)
                medium, group = run_key
                hashes = [block_hash for event in run for block_hash in event.block_hashes]
                self._removed(source, medium, group, hashes, ts, rows, head)
                continue
            for event in run:
                if isinstance(event, BlockStored):
                    self._stored(source, event, ts, rows, head)
                elif isinstance(event, AllBlocksCleared):
                    rows.events.append([*head, FleetEventKind.CLEARED.value, None, None, 0, None, None, None])
                    _end_all(source, ts, RemovalReason.CLEARED, rows)
        self._close_unit()
        rows.num_block_events = batch.batch.num_block_events
        return rows

    def reset(self, reset: PodReset) -> FleetRows:
        """The rows of a restarted server: a reset event, and every held hash ended.

        Raises:
            KeyError: the pod was never opened.
        """
        source = self._sources[reset.pod]
        rows = FleetRows(sources=[source.row])
        kind = FleetEventKind.RESET.value
        rows.events.append([source.id, reset.new_seq, reset.at, reset.at, None, kind, None, None, 0, None, None, None])
        _end_all(source, reset.at, RemovalReason.RESET, rows)
        return rows

    def status(self, status: PodStatus) -> FleetRows:
        """The source's link, heartbeat and counts, as the collector last reported them.

        Raises:
            KeyError: the pod was never opened.
        """
        source = self._sources[status.pod]
        row = (source.id, status.link.value, status.at, status.num_lost_batches, status.num_restarts)
        return FleetRows(sources=[source.row], statuses=[row])

    def metrics(self, metrics: PodMetrics) -> FleetRows:
        """One scrape of the pod's /metrics.

        Raises:
            KeyError: the pod was never opened.
        """
        source = self._sources[metrics.pod]
        row = (
            source.id,
            metrics.at,
            metrics.prefix_cache_queries,
            metrics.prefix_cache_hits,
            metrics.num_preemptions,
            metrics.kv_cache_usage,
            metrics.num_running,
            metrics.num_waiting,
            metrics.num_gpu_blocks,
            metrics.error,
        )
        return FleetRows(sources=[source.row], metrics=[row])

    def close(self, at: float) -> FleetRows:
        """Every source's closing time (their held blocks stay as last seen)."""
        return FleetRows(
            sources=[source.row for source in self._sources.values()],
            source_closes=[(source.id, at) for source in self._sources.values()],
        )

    def _close_unit(self) -> None:
        """The unit goes to the writer: later changes of its lifetimes are updates and deletes."""
        for life in self._unit_lives:
            life.pending = None
        self._unit_lives.clear()

    def _stored(self, source: _Source, event: BlockStored, ts: float, rows: FleetRows, head: list) -> None:
        medium, group, size = event.medium, event.group_idx, event.block_size
        texts = [hash_text(block_hash) for block_hash in event.block_hashes]
        parent_text = None if event.parent_block_hash is None else hash_text(event.parent_block_hash)
        rows.events.append([*head, FleetEventKind.STORED.value, medium, group, len(texts), texts, parent_text, size])
        aligned = event.tokens_aligned
        parent = parent_text if aligned else None  # as fleet.index: no tokens, no place in the tree
        tokens = event.token_ids
        held = source.held
        for i, block_hash in enumerate(event.block_hashes):
            key = (medium, group, block_hash)
            life = held.get(key)
            if life is None:
                n = source.next_n
                source.next_n += 1
                block_tokens = tokens[i * size : (i + 1) * size] if aligned else None
                row = [source.id, n, medium, group, texts[i], parent, size, block_tokens, 1, ts]
                life = held[key] = _Life(1, n, ts, row)
                self._unit_lives.append(life)
                rows.opened[n] = row
            else:
                life.copies += 1
                _change(source.id, life, rows)
            if aligned:
                parent = texts[i]

    @staticmethod
    def _removed(
        source: _Source, medium: str, group: int, hashes: list[BlockHash], ts: float, rows: FleetRows, head: list
    ) -> None:
        """A run of removals of one (medium, group): one event row, an eviction row per copy."""
        texts = [hash_text(block_hash) for block_hash in hashes]
        rows.events.append([*head, _REMOVED_EVENT, medium, group, len(texts), texts, None, None])
        held = source.held
        evictions = rows.evictions
        for block_hash, text in zip(hashes, texts):
            key = (medium, group, block_hash)
            life = held.get(key)
            if life is None:
                evictions.append((source.id, ts, _REMOVED, medium, group, text, None, None))
                continue
            life.copies -= 1
            evictions.append((source.id, ts, _REMOVED, medium, group, text, ts - life.stored_at, life.copies))
            if life.copies:
                _change(source.id, life, rows)
                continue
            del held[key]
            if life.pending is not None:  # opened in this unit: it never reaches the table
                del rows.opened[life.n]
            else:
                rows.ended.append((source.id, life.n))


def _run_key(event: object) -> tuple[str, int] | None:
    """What groups consecutive events into one run: (medium, group) for a BlockRemoved, None (no run) else."""
    return (event.medium, event.group_idx) if type(event) is BlockRemoved else None


def _change(source_id: str, life: _Life, rows: FleetRows) -> None:
    """Record a held lifetime's copies now."""
    if life.pending is not None:  # opened in this unit: its row is inserted as it stands at the end
        life.pending[_COPIES] = life.copies
    else:
        rows.changed.append((source_id, life.n, life.copies))


def _end_all(source: _Source, at: float, reason: RemovalReason, rows: FleetRows) -> None:
    """Every hash the source holds leaves: one eviction row each, and its fleet_blocks row goes."""
    earlier = False  # whether a lifetime opened in an earlier unit is still held
    for (medium, group, block_hash), life in source.held.items():
        text = hash_text(block_hash)
        if life.pending is not None:
            del rows.opened[life.n]
        else:
            earlier = True
        rows.evictions.append((source.id, at, reason.value, medium, group, text, at - life.stored_at, 0))
    if earlier:
        rows.ended_below.append((source.id, source.next_n))
    source.held.clear()
