"""Belady's offline optimum (OPT): evict the block whose next use lies farthest in the future.

The future is the trace's block sequence: requests in arrival order, each request's blocks in order;
a block's next use is the position of its next reference in that sequence. A block that is never used
again is farther than any other; among those the least recently released goes first (any order would
do: none of them is ever hit again). A request's own blocks are held while it runs, so OPT cannot
bypass the cache (it must make room for every block of the request, like every other policy).

How it knows "now": each reference of the trace reaches the policy exactly once, as `insert` (a miss
it keeps), `touch` (a block already cached) or `bypass` (a block of a request larger than the cache);
each such call consumes the block's next reference. So a block's next use is known whenever it is
released, and it cannot change while the block stays evictable (the next reference is what would
touch it).

Optimality: OPT minimises block misses (blocks of a request not cached when it arrives). In a trace
where every id always follows the same parent (both Mooncake traces; any trace of prefix hashes), a
block's parent is used no later than the block itself, so OPT never keeps a block whose parent it
evicted: every cached block a request finds is a leading block, and OPT maximises the leading-block
hits the analyzer reports (a brute force over every eviction choice agrees, in the tests). With full
blocks that is also the token optimum; a partial last block weighs fewer tokens than it counts, so
there OPT is optimal in blocks, not always in tokens. In a trace whose ids change parents, a cached
block can sit behind a missing one, and an online policy can beat OPT (tests pin both examples).

Invariants (checked by `check_invariants`): every evictable block is in exactly one of `_never_again`
(next use NEVER) and `_by_next_use` (priority -next use); no block consumed more references than the
trace has for it.

`BeladyCache` is the same cache (a `SequentialCache` under a `BeladyPolicy`, rule for rule and victim for
victim) in one loop over each request, for the analyzer: it reads each reference's next use from a table
made once per trace (`next_uses`) instead of counting references, and drops a block from the eviction
order by forgetting its current priority instead of deleting its heap entry. The planner's twelve OPT
points on the 223-request sample at block size 16 (152,146 references) take 0.4-0.5 s of CPU this way,
1.7 s through the policy object.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from analysis.errors import NoVictimError
from analysis.keyed_heap import KeyedHeap
from analysis.policies import KeyEvictionPolicy
from engine.core.errors import InvariantError

NEVER = -1  # internal marker in `_next_use`: no further reference (never stored outside this class)


class BeladyPolicy(KeyEvictionPolicy):
    """OPT over dense block ids `0..num_blocks-1` of a fixed reference sequence."""

    def __init__(self, references: np.ndarray, num_blocks: int) -> None:
        """Args:
        references: the trace's dense block ids, request after request (`Trace.dense.ids`).
        num_blocks: how many distinct ids there are (`Trace.unique_blocks`).
        """
        order = np.argsort(references, kind="stable")  # positions grouped by block, ascending
        counts = np.bincount(references, minlength=num_blocks)
        self._positions = array("q", order.astype(np.int64).tobytes())  # block b's references, in order
        self._first = array("q", (np.cumsum(counts) - counts).astype(np.int64).tobytes())  # b's in _positions
        self._counts = array("q", counts.astype(np.int64).tobytes())  # references of b in the trace
        self._consumed = array("q", bytes(8 * num_blocks))  # references of b seen so far
        self._next_use = array("q", bytes(8 * num_blocks))  # b's next reference after its last consumed one
        self._never_again: OrderedDict[int, None] = OrderedDict()  # evictable, never used again, by release
        self._by_next_use = KeyedHeap()  # the other evictable blocks, by -next use (farthest first)

    def _consume(self, block: int) -> None:
        seen = self._consumed[block] + 1
        if seen > self._counts[block]:
            raise InvariantError(f"block {block} was used more often than the trace uses it")
        self._consumed[block] = seen
        self._next_use[block] = NEVER if seen == self._counts[block] else self._positions[self._first[block] + seen]

    def insert(self, key: int) -> None:
        self._consume(key)

    def touch(self, key: int) -> None:
        if key in self._never_again:
            raise InvariantError(f"block {key} was touched after its last use")
        self._by_next_use.discard(key)
        self._consume(key)

    def bypass(self, key: int) -> None:
        self._consume(key)

    def release(self, key: int) -> None:
        next_use = self._next_use[key]
        if next_use == NEVER:
            if key in self._never_again:
                raise ValueError(f"{key!r} is already evictable")
            self._never_again[key] = None
        else:
            self._by_next_use.push(key, -next_use)

    def victim(self) -> int:
        if self._never_again:
            return next(iter(self._never_again))
        if not self._by_next_use:
            raise NoVictimError("no evictable block")
        return self._by_next_use.peek()

    def remove(self, key: int) -> None:
        if key in self._never_again:
            del self._never_again[key]
        elif key in self._by_next_use:
            self._by_next_use.remove(key)
        else:
            raise ValueError(f"{key!r} is not evictable")

    @property
    def num_evictable(self) -> int:
        return len(self._never_again) + len(self._by_next_use)

    def check_invariants(self) -> None:
        self._by_next_use.check_invariants()
        if any(key in self._by_next_use for key in self._never_again):
            raise InvariantError("a block is both never used again and waiting for a next use")
        if any(self._next_use[key] != NEVER for key in self._never_again):
            raise InvariantError("a block with a next use is filed as never used again")
        if any(consumed > count for consumed, count in zip(self._consumed, self._counts)):
            raise InvariantError("a block consumed more references than the trace has")


def next_uses(references: np.ndarray) -> np.ndarray:
    """int64 per position of `references`: the position of the same id's next reference, or -1 (never)."""
    following = np.full(len(references), NEVER, dtype=np.int64)
    order = np.argsort(references, kind="stable")  # positions grouped by id, ascending within each
    same = references[order[1:]] == references[order[:-1]]
    following[order[:-1][same]] = order[1:][same]
    return following


