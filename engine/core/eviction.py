"""Eviction policies of the block pool: the order in which it gives up its evictable blocks.

Pure Python: no torch, no I/O. A policy holds exactly the pool's evictable blocks (unreferenced, in the
prefix index) and decides which one goes when the pool needs a block and none is free. The pool tells it
four things and asks it one:

    what happens in the pool                                  policy call
    blocks become evictable (the last reference is dropped)   release(blocks), in release order
    an evictable block stops being evictable (a prefix hit,   remove(block)
      or evicted out of turn: reset, window, parent evicted)
    a key enters the index / is about to leave it             cached(block) / uncached(block)
    room is needed                                            pop_victim() -> the block to evict, or
                                                              pop_victims(n) -> the next ones, in order

`cached` and `uncached` let a policy remember content across the block's physical reuse (the key, not
the block id, names the content); a policy that needs them says so with `tracks_keys = True`, and the
pool calls them only then (LRU does not: two calls fewer per missed block on the analyzer's replays).

Policies (`EvictionPolicyName`, chosen by `EngineConfig.eviction_policy`):
  * LRU: least recently released first, one intrusive doubly linked list through the blocks
    (`Block.lru_prev` / `lru_next`, vLLM's free queue): O(1) per call. The default.
  * reuse-LRU: LRU in which a block that has been reused gets more time before it is due; see
    `ReuseLruPolicy`. O(max_tier) = O(1) per call.

The workload analyzer (`analysis/`) replays traces through the pool with these same classes, so each
policy has exactly one implementation.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

from mypy_extensions import mypyc_attr

from engine.core.block import Block
from engine.core.errors import require

# reuse-LRU's defaults (`ReuseLruPolicy`), chosen on the Mooncake traces (benchmarks/analyzer.py --sensitivity)
REUSE_CREDIT_PER_REUSE = 2.0
REUSE_MAX_TIER = 2
REUSE_HISTORY_PER_BLOCK = 4


class EvictionPolicyName(enum.StrEnum):
    """An eviction policy of the block pool, by the name the configuration and the CLI use."""

    LRU = "lru"  # least recently released first (the default)
    REUSE_LRU = "reuse-lru"  # LRU with extra life for blocks that were reused


class LRUQueue:
    """Blocks in a doubly linked list through their own `lru_prev` / `lru_next` links, head first.

    O(1) `append` at the tail, `popleft` at the head and `remove` from anywhere; `extend` appends a run
    of blocks in one pass. A block is in at most one queue; one that is in none has both links None.
    """

    def __init__(self) -> None:
        self.head: Block | None = None  # least recently released
        self.tail: Block | None = None  # most recently released
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        block = self.head
        while block is not None:
            yield block
            block = block.lru_next

    def append(self, block: Block) -> None:
        block.lru_prev, block.lru_next = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.lru_next = block
        self.tail = block
        self._len += 1

    def extend(self, blocks: Sequence[Block]) -> None:
        """Append `blocks`, in order (none of them may be in a queue)."""
        tail = self.tail
        for block in blocks:
            block.lru_prev = tail
            if tail is None:
                self.head = block
            else:
                tail.lru_next = block
            tail = block
        self.tail = tail
        self._len += len(blocks)

    def popleft(self) -> Block:
        """Take the head out. Raises IndexError when the queue is empty."""
        block = self.head
        if block is None:
            raise IndexError("pop from an empty LRU queue")
        after = block.lru_next
        self.head = after
        if after is None:
            self.tail = None
        else:
            after.lru_prev = None
            block.lru_next = None
        self._len -= 1
        return block

    def remove(self, block: Block) -> None:
        """Unlink `block`. Raises ValueError when it is not in this queue (as far as its links tell)."""
        before, after = block.lru_prev, block.lru_next
        if before is None and self.head is not block:
            raise ValueError(f"block {block.block_id} is not in this LRU queue")
        if before is None:
            self.head = after
        else:
            before.lru_next = after
        if after is None:
            self.tail = before
        else:
            after.lru_prev = before
        block.lru_prev = block.lru_next = None
        self._len -= 1

    def popleft_run(self, num: int) -> list[Block]:
        """Take the first `num` blocks out, or fewer: stop after a block with an indexed child other than
        the block taken just before it (so a chain released tail first is taken whole, and no block is
        taken whose eviction would take an evictable block outside the run with it). Raises IndexError
        when the queue is empty."""
        if self.head is None:
            raise IndexError("pop from an empty LRU queue")
        taken: list[Block] = []
        before: Block | None = None
        block: Block | None = self.head
        while block is not None and len(taken) < num:
            taken.append(block)
            after, child = block.lru_next, block.first_child
            block.lru_prev = block.lru_next = None
            if child is not None and (child is not before or child.next_sibling is not None):
                block = after
                break
            before, block = block, after
        self.head = block
        if block is None:
            self.tail = None
        else:
            block.lru_prev = None
        self._len -= len(taken)
        return taken

    def check_links(self) -> list[Block]:
        """The queue's blocks, head first, after checking that its links agree both ways and end at its
        head and tail. Raises InvariantError otherwise."""
        blocks: list[Block] = []
        seen: set[int] = set()
        before, block = None, self.head
        while block is not None:
            require(block.block_id not in seen, "an LRU queue loops")
            require(block.lru_prev is before, f"block {block.block_id}: LRU links disagree")
            seen.add(block.block_id)
            blocks.append(block)
            before, block = block, block.lru_next
        require(self.tail is before, "an LRU queue's tail is not its last block")
        require(len(blocks) == self._len, "an LRU queue miscounts its blocks")
        return blocks


@mypyc_attr(allow_interpreted_subclasses=True)  # the analyzer's and the tests' policies are plain Python
class EvictionPolicy(ABC):
    """What the pool asks of a policy (see the module docstring). Misuse raises ValueError."""

    name: ClassVar[EvictionPolicyName]
    tracks_keys: ClassVar[bool] = False  # whether the pool must call `cached` and `uncached` (else no-ops)

    @abstractmethod
    def __len__(self) -> int:
        """How many blocks are evictable."""

    @abstractmethod
    def release(self, blocks: Sequence[Block]) -> None:
        """`blocks` (keyed, unreferenced, in no queue) became evictable, in this order."""

    @abstractmethod
    def remove(self, block: Block) -> None:
        """Evictable `block` stops being evictable: it was hit, or is evicted out of turn."""

    @abstractmethod
    def pop_victim(self) -> Block:
        """Take the block to evict next out of the evictable set. Raises IndexError when it is empty."""

    def pop_victims(self, num: int) -> list[Block]:
        """Take up to `num` (>= 1) blocks to evict out of the evictable set, in eviction order: what `num`
        calls of `pop_victim` would take, except that it stops early after a block whose eviction would
        evict other evictable blocks with it (an indexed child that is not among those taken). The pool
        evicts the taken blocks in order, so each one's descendants are gone before it is. By default one
        block. Raises IndexError when the set is empty."""
        return [self.pop_victim()]

    @abstractmethod
    def in_eviction_order(self) -> list[Block]:
        """The evictable blocks, the next victim first (for inspection and tests)."""

    def cached(self, block: Block) -> None:
        """`block` entered the index under `block.key` (it is referenced)."""

    def uncached(self, block: Block) -> None:
        """`block` is about to leave the index; `block.key` and `block.hit_count` still hold."""

    @abstractmethod
    def check_invariants(self, index: Mapping[bytes, Block]) -> list[Block]:
        """Raise InvariantError unless the policy's invariants hold (`index`: the pool's key -> block);
        return the evictable blocks."""


@mypyc_attr(allow_interpreted_subclasses=True)  # tests/test_block_pool_batched_eviction.py subclasses it
class LruPolicy(EvictionPolicy):
    """Least recently released first: one LRU queue, released blocks join its tail and the victim is its
    head."""

    name = EvictionPolicyName.LRU

    def __init__(self) -> None:
        self._queue = LRUQueue()  # the evictable blocks, least recently released first

    def __len__(self) -> int:
        return len(self._queue)

    def release(self, blocks: Sequence[Block]) -> None:
        self._queue.extend(blocks)

    def remove(self, block: Block) -> None:
        self._queue.remove(block)

    def pop_victim(self) -> Block:
        return self._queue.popleft()

    def pop_victims(self, num: int) -> list[Block]:
        """The queue's first `num` blocks, or fewer (`LRUQueue.popleft_run`)."""
        return self._queue.popleft_run(num)

    def in_eviction_order(self) -> list[Block]:
        return list(self._queue)

    def check_invariants(self, index: Mapping[bytes, Block]) -> list[Block]:
        return self._queue.check_links()


