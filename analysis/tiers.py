"""Two KV tiers, simulated directly: a pool of P blocks and, behind it, a disk tier of D blocks that takes
the pool's evicted blocks, both LRU, serving one request at a time (the sequential mode of
analysis/sequential.py).

For each request, in arrival order:

  1. lookup: its leading blocks in the pool are *pool hits*; the run then continues through blocks the
     pool or the tier holds (*tier hits*: read from the tier and promoted into the pool); then misses;
  2. its first P blocks are placed in the pool (held: none of them is a victim); room is made by evicting
     the pool's least recently released blocks, each *demoted* into the tier, oldest first;
  3. its blocks past P (a request larger than the pool) are written to the tier directly, tail first, as
     a pool of their size would have demoted them (the pool-only simulator computes and drops them);
  4. its pool blocks are released tail first, so a chain's tail is evicted before its head.

A full tier gives up its least recently used block for each new one. What the tier does with a block it
promotes is the rule (`TierRule`):

  * EXCLUSIVE: the block leaves the tier (every block of the request does: it is in the pool now), so
    the pool and the tier never hold the same block;
  * INCLUSIVE, this engine's rule (engine/core/kv_tier.py): the tier keeps its copy, made most recently
    used; demoting a block the tier already holds only makes it most recently used (no second write);
    the copies a request promotes are pinned while its own demotions are stored, and a store that finds
    every block of a full tier pinned is dropped (counted).

What follows (tests/test_analysis_tiers.py checks both claims on random traces against this simulation):

  * EXCLUSIVE equals one LRU cache of P + D blocks, request by request. Before each request the pool holds
    the P most recently released blocks; the pool evicts in release order, so the tier holds the blocks
    it received in release order too, and together they are the P + D most recently released blocks:
    the top of the same recency stack `analysis.stack_distance` reads every capacity off. So the
    two-tier hit ratio for every (P, D) comes from the one-pass curve at P + D.
  * INCLUSIVE lies between one LRU cache of max(P, D) blocks and one of P + D: the tier's copies of blocks
    that are also in the pool take slots without adding a block, so its effective size is P + D minus
    those duplicates. A block that D or fewer distinct blocks were released after is never lost: every
    block the tier touched since its demotion was released after it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from analysis.sequential import PROGRESS_EVERY
from analysis.trace import Trace
from engine.core.errors import require


class TierRule(enum.Enum):
    """What the tier does with a block it promotes into the pool (see the module docstring)."""

    EXCLUSIVE = "exclusive"  # the block leaves the tier: pool + tier is one LRU of P + D blocks
    INCLUSIVE = "inclusive"  # the tier keeps its copy: this engine's disk tier (engine/core/kv_tier.py)


@dataclass(frozen=True, slots=True)
class Served:
    """How one request's leading blocks were found."""

    pool_blocks: int  # leading blocks the pool held
    tier_blocks: int  # the blocks after those that the tier (or, after a tier block, the pool) held
    loaded_blocks: int  # of the tier_blocks, those read from the tier (the rest were in the pool)


@dataclass(frozen=True, eq=False)
class TierRun:
    """What one (pool, tier, rule) did to a trace: per request, its pool hits, tier hits and loads."""

    rule: TierRule
    pool_blocks: int  # the pool's size in blocks
    tier_blocks: int  # the tier's size in blocks
    pool_hit_blocks: np.ndarray  # int64 per request: leading blocks found in the pool
    tier_hit_blocks: np.ndarray  # int64 per request: the blocks after those found through the tier
    loaded_blocks: int  # blocks read from the tier over the whole trace
    stored_blocks: int  # blocks written to the tier
    dropped_blocks: int  # demotions not stored (INCLUSIVE: a full tier of pinned copies)

    @property
    def hit_blocks(self) -> np.ndarray:
        """int64 per request: its leading blocks found in either tier."""
        return self.pool_hit_blocks + self.tier_hit_blocks


