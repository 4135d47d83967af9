"""Two published policies, written against `analysis.policies.KeyEvictionPolicy`, as peers for the policy
comparison in `benchmarks/analyzer.py` (benchmark code only: the product ships LRU, FIFO, LFU,
reuse-LRU and OPT).

  * ARC (Megiddo and Modha, FAST'03): T1 holds blocks seen once recently, T2 blocks seen at least
    twice; ghost lists B1 and B2 remember recent evictions from each, and a hit in a ghost list moves
    the target size `p` of T1 towards the list that would have hit.
  * S3-FIFO (Yang et al., SOSP'23): a small FIFO (10 % of the capacity) filters blocks used once, a main
    FIFO keeps the rest with a 2-bit use counter (reinserted while the counter is positive), and a
    ghost FIFO of ids sends a block evicted from the small queue straight to the main one on its return.

Both are adapted to held blocks the same way: a held block is never a victim; the scan for a victim
skips held blocks (ARC) or moves them to the queue's new end (S3-FIFO, as the paper does for blocks it
keeps).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from analysis.errors import NoVictimError
from analysis.policies import KeyEvictionPolicy
from engine.core.errors import InvariantError


class ArcPolicy(KeyEvictionPolicy):
    """Adaptive Replacement Cache over the pool contract (recency = release order)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.target_t1 = 0.0  # ARC's p: the size T1 should have
        self.t1: OrderedDict[Hashable, None] = OrderedDict()  # cached, seen once recently, LRU first
        self.t2: OrderedDict[Hashable, None] = OrderedDict()  # cached, seen at least twice, LRU first
        self.b1: OrderedDict[Hashable, None] = OrderedDict()  # evicted from T1, oldest first
        self.b2: OrderedDict[Hashable, None] = OrderedDict()  # evicted from T2, oldest first
        self.held: set[Hashable] = set()

    def insert(self, key: Hashable) -> None:
        if key in self.b1:
            self.target_t1 = min(self.capacity, self.target_t1 + max(len(self.b2) / len(self.b1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.target_t1 = max(0.0, self.target_t1 - max(len(self.b1) / len(self.b2), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        while len(self.t1) + len(self.b1) > self.capacity and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity and self.b2:
            self.b2.popitem(last=False)
        self.held.add(key)

    def touch(self, key: Hashable) -> None:
        self.held.add(key)
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None

    def release(self, key: Hashable) -> None:
        self.held.discard(key)
        (self.t1 if key in self.t1 else self.t2).move_to_end(key)

    def _oldest_evictable(self, queue: OrderedDict) -> Hashable | None:
        return next((key for key in queue if key not in self.held), None)

    def victim(self) -> Hashable:
        from_t1, from_t2 = self._oldest_evictable(self.t1), self._oldest_evictable(self.t2)
        if from_t1 is not None and (len(self.t1) > self.target_t1 or from_t2 is None):
            return from_t1
        if from_t2 is not None:
            return from_t2
        raise NoVictimError("no evictable block")

    def remove(self, key: Hashable) -> None:
        if key in self.held:
            raise ValueError(f"{key!r} is held")
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None

    @property
    def num_evictable(self) -> int:
        return len(self.t1) + len(self.t2) - len(self.held)

    def check_invariants(self) -> None:
        if set(self.t1) & set(self.t2) or not self.held <= set(self.t1) | set(self.t2):
            raise InvariantError("T1 and T2 overlap, or a held block is not cached")


class S3FifoPolicy(KeyEvictionPolicy):
    """S3-FIFO over the pool contract."""

    SMALL_FRACTION = 0.1  # the small queue's share of the capacity
    MAX_FREQUENCY = 3  # the 2-bit use counter's ceiling

    def __init__(self, capacity_blocks: int) -> None:
        self.small_limit = max(1, int(capacity_blocks * self.SMALL_FRACTION))
        self.ghost_limit = max(1, capacity_blocks - self.small_limit)
        self.small: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self.ghost: OrderedDict[Hashable, None] = OrderedDict()  # ids evicted from small, oldest first
        self.frequency: dict[Hashable, int] = {}  # cached key -> uses since insertion, capped
        self.held: set[Hashable] = set()
        self.held_small = 0  # held keys in the small queue (the others are in the main one)

    def _hold(self, key: Hashable, change: int) -> None:
        if key in self.small:
            self.held_small += change

    def insert(self, key: Hashable) -> None:
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self.frequency[key] = 0
        self.held.add(key)
        self._hold(key, 1)

    def touch(self, key: Hashable) -> None:
        self.frequency[key] = min(self.frequency[key] + 1, self.MAX_FREQUENCY)
        if key not in self.held:
            self.held.add(key)
            self._hold(key, 1)

    def release(self, key: Hashable) -> None:
        self.held.remove(key)
        self._hold(key, -1)

    def victim(self) -> Hashable:
        if self.num_evictable == 0:
            raise NoVictimError("no evictable block")
        while True:
            evictable_small = len(self.small) - self.held_small
            evictable_main = len(self.main) - (len(self.held) - self.held_small)
            from_small = evictable_small > 0 and (len(self.small) >= self.small_limit or evictable_main == 0)
            queue = self.small if from_small else self.main
            key = next(iter(queue))
            if key in self.held:
                queue.move_to_end(key)
            elif from_small and self.frequency[key] > 1:
                del self.small[key]
                self.main[key] = None
            elif not from_small and self.frequency[key] > 0:
                self.frequency[key] -= 1
                self.main.move_to_end(key)
            else:
                return key

    def remove(self, key: Hashable) -> None:
        if key in self.held:
            raise ValueError(f"{key!r} is held")
        del self.frequency[key]
        if key in self.small:
            del self.small[key]
            self.ghost[key] = None
            if len(self.ghost) > self.ghost_limit:
                self.ghost.popitem(last=False)
        else:
            del self.main[key]

    @property
    def num_evictable(self) -> int:
        return len(self.frequency) - len(self.held)

    def check_invariants(self) -> None:
        if set(self.small) & set(self.main) or set(self.frequency) != set(self.small) | set(self.main):
            raise InvariantError("the small and main queues overlap or miss a cached block")
        if self.held_small != len(self.held & set(self.small)):
            raise InvariantError("the held count of the small queue is off")