class BeladyCache:
    """A sequential cache of `capacity_blocks` blocks under OPT, serving the trace's requests in order.

    It serves exactly what `SequentialCache(capacity_blocks, BeladyPolicy(...))` serves, with the same hits
    and the same victims in the same order (the tests compare them), so the module docstring's rule and
    analysis.sequential's request rule hold. Its eviction order has two parts, as BeladyPolicy's:
        * blocks never used again, in release order: a list read from `_never_head` on (victims first);
        * the others, in a heap of their priorities, -next use: a next use is a position of the trace, so
          it names its block (`references[position]`), and no two releases share one. A block's current
          priority is in `_priority`; an entry that is no longer its block's is stale, skipped when popped.
    Each release adds one entry to one of them, so together they hold at most one entry per reference.

    Invariants (checked by `check_invariants`, between requests): at most `capacity_blocks` blocks are
    cached; a block is cached exactly when `_priority` holds a priority for it (not `_ABSENT`): `_NEVER`
    for a block in the never-again list, else -next use, with a heap entry of it.
    """

    _ABSENT = np.iinfo(np.int64).max  # `_priority` of a block not cached
    _NEVER = np.iinfo(np.int64).max - 1  # `_priority` of a cached block never used again

    def __init__(
        self, references: np.ndarray, num_blocks: int, capacity_blocks: int, *, record_evictions: bool = False
    ) -> None:
        """Args:
        references: the trace's dense block ids, request after request (`Trace.dense.ids`).
        num_blocks: how many distinct ids there are (`Trace.unique_blocks`).
        capacity_blocks: the cache's size in blocks (>= 0).
        record_evictions: keep the victims, in order, in `evictions`.
        """
        if capacity_blocks < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.evictions: list[int] | None = [] if record_evictions else None  # victims in order, if recorded
        self._references = np.asarray(references, dtype=np.int64)
        self._reference_list = self._references.tolist()  # to check what `serve` is given
        self._next_use = next_uses(self._references)
        self._position = 0  # the position of the next request's first reference
        self._priority = np.full(num_blocks, self._ABSENT, dtype=np.int64)
        self._heap: list[int] = []  # -next use of the blocks released with one, stale entries included
        self._never: list[int] = []  # blocks never used again, in release order; victims from _never_head
        self._never_head = 0
        self._num_cached = 0

    def __len__(self) -> int:
        return self._num_cached

    def serve(self, blocks: Sequence[int]) -> int:
        """Run the trace's next request (its distinct block ids); return how many of its leading blocks
        were cached.

        Raises:
            ValueError: `blocks` is not the trace's next request.
        """
        start, count = self._position, len(blocks)
        if self._reference_list[start : start + count] != list(blocks):
            raise ValueError(f"the request at reference {start} is not the trace's next one")
        self._position = start + count
        priority = self._priority
        request = self._references[start : start + count]
        cached = priority[request] != self._ABSENT
        hit = count if cached.all() else int(np.argmin(cached))
        num_kept = min(count, self.capacity_blocks)
        kept = request[:num_kept]
        missing = num_kept - int(cached[:num_kept].sum())
        priority[kept] = self._ABSENT  # its cached blocks are its own while it runs: out of the eviction order
        excess = self._num_cached + missing - self.capacity_blocks  # (the blocks it holds count as cached)
        if excess > 0:
            self._evict(excess)
        self._num_cached += missing
        following = self._next_use[start : start + num_kept]
        never = following == NEVER
        last_uses = kept[never][::-1]  # released tail first: the tail is the least recently released
        priority[last_uses] = self._NEVER
        self._never.extend(last_uses.tolist())
        again = kept[~never]
        values = -following[~never]
        priority[again] = values
        heap = self._heap
        if len(values) * 8 > len(heap):  # many at once: one heapify (linear, in C) beats a push each
            heap.extend(values.tolist())
            heapq.heapify(heap)
        else:
            push = heapq.heappush
            for value in values.tolist():
                push(heap, value)
        return hit

    def _evict(self, count: int) -> None:
        """Evict `count` cached blocks that are not the running request's, in OPT's order."""
        priority, evictions = self._priority, self.evictions
        head = self._never_head
        taken = self._never[head : head + count]
        if taken:
            self._never_head = head + len(taken)
            priority[taken] = self._ABSENT
            if evictions is not None:
                evictions.extend(taken)
            if self._never_head > len(self._never) // 2:  # drop the evicted prefix: the list stays bounded
                del self._never[: self._never_head]
                self._never_head = 0
        left = count - len(taken)
        heap, references = self._heap, self._reference_list
        while left > 0:
            if not heap:
                raise NoVictimError("no evictable block")
            value = heapq.heappop(heap)
            victim = references[-value]
            if priority[victim] != value:
                continue  # stale: the block was used or evicted since
            priority[victim] = self._ABSENT
            left -= 1
            if evictions is not None:
                evictions.append(victim)
        self._num_cached -= count

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless the class invariants hold (call between requests)."""
        cached = np.flatnonzero(self._priority != self._ABSENT).tolist()
        if len(cached) != self._num_cached or self._num_cached > self.capacity_blocks:
            raise InvariantError(f"{len(cached)} blocks cached, counted {self._num_cached}, of {self.capacity_blocks}")
        never = set(self._never[self._never_head :])
        entries = set(self._heap)
        for block in cached:
            value = int(self._priority[block])
            if (block in never) != (value == self._NEVER) or (value != self._NEVER and value not in entries):
                raise InvariantError(f"block {block} is cached with priority {value} but not filed so")
