"""A block's life, rebuilt from its events: every change of its reference count, in order.

Pure Python over stored event rows (no SQL here; `storage.read.block_timelines` reads the rows). The
engine's events carry everything a block's count depends on (engine/core/events.py's detail table):

    ALLOCATE   block_ids       count := 1, the request is its only holder (a new life starts)
    HIT        block_ids       count + 1: a prefix hit shares it
    FORK       block_ids       count + 1: a fork child shares its parent's table
    RELEASE    block_ids       count - 1: the request dropped its reference
    COW        src_block, dst_block   names the RELEASE of the source and the ALLOCATE of the copy that
                               the copy-on-write made just before it; it changes no count itself
    WINDOW_RELEASE block_ids   names the RELEASE just before it: the block left a sliding window
    CACHE      block_ids       the block entered the prefix index (at count 0 it will be evictable)
    EVICT      block_id        the block left the index (at count 0 it is free)
    PROMOTE    block_ids       names the ALLOCATE just before it: the block's new life began with the disk
                               tier's copy read into it ("promoted from disk"); it changes no count
    DEMOTE     block_id        names the EVICT of the same key (its life ended "demoted to disk"); without
                               one (an engine stopping writes its cached blocks back) a row of its own
    TIER_DROP  block_id        names the EVICT of the same key: the tier did not take the block

The disk tier's events come after the changes they name (a DEMOTE is planned at the end of the step whose
allocation evicted the block, so it may follow the block's next ALLOCATE), and never change a count.

A copy-on-write and its RELEASE (source) or ALLOCATE (destination), a window release and its RELEASE, a
promotion and its ALLOCATE, and a demotion or a tier drop and its EVICT are one row: the row of the change,
named by the event that explains it. Every other event
that touches the block is a row of its own.

Invariants of a history built from a complete, ordered event stream (the property tests in
tests/test_block_history.py replay the engine's own events against its pool):
    * `ref_count` after each row equals the pool's reference count of the block at that moment, and
      `holders` are exactly the requests whose tables point at it, in the order they took it;
    * `state` is "referenced" while ref_count > 0, else "evictable" while it is in the prefix index,
      else "free"; `marker` is set on exactly the rows that take the count to 0.
A stored history can start mid-life (retention pruned the oldest events) or predate block lists in
HIT and FORK events; then the rows before the block's first ALLOCATE in the stream are left out and
`complete` is False.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

SAFE_TO_REUSE = "no holder left: safe to reuse"
EVICTABLE_FROM_HERE = "evictable from here on"
REFERENCED, EVICTABLE, FREE = "referenced", "evictable", "free"  # engine.core.block_pool.BlockState values

# Event kinds (engine.core.events.EventKind values) that can touch a block.
ALLOCATE, HIT, FORK, RELEASE, COW = "allocate", "hit", "fork", "release", "cow"
CACHE, EVICT, WINDOW_RELEASE = "cache", "evict", "window_release"
DEMOTE, PROMOTE, TIER_DROP = "demote", "promote", "tier_drop"  # the disk tier's (full group only, no `group`)
TIER_KINDS = (DEMOTE, PROMOTE, TIER_DROP)
BLOCK_KINDS = (ALLOCATE, HIT, FORK, RELEASE, COW, CACHE, EVICT, WINDOW_RELEASE, *TIER_KINDS)
_LISTED = frozenset({ALLOCATE, HIT, FORK, RELEASE, CACHE, WINDOW_RELEASE, PROMOTE})  # name their blocks in block_ids
_NAMED = frozenset({EVICT, DEMOTE, TIER_DROP})  # name their block as block_id

# The columns of a history frame, in order.
HISTORY_COLUMNS = (
    "event_id", "step", "time", "event", "request_id", "change", "ref_count", "holders", "state", "marker", "life",
)  # fmt: skip


class StoredEvent(NamedTuple):
    """One `events` row, as storage.read.queries reads it."""

    id: int
    step: int
    time: float
    kind: str  # an EventKind value
    request_id: str | None
    block_id: int | None
    detail: dict[str, Any]

    def touches(self, block_id: int) -> bool:
        """Whether this event is about `block_id` (see the module docstring for where each kind says so)."""
        if self.kind in _LISTED:
            return block_id in (self.detail.get("block_ids") or ())
        if self.kind == COW:
            return block_id in (self.detail.get("src_block"), self.detail.get("dst_block"))
        return self.kind in _NAMED and self.block_id is not None and self.block_id == block_id


@dataclass
class BlockChange:
    """One row of a block's history: what happened, and the block right after it."""

    event_id: int  # the (first) stored event of the change
    step: int  # engine step
    time: float  # epoch seconds
    event: str  # the event kind that names the change (a copy-on-write's release reads "cow")
    request_id: str | None  # who changed it
    change: str  # in words: "allocated to req-0", "shared by fork req-1 of req-0", ...
    ref_count: int  # reference count after the change
    holders: tuple[str, ...]  # requests holding it after the change, in the order they took it
    state: str  # "referenced", "evictable" or "free" after the change
    marker: str  # SAFE_TO_REUSE or EVICTABLE_FROM_HERE on a change that took the count to 0, else ""
    life: int  # 0 for the first allocation seen, +1 at every later allocation

    def values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in HISTORY_COLUMNS)


