"""Eviction policies: the order in which a cache gives up its evictable blocks.

A policy never owns blocks. The cache that does (the sequential simulator here; the engine's block pool
later) tells it what happens to each cached key, and asks it which key to evict:

    what happens in the cache                              policy call
    a block enters the cache, held by its request          insert(key)
    a cached block is reused (whether held or evictable)   touch(key)          -> held
    the last holder of a block lets go                     release(key)        -> evictable
    room is needed                                         victim(), then remove(victim)
    an evictable block leaves the cache for another reason remove(key)
    a request refers to a block the cache does not keep    bypass(key)         (the offline optimum's clock)

Keys are hashable and name cached content: the analyzer passes dense block ids, a block pool would pass
its chain keys (so a policy's memory of evicted keys means the same content coming back). The cache
keeps the reference counts: `release` comes once, when a key's last holder lets go. A key is *cached*
from `insert` to `remove`, and while cached it is *held* (after insert or touch) or *evictable* (after
release). Only evictable keys are victims; `victim()` is a check (it changes nothing), `remove` the
commit. Misuse a policy can see cheaply (releasing an evictable key, removing one that is not
evictable) raises `ValueError`.

Policies, each O(1) or O(log n) per call:
  * LRU: least recently released first (the engine's free-queue order).
  * FIFO: first inserted first; reuse does not move a block.
  * LFU: fewest uses since the block entered the cache (insert is one use, each touch one more), ties
    to the least recently released; a block's count is forgotten when it is evicted.
  * reuse-LRU: LRU in which every reuse a block has had (up to `max_tier`) buys it `credit_per_reuse`
    capacities' worth of releases more before it is due, and the reuse count of an evicted block is
    remembered for a while, so a block that comes back keeps its standing. See `ReuseLruPolicy`.
  * OPT (Belady, offline) lives in `analysis.belady`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from enum import Enum

from analysis.errors import NoVictimError
from analysis.keyed_heap import KeyedHeap
from engine.errors import InvariantError


class Policy(Enum):
    """An eviction policy, by the name the CLI and the report use."""

    LRU = "lru"
    FIFO = "fifo"
    LFU = "lfu"
    REUSE_LRU = "reuse-lru"
    OPT = "opt"  # Belady's offline optimum: knows the future, so it is a bound, not a deployable policy

    @property
    def online(self) -> bool:
        """Whether it decides from the past only (every policy but OPT)."""
        return self is not Policy.OPT


class EvictionPolicy(ABC):
    """The contract every policy meets (see the module docstring)."""

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """`key` entered the cache; it is held."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """Cached `key` was reused; it is held (if it was evictable, it no longer is)."""

    @abstractmethod
    def release(self, key: Hashable) -> None:
        """The last holder of cached `key` let go; it is evictable."""

    @abstractmethod
    def victim(self) -> Hashable:
        """The evictable key to evict next; changes nothing.

        Raises:
            NoVictimError: no key is evictable (check `can_evict()` first).
        """

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Evictable `key` leaves the cache (the victim, or any other evictable key)."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """How many cached keys are evictable."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise `InvariantError` unless the policy's own invariants hold."""

    def can_evict(self) -> bool:
        """Whether `victim()` has a key to return."""
        return self.num_evictable > 0

    def bypass(self, key: Hashable) -> None:
        """A request referred to `key`, but the cache keeps none of it (the tail of a request larger
        than the cache). Online policies ignore it; the offline optimum counts it as a use."""


class LruPolicy(EvictionPolicy):
    """Least recently released first.

    Invariant: `_queue` holds exactly the evictable keys, least recently released first.
    """

    def __init__(self) -> None:
        self._queue: OrderedDict[Hashable, None] = OrderedDict()  # evictable keys, in release order

    def insert(self, key: Hashable) -> None:
        pass  # a held key has no place in the order until it is released

    def touch(self, key: Hashable) -> None:
        self._queue.pop(key, None)

    def release(self, key: Hashable) -> None:
        if key in self._queue:
            raise ValueError(f"{key!r} is already evictable")
        self._queue[key] = None

    def victim(self) -> Hashable:
        if not self._queue:
            raise NoVictimError("no evictable block")
        return next(iter(self._queue))

    def remove(self, key: Hashable) -> None:
        try:
            del self._queue[key]
        except KeyError:
            raise ValueError(f"{key!r} is not evictable") from None

    @property
    def num_evictable(self) -> int:
        return len(self._queue)

    def check_invariants(self) -> None:
        pass  # the queue is the whole state


