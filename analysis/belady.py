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
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

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