class TwoTierCache:
    """A pool of `pool_blocks` over a tier of `tier_blocks`, serving one request of distinct block ids at a
    time (see the module docstring).

    Invariants (checked by `check_invariants`, between requests): the pool holds at most `pool_blocks`
    blocks and the tier at most `tier_blocks`; under EXCLUSIVE no block is in both.
    """

    def __init__(self, pool_blocks: int, tier_blocks: int, rule: TierRule) -> None:
        if pool_blocks < 0 or tier_blocks < 0:
            raise ValueError(f"tier sizes must be >= 0 blocks, got pool {pool_blocks}, tier {tier_blocks}")
        self.pool_blocks = pool_blocks
        self.tier_blocks = tier_blocks
        self.rule = rule
        self._pool: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._tier: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()  # INCLUSIVE: copies the request being served promoted
        self.loaded = self.stored = self.dropped = 0

    def serve(self, blocks: Sequence[int]) -> Served:
        """Run one request of distinct block ids; say how its leading blocks were found."""
        pool, tier = self._pool, self._tier
        in_pool = 0
        for block in blocks:
            if block not in pool:
                break
            in_pool += 1
        through_tier = 0
        promoted = []
        for block in blocks[in_pool:]:
            if block in tier:
                promoted.append(block)
            elif block not in pool:
                break
            through_tier += 1
        self.loaded += len(promoted)
        if self.rule is TierRule.EXCLUSIVE:
            for block in blocks:
                tier.pop(block, None)
        else:
            for block in promoted:
                tier.move_to_end(block)
            self._pinned = set(promoted)
        for block in blocks:
            pool.pop(block, None)  # held by the request: never a victim
        kept = blocks[: self.pool_blocks]
        for _ in range(len(pool) + len(kept) - self.pool_blocks):
            self._demote(pool.popitem(last=False)[0])
        for block in reversed(blocks[self.pool_blocks :]):
            self._demote(block)
        for block in reversed(kept):
            pool[block] = None
        self._pinned = set()
        return Served(in_pool, through_tier, len(promoted))

    def _demote(self, block: int) -> None:
        """`block` leaves the pool (or passes it by): into the tier, making room by LRU."""
        tier = self._tier
        if self.tier_blocks == 0:
            return
        if block in tier:
            tier.move_to_end(block)
            return
        if len(tier) >= self.tier_blocks:
            victim = next((key for key in tier if key not in self._pinned), None)
            if victim is None:
                self.dropped += 1
                return
            del tier[victim]
        tier[block] = None
        self.stored += 1

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless the class invariants hold (call between requests)."""
        require(len(self._pool) <= self.pool_blocks, f"{len(self._pool)} blocks in a pool of {self.pool_blocks}")
        require(len(self._tier) <= self.tier_blocks, f"{len(self._tier)} blocks in a tier of {self.tier_blocks}")
        if self.rule is TierRule.EXCLUSIVE:
            require(not self._pool.keys() & self._tier.keys(), "an exclusive tier holds a pool block")


def simulate_tiers(
    trace: Trace,
    pool_blocks: int,
    tier_blocks: int,
    rule: TierRule = TierRule.INCLUSIVE,
    on_requests: Callable[[int], None] | None = None,
) -> TierRun:
    """Run `trace` through a `TwoTierCache` (dense block ids; pure Python, one pass per (P, D)).

    Args:
        trace: the requests.
        pool_blocks: the pool's size in blocks (>= 0).
        tier_blocks: the tier's size in blocks (>= 0; 0: the pool alone).
        rule: what a promotion does to the tier's copy (INCLUSIVE: this engine's tier).
        on_requests: called with the number of requests done so far, every `PROGRESS_EVERY` requests
            and at the end.
    """
    cache = TwoTierCache(pool_blocks, tier_blocks, rule)
    ids, starts = trace.dense.ids.tolist(), trace.block_starts.tolist()
    pool_hits = np.empty(len(trace), dtype=np.int64)
    tier_hits = np.empty(len(trace), dtype=np.int64)
    for request in range(len(trace)):
        served = cache.serve(ids[starts[request] : starts[request + 1]])
        pool_hits[request], tier_hits[request] = served.pool_blocks, served.tier_blocks
        if on_requests is not None and (request + 1) % PROGRESS_EVERY == 0:
            on_requests(request + 1)
    if on_requests is not None:
        on_requests(len(trace))
    return TierRun(rule, pool_blocks, tier_blocks, pool_hits, tier_hits, cache.loaded, cache.stored, cache.dropped)