class FifoPolicy(EvictionPolicy):
    """First inserted first: a block's place is fixed when it enters the cache.

    Invariants: `_inserted` holds every cached key with a distinct insertion number; the evictable keys
    are exactly the keys of `_evictable`, each with its insertion number as its priority.
    """

    def __init__(self) -> None:
        self._inserted: dict[Hashable, int] = {}  # cached key -> insertion number
        self._evictable = KeyedHeap()  # evictable keys by insertion number
        self._inserts = 0  # insertion numbers handed out

    def insert(self, key: Hashable) -> None:
        if key in self._inserted:
            raise ValueError(f"{key!r} is already cached")
        self._inserts += 1
        self._inserted[key] = self._inserts

    def touch(self, key: Hashable) -> None:
        self._evictable.discard(key)

    def release(self, key: Hashable) -> None:
        self._evictable.push(key, self._inserted[key])

    def victim(self) -> Hashable:
        if not self._evictable:
            raise NoVictimError("no evictable block")
        return self._evictable.peek()

    def remove(self, key: Hashable) -> None:
        if key not in self._evictable:
            raise ValueError(f"{key!r} is not evictable")
        self._evictable.remove(key)
        del self._inserted[key]

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def check_invariants(self) -> None:
        self._evictable.check_invariants()
        if not all(key in self._inserted for key in self._evictable):
            raise InvariantError("an evictable key is not cached")
        if len(set(self._inserted.values())) != len(self._inserted):
            raise InvariantError("two cached keys share an insertion number")


class LfuPolicy(EvictionPolicy):
    """Fewest uses first, ties to the least recently released.

    Uses count from the block's insertion (one) plus one per touch; eviction forgets them. The heap
    breaks equal priorities by push order, and a key is pushed when released, so ties go to the least
    recently released.

    Invariants: `_uses` holds every cached key with a count >= 1; the evictable keys are exactly the keys
    of `_evictable`, each with its use count as its priority.
    """

    def __init__(self) -> None:
        self._uses: dict[Hashable, int] = {}  # cached key -> uses since it entered the cache
        self._evictable = KeyedHeap()  # evictable keys by uses, then release order

    def insert(self, key: Hashable) -> None:
        if key in self._uses:
            raise ValueError(f"{key!r} is already cached")
        self._uses[key] = 1

    def touch(self, key: Hashable) -> None:
        self._evictable.discard(key)
        self._uses[key] += 1

    def release(self, key: Hashable) -> None:
        self._evictable.push(key, self._uses[key])

    def victim(self) -> Hashable:
        if not self._evictable:
            raise NoVictimError("no evictable block")
        return self._evictable.peek()

    def remove(self, key: Hashable) -> None:
        if key not in self._evictable:
            raise ValueError(f"{key!r} is not evictable")
        self._evictable.remove(key)
        del self._uses[key]

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def check_invariants(self) -> None:
        self._evictable.check_invariants()
        if not all(key in self._uses for key in self._evictable):
            raise InvariantError("an evictable key is not cached")
        if any(uses < 1 for uses in self._uses.values()):
            raise InvariantError("a cached key has no use")


