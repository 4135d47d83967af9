"""Eviction policies of the simulator: the order in which a cache gives up its evictable blocks.

The policies the engine ships (LRU, reuse-LRU) live in engine/core/eviction.py and run through the engine's
own block pool (analysis/pool_replay.py); this module holds the ones only the analyzer simulates (FIFO,
LFU; OPT in analysis/belady.py), and the contract the sequential simulator drives them by.

A policy never owns blocks. The cache that does (the sequential simulator) tells it what happens to
each cached key, and asks it which key to evict:

    what happens in the cache                              policy call
    a block enters the cache, held by its request          insert(key)
    a cached block is reused (whether held or evictable)   touch(key)          -> held
    the last holder of a block lets go                     release(key)        -> evictable
    room is needed                                         victim(), then remove(victim)
    an evictable block leaves the cache for another reason remove(key)
    a request refers to a block the cache does not keep    bypass(key)         (the offline optimum's clock)

Keys are hashable and name cached content (the analyzer passes dense block ids). The cache
keeps the reference counts: `release` comes once, when a key's last holder lets go. A key is *cached*
from `insert` to `remove`, and while cached it is *held* (after insert or touch) or *evictable* (after
release). Only evictable keys are victims; `victim()` is a check (it changes nothing), `remove` the
commit. Misuse a policy can see cheaply (releasing an evictable key, removing one that is not
evictable) raises `ValueError`.

Policies, each O(log n) per call:
  * FIFO: first inserted first; reuse does not move a block.
  * LFU: fewest uses since the block entered the cache (insert is one use, each touch one more), ties
    to the least recently released; a block's count is forgotten when it is evicted.
  * OPT (Belady, offline) lives in `analysis.belady`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from enum import Enum

from analysis.errors import NoVictimError
from analysis.keyed_heap import KeyedHeap
from engine.core.errors import InvariantError
from engine.core.eviction import EvictionPolicyName


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

    @property
    def in_block_pool(self) -> EvictionPolicyName | None:
        """The engine's block-pool policy of this name (LRU, reuse-LRU: they are simulated through the
        engine's own pool), or None for a policy only the analyzer has."""
        try:
            return EvictionPolicyName(self.value)
        except ValueError:
            return None


class KeyEvictionPolicy(ABC):
    """The contract every simulated policy meets (see the module docstring).

    It orders cached *keys* that the sequential simulator names; the engine's
    `engine.core.eviction.EvictionPolicy` orders the block pool's own `Block` objects instead.
    """

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


class PriorityPolicy(KeyEvictionPolicy):
    """Evicts the evictable key of the lowest priority, ties to the least recently released.

    A subclass says what a key's priority is when it enters the cache (`insert`) and how a reuse
    changes it (`touch`); release, victim and remove are the same for all. The heap breaks equal
    priorities by push order, and a key is pushed when released, so ties go to the least recently
    released.

    Invariants: `_priority` holds every cached key; the evictable keys are exactly the keys of
    `_evictable`, each under its priority.
    """

    def __init__(self) -> None:
        self._priority: dict[Hashable, int] = {}  # cached key -> its priority (lowest is evicted first)
        self._evictable = KeyedHeap()  # evictable keys by priority, then release order

    def _enter(self, key: Hashable, priority: int) -> None:
        """Cache `key` under `priority` (the subclass's `insert`)."""
        if key in self._priority:
            raise ValueError(f"{key!r} is already cached")
        self._priority[key] = priority

    def release(self, key: Hashable) -> None:
        self._evictable.push(key, self._priority[key])

    def victim(self) -> Hashable:
        if not self._evictable:
            raise NoVictimError("no evictable block")
        return self._evictable.peek()

    def remove(self, key: Hashable) -> None:
        if key not in self._evictable:
            raise ValueError(f"{key!r} is not evictable")
        self._evictable.remove(key)
        del self._priority[key]

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def check_invariants(self) -> None:
        self._evictable.check_invariants()
        if not all(key in self._priority for key in self._evictable):
            raise InvariantError("an evictable key is not cached")


class FifoPolicy(PriorityPolicy):
    """First inserted first: a key's priority is its insertion number, fixed when it enters the cache.

    Invariant (beyond `PriorityPolicy`'s): cached keys have distinct insertion numbers.
    """

    def __init__(self) -> None:
        super().__init__()
        self._inserts = 0  # insertion numbers handed out

    def insert(self, key: Hashable) -> None:
        self._enter(key, self._inserts + 1)
        self._inserts += 1

    def touch(self, key: Hashable) -> None:
        self._evictable.discard(key)

    def check_invariants(self) -> None:
        super().check_invariants()
        if len(set(self._priority.values())) != len(self._priority):
            raise InvariantError("two cached keys share an insertion number")


class LfuPolicy(PriorityPolicy):
    """Fewest uses first, ties to the least recently released: a key's priority is its uses since it
    entered the cache (one for the insertion, one more per touch); eviction forgets them.

    Invariant (beyond `PriorityPolicy`'s): every cached key has at least one use.
    """

    def insert(self, key: Hashable) -> None:
        self._enter(key, 1)

    def touch(self, key: Hashable) -> None:
        self._evictable.discard(key)
        self._priority[key] += 1

    def check_invariants(self) -> None:
        super().check_invariants()
        if any(uses < 1 for uses in self._priority.values()):
            raise InvariantError("a cached key has no use")
