"""The one event type that flows out of the engine.

The KV cache manager and the engine append events as state changes; the engine drains them once per step
and hands them to whoever listens (the storage writer, the console). Events are immutable values.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Callable, NamedTuple


class EventKind(enum.StrEnum):
    """What happened. Block-level kinds carry a block id; request-level kinds carry a request id."""

    ALLOCATE = "allocate"  # a free or evicted block was handed to a request
    HIT = "hit"  # a request reused cached blocks from the prefix index (tokens = hit length)
    FORK = "fork"  # a child shares its parent's block table (tokens = shared tokens)
    COW = "cow"  # copy-on-write: a shared partial block was copied before a write
    CACHE = "cache"  # a full block got its key and entered the prefix index
    RELEASE = "release"  # a request dropped its reference to a block
    EVICT = "evict"  # a cached block lost its key (reason in detail)
    RESET = "reset"  # the prefix cache was reset (detail says how many blocks were dropped)
    SUBMIT = "submit"  # a request entered the waiting queue
    SCHEDULE = "schedule"  # a request got its first step (detail: cached/computed tokens)
    PREEMPT = "preempt"  # a running request lost its blocks and went back to waiting (or a waiting fork child)
    REJECT = "reject"  # a request was refused (detail: reason)
    FINISH = "finish"  # a request finished (detail: reason, output length)
    REPLAY = "replay"  # sliding-window state was recomputed on a hit (detail: h, s, e, r, mode)
    WINDOW_RELEASE = "window_release"  # sliding-layer blocks outside the window were released
    DEMOTE = "demote"  # an evicted cached block's K/V go to the disk tier (its store is planned)
    PROMOTE = "promote"  # disk-tier blocks are read into a request's fresh pool blocks (a hit from disk)
    TIER_EVICT = "tier_evict"  # the disk tier gave up a block it held (reason in detail)
    TIER_DROP = "tier_drop"  # an evicted block the disk tier did not take (reason in detail): plain eviction


class EvictReason(enum.StrEnum):
    """Why a cached block lost its key."""

    # The allocator needed a block and this was the eviction policy's victim; the reason is the policy's
    # name (engine/core/eviction.py's EvictionPolicyName), so every pool policy has one here.
    LRU = "lru"  # least recently released first
    REUSE_LRU = "reuse-lru"  # LRU with extra life for reused blocks
    RESET = "reset"  # an operator reset the prefix cache
    PARENT_EVICTED = "parent_evicted"  # its chain parent left the index, so its key can never match
    WINDOW = "window"  # sliding-layer state dropped outside the retained window


class TierReason(enum.StrEnum):
    """Why the disk tier gave up a block (TIER_EVICT) or did not take one (TIER_DROP)."""

    LRU = "lru"  # TIER_EVICT: the least recently used block made room for a newer store
    CORRUPT = "corrupt"  # TIER_EVICT: its bytes failed their checksum on a load (recomputed, never served)
    FULL = "full"  # TIER_DROP: every slot was being written or pinned by a planned load
    WRITER = "writer"  # TIER_DROP: the writer's queue was full or the write failed


class Event(NamedTuple):
    """One state change (an immutable tuple: cheap to build on the hot path, safe to share across threads).

    Attributes:
        kind: what happened.
        step: engine step counter when it happened (0 before the first step).
        time: wall-clock seconds since the epoch.
        request_id: the request involved, if any.
        block_id: the physical block involved, if any (the first one for multi-block events).
        tokens: how many tokens the change covers (block fill, hit length, shared tokens, ...).
        detail: kind-specific values (JSON-serialisable: str, int, float, bool, None, lists, dicts).
    """

    kind: EventKind
    step: int
    time: float
    request_id: str | None
    block_id: int | None
    tokens: int
    detail: dict[str, Any]


# Detail fields by kind (the storage layer relies on these names):
#   EVICT:  reason (EvictReason value), key (hex str), start_pos, end_pos (token positions [start, end)),
#           age_s (seconds since the block was filled), hit_count, last_used (epoch s), group.
#   ALLOCATE: block_ids (every block handed out by one call, in table order), group.
#   RELEASE: block_ids (in release order: last table entry first), freed (how many reached ref 0), group.
#   CACHE:  block_ids, keys (hex, one per block), parent_keys (hex, one per block; None under the namespace
#           root), token_ids (the blocks' tokens back to back), start_pos (first block), end_pos (last
#           block's end), group.
#   HIT:    cached_tokens, num_blocks, block_ids (the blocks shared, in table order), group; in_flight_from
#           (the request whose chunk computes them in the same step) for an in-flight hit.
#   FORK:   parent_id, shared_blocks, block_ids (the parent's blocks the child now shares, in table order), group.
#   COW:    src_block, dst_block, num_slots, group.
#   RESET:  dropped_blocks, ok (bool: False when referenced blocks kept it from being complete), kept_blocks.
#   SCHEDULE: cached_tokens, computed_tokens, hit_source (and in_flight_from, as HIT's).
#   PREEMPT: num_computed_tokens (and waiting: true for a waiting fork child that gave its parent's blocks
#           back; after_failure_of: the request whose failed chunk computed blocks it read in the same step).
#   REJECT: reason.   FINISH: reason ("length" | "eos" | "stop"), output_tokens.
#   SUBMIT: parent_id, salt, prompt_token_ids (the context before generation, a fork's inherited part too).
#   REPLAY: h, s, e, r, mode (ReplayMode value), replayed_tokens; a verification adds verified and the
#           Divergence fields (engine/runner/verify.py).
#   WINDOW_RELEASE: num_blocks, block_ids, group.
#   DEMOTE: key (hex), parent_key (hex), slot (the tier slot), token_ids (the block's); block_id is the pool block it leaves,
#           tokens the block size.
#   PROMOTE: block_ids (the request's fresh pool blocks, in table order), keys (hex, one per block), slots;
#           request_id is the request, tokens the promoted tokens. (The blocks' ALLOCATE counted them.)
#   TIER_EVICT: key (hex), slot, reason (TierReason: lru | corrupt) (the block's DEMOTE under the same key
#           says when it was stored).
#   TIER_DROP: key (hex), reason (TierReason: full | writer); block_id the pool block (full) or None.
#   SCHEDULE also carries disk_cached_tokens: of cached_tokens, those promoted from the disk tier.
#
# Every change of a block's reference count is named by exactly one event's block_ids: ALLOCATE sets it
# to 1, HIT and FORK add one, RELEASE drops one (a COW is the ALLOCATE of its copy and the RELEASE of
# its source, which it names). storage/read/block_history.py rebuilds a block's life from these alone;
# tests/test_block_history.py replays the pools' own events against their counts.


class EventLog:
    """An append-only buffer of events, stamped with the engine step and wall-clock time.

    The block pool, the KV cache manager and the engine all append to one log; the engine drains it
    once per step with `take()`. Appending never blocks and never does I/O.

    A log made with `recording=False` keeps nothing, and the block pool skips building the events it
    would emit per block (ALLOCATE, RELEASE, EVICT): for replays that only count hits (the workload
    analyzer), where building those events was most of the pool's time.
    """

    def __init__(self, clock: Callable[[], float] = time.time, *, recording: bool = True) -> None:
        self.step = 0  # the engine step counter: the engine advances it at the start of every step
        self.clock = clock  # the time source of events and of the block pool's stamps
        self.recording = recording  # False: emit keeps nothing (see the class docstring)
        self._events: list[Event] = []

    def emit(
        self,
        kind: EventKind,
        detail: dict[str, Any],
        *,
        request_id: str | None = None,
        block_id: int | None = None,
        tokens: int = 0,
        at: float | None = None,
    ) -> None:
        """Append one event. `detail` holds the kind's fields (see the table above); the log keeps it.
        `at` is the event's time when the caller has just read `clock` for the same change (so a block's
        stamp and its event agree)."""
        if not self.recording:
            return
        now = self.clock() if at is None else at
        self._events.append(Event(kind, self.step, now, request_id, block_id, tokens, detail))

    def take(self) -> list[Event]:
        """Return every event appended since the last call, oldest first, and forget them."""
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)