class ReuseLruPolicy(EvictionPolicy):
    """LRU that gives blocks which have been reused more time before they are evicted.

    A block's *uses* are its insertion into the index plus its prefix hits since (`Block.hit_count`),
    plus the uses its key had when it was last evicted, if the key is still in the history of recently
    evicted keys. Its *tier* is `min(uses - 1, max_tier)`: how many reuses it has had, capped. When it is
    released it gets the next release number; it is *due* at

        due = release number + tier * credit,      credit = credit_per_reuse * capacity_blocks

    and the victim is the evictable block due first (ties: the lower tier). A block reused twice is
    treated as if it had been released `2 * credit` releases later than it was.

    Why: on prefix-cache traffic most blocks are used once (76 % of the Mooncake conversation trace's
    blocks, 58 % of the synthetic's), while a block that has been reused is reused again far more often
    (conversation: 24 % of first-seen blocks are ever reused, 42 % of blocks used twice, 50 % of those
    used three times; synthetic: 42 % and 84 %). LRU gives a block used once the same life as one used
    five times, so a small cache is mostly full of blocks that will never be hit, and conversations'
    reused prefixes are evicted before their next turn arrives (typically minutes later). The credit
    keeps reused prefixes through that gap at the cost of evicting single-use blocks sooner; the history
    lets a prefix evicted before its second reuse regain its tier when it comes back.

    Each tier is an LRU queue (the same intrusive list as LRU's), whose blocks are due in release order,
    so the victim is the first due of the `max_tier + 1` queue heads. A request releases its table tail
    first, and its first block has had at least as many uses as its last, so a chain's tail is due
    before its head.

    Invariants (checked by `check_invariants`):
      * the tier queues are disjoint and hold exactly the evictable blocks, each in the queue of the tier
        it was released at, in increasing release number;
      * `_history` holds at most `history_limit` keys, none of them in the index; only indexed blocks
        have recalled uses.
    """

    name = EvictionPolicyName.REUSE_LRU
    tracks_keys = True

    def __init__(
        self,
        capacity_blocks: int,
        *,
        credit_per_reuse: float = REUSE_CREDIT_PER_REUSE,
        max_tier: int = REUSE_MAX_TIER,
        history_per_block: int = REUSE_HISTORY_PER_BLOCK,
    ) -> None:
        """Args:
        capacity_blocks: the pool's size in blocks (the credit and the history scale with it).
        credit_per_reuse: releases of extra life per reuse, in units of the capacity.
        max_tier: reuses that count (a block reused more often gets no more credit).
        history_per_block: evicted keys remembered, per block of capacity.
        """
        if capacity_blocks < 0 or credit_per_reuse < 0 or max_tier < 0 or history_per_block < 0:
            raise ValueError("capacity, credit, tiers and history must be >= 0")
        self.credit = credit_per_reuse * capacity_blocks  # releases of extra life per tier
        self.max_tier = max_tier
        self.history_limit = history_per_block * capacity_blocks  # evicted keys remembered, at most
        self._tiers = [LRUQueue() for _ in range(max_tier + 1)]  # evictable blocks of tier t, by release
        self._released: dict[int, tuple[int, int]] = {}  # evictable block id -> (release number, tier)
        self._recalled: dict[int, int] = {}  # cached block id -> uses its key had when last evicted
        self._history: OrderedDict[bytes, int] = OrderedDict()  # evicted key -> its uses, oldest first
        self._releases = 0  # release numbers handed out

    def __len__(self) -> int:
        return len(self._released)

    def uses(self, block: Block) -> int:
        """The block's uses as this policy counts them (see the class docstring)."""
        return 1 + block.hit_count + self._recalled.get(block.block_id, 0)

    def cached(self, block: Block) -> None:
        remembered = self._history.pop(block.key, 0)  # type: ignore[arg-type]
        if remembered:
            self._recalled[block.block_id] = remembered
        else:
            self._recalled.pop(block.block_id, None)

    def uncached(self, block: Block) -> None:
        uses = self.uses(block)
        self._recalled.pop(block.block_id, None)
        if self.history_limit:
            self._history[block.key] = uses  # type: ignore[index]
            if len(self._history) > self.history_limit:
                self._history.popitem(last=False)

    def release(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.block_id in self._released:
                raise ValueError(f"block {block.block_id} is already evictable")
            tier = min(self.uses(block) - 1, self.max_tier)
            self._releases += 1
            self._released[block.block_id] = (self._releases, tier)
            self._tiers[tier].append(block)

    def remove(self, block: Block) -> None:
        entry = self._released.pop(block.block_id, None)
        if entry is None:
            raise ValueError(f"block {block.block_id} is not evictable")
        self._tiers[entry[1]].remove(block)

    def pop_victim(self) -> Block:
        best, best_due = None, 0.0
        for tier, queue in enumerate(self._tiers):
            head = queue.head
            if head is not None:
                due = self._released[head.block_id][0] + tier * self.credit
                if best is None or due < best_due:
                    best, best_due = head, due
        if best is None:
            raise IndexError("no evictable block")
        self.remove(best)
        return best

    def in_eviction_order(self) -> list[Block]:
        def due(block: Block) -> tuple[float, int]:
            released, tier = self._released[block.block_id]
            return released + tier * self.credit, tier

        return sorted((block for queue in self._tiers for block in queue), key=due)

    def check_invariants(self, index: Mapping[bytes, Block]) -> list[Block]:
        evictable: list[Block] = []
        for tier, queue in enumerate(self._tiers):
            releases = []
            for block in queue.check_links():
                entry = self._released.get(block.block_id)
                require(entry is not None and entry[1] == tier, f"block {block.block_id} is in tier {tier} but not of it")
                releases.append(entry[0])  # type: ignore[index]
                evictable.append(block)
            require(releases == sorted(releases), f"tier {tier} is not in release order")
        require(len(evictable) == len(self._released), "a released block is in no tier queue")
        require(len(self._history) <= self.history_limit, "the history is over its limit")
        require(not any(key in index for key in self._history), "the history holds a cached key")
        indexed = {block.block_id for block in index.values()}
        require(set(self._recalled) <= indexed, "a block outside the index keeps recalled uses")
        return evictable


def make_eviction_policy(name: EvictionPolicyName, capacity_blocks: int) -> EvictionPolicy:
    """A fresh policy for a pool of `capacity_blocks` blocks."""
    if name is EvictionPolicyName.LRU:
        return LruPolicy()
    if name is EvictionPolicyName.REUSE_LRU:
        return ReuseLruPolicy(capacity_blocks)
    raise ValueError(f"no eviction policy {name!r}")