@dataclass(frozen=True)
class BlockLife:
    """A block's history as replayed: its rows, and whether the stream covered all of it."""

    block_id: int
    rows: list[BlockChange]
    complete: bool  # False: the stream started mid-life or lacked block lists (see the module docstring)


class _Replay:
    """The state of one block while its events are replayed."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.rows: list[BlockChange] = []
        self.holders: list[str] = []
        self.cached = False
        self.started = False  # an ALLOCATE has been seen: the count is known from here on
        self.complete = True
        self.life = -1
        # The last EVICT's row, key and reason, until a DEMOTE or TIER_DROP of that key names it.
        self.evicted: tuple[BlockChange, str | None, str | None] | None = None

    def apply(self, event: StoredEvent) -> None:
        kind, rid, detail = event.kind, event.request_id, event.detail
        if kind in (HIT, FORK) and "block_ids" not in detail:
            self.complete = False  # recorded before HIT/FORK listed their blocks: the count is unknown
            return
        if kind == ALLOCATE:
            self.started, self.life, self.cached = True, self.life + 1, False
            self.holders = [rid or "?"]
            self._row(event, f"allocated to {rid}")
            return
        if not self.started:
            self.complete = False  # the stream starts mid-life (older events pruned)
            return
        if kind == HIT:
            self.holders.append(rid or "?")
            self._row(event, f"shared by a prefix hit of {rid}")
        elif kind == FORK:
            self.holders.append(rid or "?")
            self._row(event, f"shared by fork {rid} of {detail.get('parent_id')}")
        elif kind == RELEASE:
            if rid in self.holders:
                self.holders.remove(rid)
            else:
                self.complete = False
            self._row(event, f"released by {rid}")
        elif kind == COW:
            self._copy_on_write(event)
        elif kind == WINDOW_RELEASE:
            last = self.rows[-1] if self.rows else None
            if last is not None and last.event == RELEASE and last.request_id == rid:
                last.event, last.change = WINDOW_RELEASE, f"released by {rid}: it left the request's sliding window"
        elif kind == CACHE:
            self.cached = True
            self._row(event, "cached: entered the prefix index")
        elif kind == EVICT:
            self.cached = False
            reason = detail.get("reason")
            self._row(event, f"evicted ({reason}): left the prefix index")
            self.evicted = (self.rows[-1], detail.get("key"), reason)
        elif kind == PROMOTE:
            self._promotion(event)
        elif kind in (DEMOTE, TIER_DROP):
            self._tier_store(event)

    def _promotion(self, event: StoredEvent) -> None:
        """Name the allocation the promotion read the disk tier's copy into (a row of its own without one)."""
        detail, rid = event.detail, event.request_id
        slots = dict(zip(detail.get("block_ids") or (), detail.get("slots") or ()))
        change = f"promoted from disk for {rid} (tier slot {slots.get(self.block_id)})"
        last = self.rows[-1] if self.rows else None
        if last is not None and last.event == ALLOCATE and last.request_id == rid:
            last.event, last.change = PROMOTE, f"allocated to {rid}: {change}"
        else:
            self._row(event, change)

    def _tier_store(self, event: StoredEvent) -> None:
        """Name the eviction the tier stored (DEMOTE) or did not (TIER_DROP); a DEMOTE of a block still
        cached (written back by a stopping engine) is a row of its own."""
        detail, kind = event.detail, event.kind
        evicted = self.evicted
        if evicted is not None and evicted[1] is not None and evicted[1] == detail.get("key"):
            (row, _, reason), self.evicted = evicted, None
            row.event, slot, why = kind, detail.get("slot"), detail.get("reason")
            if kind == DEMOTE:
                row.change = f"evicted ({reason}): demoted to disk at step {event.step} (tier slot {slot})"
            else:
                row.change = f"evicted ({reason}): left the prefix index, not stored on disk ({why})"
        elif kind == DEMOTE:
            self._row(event, f"copied to disk (tier slot {detail.get('slot')}): still cached in the pool")

    def _copy_on_write(self, event: StoredEvent) -> None:
        """Name the release (source) or allocation (destination) the copy made just before this event."""
        detail, rid = event.detail, event.request_id
        src, dst, slots = detail.get("src_block"), detail.get("dst_block"), detail.get("num_slots")
        expected = RELEASE if self.block_id == src else ALLOCATE
        last = self.rows[-1] if self.rows else None
        if last is None or last.event != expected or last.request_id != rid:
            self.complete = False
            return
        last.event = COW
        if self.block_id == src:
            last.change = f"copy-on-write: {rid} moved to its copy, block {dst} ({slots} slots copied)"
        else:
            last.change = f"copy-on-write: {rid}'s copy of block {src} ({slots} slots)"

    def _row(self, event: StoredEvent, change: str) -> None:
        count = len(self.holders)
        state = REFERENCED if count else (EVICTABLE if self.cached else FREE)
        previous = self.rows[-1].ref_count if self.rows else 0
        marker = ""
        if count == 0 and previous > 0:
            marker = EVICTABLE_FROM_HERE if self.cached else SAFE_TO_REUSE
        self.rows.append(
            BlockChange(
                event.id, event.step, event.time, event.kind, event.request_id, change, count, tuple(self.holders),
                state, marker, self.life,
            )
        )  # fmt: skip


def replay(events: Iterable[StoredEvent], block_ids: Sequence[int]) -> dict[int, BlockLife]:
    """Every listed block's history from `events` (one group's, in stored order).

    Events about other blocks are ignored, so `events` may be a superset.
    """
    replays = {block_id: _Replay(block_id) for block_id in block_ids}
    for event in events:
        for block_id, state in replays.items():
            if event.touches(block_id):
                state.apply(event)
    return {block_id: BlockLife(block_id, state.rows, state.complete) for block_id, state in replays.items()}


def rows_involving(life: BlockLife, request_ids: Iterable[str]) -> list[BlockChange]:
    """The stretch of a block's history that `request_ids` took part in: from the row before the first
    one that involves them (so the count they found shows) to the row after the last one (where they
    left, the next change shows), other requests' changes in between included.

    A row involves them when one of them made the change or holds the block after it.
    """
    wanted = set(request_ids)
    rows = life.rows
    involved = [i for i, row in enumerate(rows) if row.request_id in wanted or not wanted.isdisjoint(row.holders)]
    if not involved:
        return []
    return rows[max(0, involved[0] - 1) : involved[-1] + 2]