class ReuseLruPolicy(EvictionPolicy):
    """LRU that gives blocks which have been reused more time before they are evicted.

    A key's *uses* are its insertion plus its touches, plus the uses it had when it was last evicted if
    it is still in the history of recently evicted keys. Its *tier* is `min(uses - 1, max_tier)`: how
    many reuses it has had, capped. When released it is stamped with the release count; it is *due* at

        due = release number + tier * credit,      credit = credit_per_reuse * capacity_blocks

    and the victim is the evictable key due first (ties: lower tier). A block reused twice is treated as
    if it had been released `2 * credit` releases later than it was.

    Why: on prefix-cache traffic most blocks are used once (76 % of the Mooncake conversation trace's
    blocks, 58 % of the synthetic's), while a block that has been reused is reused again far more often
    (conversation: 24 % of first-seen blocks are ever reused, 42 % of blocks used twice, 50 % of those
    used three times; synthetic: 42 % and 84 %). LRU gives a block used once the same life as one used
    five times, so a small cache is mostly full of blocks that will never be hit, and conversations'
    reused prefixes are evicted before their next turn arrives (typically minutes later). The credit
    keeps reused prefixes through that gap at the cost of evicting single-use blocks sooner; the history
    lets a prefix evicted before its second reuse regain its tier when it comes back.

    Each tier is an LRU queue, whose keys are due in release order, so the victim is the first due of
    the `max_tier + 1` queue heads: every call is O(max_tier), i.e. O(1). Within a request (released
    tail first, its first block last) a chain's tail is due before its head, since the head has had at
    least as many uses and was released later.

    Invariants (checked by `check_invariants`):
      * `_uses` holds every cached key, with uses >= 1;
      * the tier queues are disjoint and hold exactly the evictable keys, each in the queue of its tier,
        in increasing release number;
      * `_history` holds at most `history_limit` keys, none of them cached.
    """

    def __init__(
        self, capacity_blocks: int, *, credit_per_reuse: float = 2.0, max_tier: int = 2, history_per_block: int = 4
    ) -> None:
        """Args:
        capacity_blocks: the cache's size in blocks (the credit and the history scale with it).
        credit_per_reuse: releases of extra life per reuse, in units of the capacity.
        max_tier: reuses that count (a key reused more often gets no more credit).
        history_per_block: evicted keys remembered, per block of capacity.
        """
        if capacity_blocks < 0 or credit_per_reuse < 0 or max_tier < 0 or history_per_block < 0:
            raise ValueError("capacity, credit, tiers and history must be >= 0")
        self.credit = credit_per_reuse * capacity_blocks  # releases of extra life per tier
        self.max_tier = max_tier
        self.history_limit = history_per_block * capacity_blocks  # evicted keys remembered, at most
        self._uses: dict[Hashable, int] = {}  # cached key -> uses (see the class docstring)
        # Evictable keys of tier t, least recently released first -> their release number.
        self._tiers: list[OrderedDict[Hashable, int]] = [OrderedDict() for _ in range(max_tier + 1)]
        self._history: OrderedDict[Hashable, int] = OrderedDict()  # evicted key -> its uses, oldest first
        self._releases = 0  # release numbers handed out

    def _tier(self, uses: int) -> int:
        return min(uses - 1, self.max_tier)

    def insert(self, key: Hashable) -> None:
        if key in self._uses:
            raise ValueError(f"{key!r} is already cached")
        self._uses[key] = self._history.pop(key, 0) + 1

    def touch(self, key: Hashable) -> None:
        uses = self._uses[key]
        self._tiers[self._tier(uses)].pop(key, None)
        self._uses[key] = uses + 1

    def release(self, key: Hashable) -> None:
        queue = self._tiers[self._tier(self._uses[key])]
        if key in queue:
            raise ValueError(f"{key!r} is already evictable")
        self._releases += 1
        queue[key] = self._releases

    def victim(self) -> Hashable:
        best_key, best_due = None, None
        for tier, queue in enumerate(self._tiers):
            if queue:
                key, released = next(iter(queue.items()))
                due = released + tier * self.credit
                if best_due is None or due < best_due:
                    best_key, best_due = key, due
        if best_due is None:
            raise NoVictimError("no evictable block")
        return best_key

    def remove(self, key: Hashable) -> None:
        uses = self._uses.get(key)
        queue = None if uses is None else self._tiers[self._tier(uses)]
        if queue is None or key not in queue:
            raise ValueError(f"{key!r} is not evictable")
        del queue[key]
        del self._uses[key]
        if self.history_limit:
            self._history[key] = uses
            if len(self._history) > self.history_limit:
                self._history.popitem(last=False)

    @property
    def num_evictable(self) -> int:
        return sum(len(queue) for queue in self._tiers)

    def check_invariants(self) -> None:
        if any(uses < 1 for uses in self._uses.values()):
            raise InvariantError("a cached key has no use")
        seen: set[Hashable] = set()
        for tier, queue in enumerate(self._tiers):
            releases = list(queue.values())
            if releases != sorted(releases):
                raise InvariantError(f"tier {tier} is not in release order")
            for key in queue:
                if key in seen or key not in self._uses or self._tier(self._uses[key]) != tier:
                    raise InvariantError(f"{key!r} is in tier {tier} but not of it, or in two tiers")
                seen.add(key)
        if len(self._history) > self.history_limit or any(key in self._uses for key in self._history):
            raise InvariantError("the history is over its limit or holds a cached key")
