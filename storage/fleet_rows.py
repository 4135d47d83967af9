"""Turn a collector's batches into rows of the fleet tables: events, block lifetimes, the eviction log.

Pure Python, no SQL (storage.fleet_bulk writes what this builds). The storage layer depends on the fleet
package only through the types it persists, `fleet.events` and `fleet.source`, as it depends on the
engine only through `engine.events` (tests/test_layering.py checks both).

Per source the builder keeps what `fleet.index` keeps per group, reduced to what a lifetime needs:
(medium, group_idx, hash) -> `_Life(copies, n, stored_at)`. The rule is the index's copy counting:

    BlockStored of a hash not held   opens lifetime n (copies 1), stored_at = the batch's ts
    BlockStored of a held hash       copies += 1 (vLLM does not de-duplicate)
    BlockRemoved of a held hash      copies -= 1, one eviction row of age ts - stored_at;
                                     at 0 the lifetime ends ("removed", copies 0)
    BlockRemoved of a hash not held  one eviction row of unknown age (a feed joined late, or a gap)
    AllBlocksCleared                 every open lifetime ends ("cleared")
    PodReset (a restarted server)    every open lifetime ends ("reset")

One `fleet_events` row per event, but consecutive BlockRemoved events of one batch and one (medium,
group) become one row holding all their hashes: vLLM sends one BlockRemoved per evicted block, and the
run says exactly what the events said (a removal carries nothing but its hash), in a fraction of the rows.

A lifetime that opens (and changes, or ends) within one `FleetRows` is inserted as it stands at the end;
one opened earlier is changed by an update of its copies and end (`changed`: absolute values, so the last
change of a lifetime is its state), and a clear or reset ends every open lifetime numbered below the
source's next n (`ended_below`), so rows of a later lifetime in the same transaction are never touched.
In steady state a lifetime gets one insert and one update (its end); copies change in between only
for duplicated blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fleet.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, PodBatch, PodReset
from fleet.source import PodSource
from storage.db import encode_json

_HEX_PREFIX = "0x"


class FleetEventKind(enum.StrEnum):
    """What a `fleet_events` row records."""

    STORED = "stored"  # a BlockStored
    REMOVED = "removed"  # a BlockRemoved
    CLEARED = "cleared"  # an AllBlocksCleared
    RESET = "reset"  # the collector found the server restarted (fleet.events.PodReset)


class LifetimeEnd(enum.StrEnum):
    """How a block lifetime (`fleet_blocks` row) ended."""

    REMOVED = "removed"  # a BlockRemoved took its last copy
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
    """The rows of one unit of work (a pod opened, one batch, a reset, the collector closing).

    Tuples hold driver-ready values (JSON already encoded) in the column orders of storage.models.
    """

    sources: list[tuple] = field(default_factory=list)  # FLEET_SOURCE_COLUMNS rows the others need (if missing)
    events: list[list] = field(default_factory=list)  # FLEET_EVENT_COLUMNS
    opened: list[list] = field(default_factory=list)  # FLEET_BLOCK_COLUMNS (lists: a lifetime may change in this unit)
    changed: list[tuple] = field(default_factory=list)  # (source_id, n, copies, removed_at, end_reason)
    ended_below: list[tuple] = field(default_factory=list)  # (source_id, n, removed_at, end_reason): every open n below
    evictions: list[tuple] = field(default_factory=list)  # FLEET_EVICTION_COLUMNS
    source_closes: list[tuple] = field(default_factory=list)  # (source_id, closed_at)
    num_block_events: int = 0  # blocks stored plus blocks removed in the batches it holds
    num_new_sources: int = 0  # of `sources`, the ones this unit introduces (the rest are written already)

    @property
    def num_rows(self) -> int:
        """Rows inserted or updated (a close-all counts one)."""
        return (
            self.num_new_sources
            + len(self.events)
            + len(self.opened)
            + len(self.changed)
            + len(self.ended_below)
            + len(self.evictions)
            + len(self.source_closes)
        )


@dataclass(slots=True)
class _Life:
    """An open lifetime of one hash in one (medium, group)."""

    copies: int  # physical blocks holding it now (>= 1)
    n: int  # its number in the source
    stored_at: float  # publisher time it opened
    pending: list | None  # its row, while it is still in the FleetRows being built (not yet written)


@dataclass
class _Source:
    """What the builder keeps of one watched pod."""

    row: tuple  # its fleet_sources row
    held: dict[tuple[str, int, BlockHash], _Life] = field(default_factory=dict)  # open lifetimes
    next_n: int = 0  # the number the next lifetime gets

    @property
    def id(self) -> str:
        return self.row[0]


# Positions in a FLEET_BLOCK_COLUMNS row that a change of copies, or an end, fills.
_COPIES, _REMOVED_AT, _END_REASON = 8, 10, 11
# Positions in a FLEET_EVENT_COLUMNS row that a run of removals extends.
_KIND, _MEDIUM, _GROUP, _NUM_BLOCKS, _HASHES = 5, 6, 7, 8, 9
_REMOVED = FleetEventKind.REMOVED.value


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

    def num_held(self, pod: str) -> int:
        """Open lifetimes of a pod (hashes held, every medium and group); 0 for an unknown pod."""
        source = self._sources.get(pod)
        return 0 if source is None else len(source.held)

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
        for event in batch.batch.events:
            if isinstance(event, BlockStored):
                self._stored(source, event, ts, rows, head)
            elif isinstance(event, BlockRemoved):
                self._removed(source, event, ts, rows, head)
            elif isinstance(event, AllBlocksCleared):
                rows.events.append([*head, FleetEventKind.CLEARED.value, None, None, 0, None, None, None])
                self._end_all(source, ts, LifetimeEnd.CLEARED, rows)
        for row in rows.events:  # hash lists were kept open for runs of removals; now they are JSON
            if row[_HASHES] is not None:
                row[_HASHES] = encode_json(row[_HASHES])
        for life in self._unit_lives:
            life.pending = None  # the rows go to the writer now: later ends are updates
        self._unit_lives.clear()
        rows.num_block_events = batch.batch.num_block_events
        return rows

    def reset(self, reset: PodReset) -> FleetRows:
        """The rows of a restarted server: a reset event, and every open lifetime ended.

        Raises:
            KeyError: the pod was never opened.
        """
        source = self._sources[reset.pod]
        rows = FleetRows(sources=[source.row])
        kind = FleetEventKind.RESET.value
        rows.events.append([source.id, reset.new_seq, reset.at, reset.at, None, kind, None, None, 0, None, None, None])
        self._end_all(source, reset.at, LifetimeEnd.RESET, rows)
        return rows

    def close(self, at: float) -> FleetRows:
        """Every source's closing time (their held blocks stay as last seen)."""
        return FleetRows(
            sources=[source.row for source in self._sources.values()],
            source_closes=[(source.id, at) for source in self._sources.values()],
        )

    def _stored(self, source: _Source, event: BlockStored, ts: float, rows: FleetRows, head: tuple) -> None:
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
                block_tokens = encode_json(tokens[i * size : (i + 1) * size]) if aligned else None
                row = [source.id, source.next_n, medium, group, texts[i], parent, size, block_tokens, 1, ts, None, None]
                life = held[key] = _Life(1, source.next_n, ts, row)
                self._unit_lives.append(life)
                source.next_n += 1
                rows.opened.append(row)
            else:
                life.copies += 1
                _change(source.id, life, rows)
            if aligned:
                parent = texts[i]

    @staticmethod
    def _removed(source: _Source, event: BlockRemoved, ts: float, rows: FleetRows, head: tuple) -> None:
        medium, group = event.medium, event.group_idx
        texts = [hash_text(block_hash) for block_hash in event.block_hashes]
        last = rows.events[-1] if rows.events else None
        if last is not None and last[_KIND] == _REMOVED and last[_MEDIUM] == medium and last[_GROUP] == group:
            last[_HASHES].extend(texts)  # a run of removals: one row
            last[_NUM_BLOCKS] += len(texts)
        else:
            rows.events.append([*head, _REMOVED, medium, group, len(texts), texts, None, None])
        held = source.held
        for block_hash, text in zip(event.block_hashes, texts):
            key = (medium, group, block_hash)
            life = held.get(key)
            if life is None:
                rows.evictions.append((source.id, ts, medium, group, text, None, None))
                continue
            life.copies -= 1
            rows.evictions.append((source.id, ts, medium, group, text, ts - life.stored_at, life.copies))
            if life.copies == 0:
                del held[key]
                _change(source.id, life, rows, ts, LifetimeEnd.REMOVED)
            else:
                _change(source.id, life, rows)

    @staticmethod
    def _end_all(source: _Source, at: float, reason: LifetimeEnd, rows: FleetRows) -> None:
        earlier = False  # whether a lifetime opened in an earlier unit is still open
        for life in source.held.values():
            if life.pending is not None:
                _set(life.pending, 0, at, reason)
            else:
                earlier = True
        if earlier:
            rows.ended_below.append((source.id, source.next_n, at, reason.value))
        source.held.clear()


def _change(
    source_id: str, life: _Life, rows: FleetRows, at: float | None = None, end: LifetimeEnd | None = None
) -> None:
    """Record a lifetime's copies now, and its end if it ended (`at`, `end`)."""
    if life.pending is not None:  # opened in this unit: its row is inserted as it stands at the end
        _set(life.pending, life.copies, at, end)
    else:
        rows.changed.append((source_id, life.n, life.copies, at, None if end is None else end.value))


def _set(row: list, copies: int, at: float | None, end: LifetimeEnd | None) -> None:
    row[_COPIES] = copies
    row[_REMOVED_AT] = at
    row[_END_REASON] = None if end is None else end.value
