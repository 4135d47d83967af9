"""What the console sees of the disk tier (engine/core/kv_tier.py): the blocks it holds, newest first, and
the pool blocks a promotion filled. Bounded, immutable, part of the engine's snapshot (`EngineSnapshot.tier`).

Pure Python: no torch, no I/O.

`PromotionMarks` follows the engine's events (fed each step on the engine thread, under the engine's lock)
and keeps, per pool block of the full-attention group (the only group the tier serves), the promotion
that filled it in its current life:

    PROMOTE names the block (block_ids, keys, slots)        -> marked: promoted at that step, from that slot
    ALLOCATE hands the block out (full group)               -> unmarked: a new life begins
    EVICT drops the block's key (full group)                -> unmarked: it holds nothing it was promoted with
    TIER_EVICT reason corrupt, under the block's mark key   -> unmarked: the bytes failed their checksum, the
                                                               block is recomputed, never served from disk

Invariants: at most one mark per pool block id (so the marks are bounded by the pool's size); a mark's key
is the chain key the tier held the block under; a block is marked only between its PROMOTE and the next
event that ends that life. A promoted block its request freed before caching it (a release that no EVICT
names) keeps its mark until it is handed out again, so `tier_view` lists only the marked blocks that are
not free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, NamedTuple

from engine.core.events import Event, EventKind, TierReason
from engine.core.pool_invariants import BlockState, block_state

if TYPE_CHECKING:
    from engine.core.kv_coordinator import KVCoordinator

MAX_TIER_BLOCKS = 512  # tier blocks a snapshot lists (the most recently used); the counts cover all of them
FIRST_TOKENS = 8  # token ids a listed tier block shows
KEY_HEX = 16  # hex digits of a listed key (the first 64 bits of 128: enough to tell blocks apart by eye)


class TierBlockView(NamedTuple):
    """One ready block of the disk tier."""

    key: str  # the first KEY_HEX hex digits of its chain key
    slot: int  # where its bytes are in the tier's files
    stamp: int  # store order: a higher stamp was stored later (kept across restarts)
    first_token_ids: tuple[int, ...]  # its first FIRST_TOKENS token ids


class PromotedBlock(NamedTuple):
    """A pool block (full group) whose K/V were read from the disk tier in its current life."""

    block_id: int
    step: int  # the engine step that promoted it
    slot: int  # the tier slot it was read from
    key: str  # the first KEY_HEX hex digits of the chain key it was read under


class TierView(NamedTuple):
    """The disk tier's contents as of one snapshot (its counters: `PoolStats.tier`)."""

    blocks: tuple[TierBlockView, ...]  # ready blocks, most recently used first, at most MAX_TIER_BLOCKS
    group: str  # the KV group whose pool the tier promotes into (the full-attention group's)
    promoted: tuple[PromotedBlock, ...]  # that pool's blocks promoted in their current life, by block id


class PromotionMarks:
    """The pool blocks promoted from the tier in their current life (see the module docstring)."""

    def __init__(self, group: str) -> None:
        """`group`: the name of the pool the tier promotes into (the full-attention group's)."""
        self.group = group
        self._marks: dict[int, PromotedBlock] = {}  # pool block id -> its promotion

    @staticmethod
    def of(kv: KVCoordinator) -> PromotionMarks | None:
        """Marks for `kv`'s disk tier (promoting into its full-attention pool); None without a tier."""
        if kv.tier is None or kv.full is None:
            return None
        return PromotionMarks(kv.full.pool.group)

    def on_events(self, events: Iterable[Event]) -> None:
        """Follow one step's events, oldest first."""
        marks = self._marks
        for event in events:
            kind = event.kind
            if kind is EventKind.PROMOTE:
                detail = event.detail
                for block_id, key, slot in zip(detail["block_ids"], detail["keys"], detail["slots"]):
                    marks[block_id] = PromotedBlock(block_id, event.step, slot, key[:KEY_HEX])
            elif kind is EventKind.ALLOCATE and marks and event.detail.get("group") == self.group:
                for block_id in event.detail["block_ids"]:
                    marks.pop(block_id, None)
            elif kind is EventKind.EVICT and marks and event.detail.get("group") == self.group:
                marks.pop(event.block_id, None)
            elif kind is EventKind.TIER_EVICT and marks and event.detail.get("reason") == TierReason.CORRUPT.value:
                key = event.detail["key"][:KEY_HEX]
                for block_id in [b for b, mark in marks.items() if mark.key == key]:
                    del marks[block_id]

    def marks(self) -> tuple[PromotedBlock, ...]:
        """The marked blocks, by block id."""
        return tuple(self._marks[b] for b in sorted(self._marks))


def tier_view(kv: KVCoordinator, marks: PromotionMarks | None, limit: int = MAX_TIER_BLOCKS) -> TierView | None:
    """`kv`'s disk tier as of now: its `limit` most recently used ready blocks and the marked pool blocks
    that hold something (a promoted block its request freed before caching it, which no EVICT names, is
    free and not listed); None without a tier."""
    tier, full = kv.tier, kv.full
    if tier is None or full is None or marks is None:
        return None
    blocks = tuple(
        TierBlockView(entry.key.hex()[:KEY_HEX], entry.slot, entry.stamp, tuple(entry.token_ids[:FIRST_TOKENS]))
        for entry in tier.entries(limit)
    )
    blocks_of = full.pool.blocks
    held = tuple(m for m in marks.marks() if block_state(blocks_of[m.block_id]) is not BlockState.FREE)
    return TierView(blocks, marks.group, held)
