"""The "sequential" simulation: one request at a time through a cache of a fixed number of blocks.

For each request, in arrival order:

  1. hit: `k` = the number of its leading blocks present when it arrives; it saves
     `min(k * block_size, input_length)` prompt tokens;
  2. room is made for its blocks that are not cached by evicting blocks that are not its own, in the
     policy's order (its blocks are held while it runs: none of them is a victim);
  3. all its blocks are in the cache and released tail first, so its first block is the most recently
     released of all (a chain's tail is evicted before its head), and they are evictable before the
     next request arrives.

Capacity in blocks is `floor(capacity_tokens / block_size)`. A request with more blocks than the
capacity keeps its leading `capacity` blocks: every other block leaves the cache (in the policy's
order) and its blocks past the capacity are computed but not kept (`bypass`). That rule is the same for
every policy and is the one the one-pass LRU curve (`analysis.stack_distance`) implies. Capacity 0
caches nothing.

The policies the engine ships (LRU, reuse-LRU) run through the engine's own block pool
(`analysis.pool_replay.PoolCache`, the same rule); OPT through `analysis.belady.BeladyCache` (the same
cache as `SequentialCache` under `BeladyPolicy`, in one loop); the others through `SequentialCache` here.

The infinite cache keeps every block it has seen: its hits are the workload's maximum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from analysis.belady import BeladyCache, BeladyPolicy
from analysis.policies import FifoPolicy, KeyEvictionPolicy, LfuPolicy, Policy
from analysis.pool_replay import PoolCache
from analysis.trace import Trace
from engine.core.errors import InvariantError
from engine.core.eviction import make_eviction_policy

PROGRESS_EVERY = 1024  # requests between progress callbacks


@dataclass(frozen=True, eq=False)
class PolicyRun:
    """What one (policy, capacity) did to a trace."""

    policy: Policy  # the eviction policy
    capacity_blocks: int  # the cache's size in blocks
    hit_blocks: np.ndarray  # int64 per request: its leading blocks present when it arrived
    evictions: tuple[int, ...] | None = None  # evicted block ids in order, when recorded (small traces)


class SequentialCache:
    """A cache of `capacity_blocks` blocks, serving one request at a time (see the module docstring).

    Invariants (checked by `check_invariants`, between requests): at most `capacity_blocks` blocks are
    cached, and every cached block is evictable in the policy.
    """

    def __init__(self, capacity_blocks: int, policy: KeyEvictionPolicy, *, record_evictions: bool = False) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self.evictions: list[int] | None = [] if record_evictions else None  # victims in order, if recorded
        self._cached: set[int] = set()

    def __len__(self) -> int:
        return len(self._cached)

    def __contains__(self, block: int) -> bool:
        return block in self._cached

    def serve(self, blocks: Sequence[int]) -> int:
        """Run one request of distinct block ids; return how many of its leading blocks were cached."""
        cached, policy, capacity = self._cached, self.policy, self.capacity_blocks
        hit = 0
        for block in blocks:
            if block not in cached:
                break
            hit += 1
        kept = blocks[:capacity]
        missing = [block for block in kept if block not in cached]
        for block in reversed(kept):
            if block in cached:
                policy.touch(block)
        excess = len(cached) + len(missing) - capacity
        if excess > 0:
            own = set(kept)
            for _ in range(excess):
                victim = policy.victim()
                if victim in own or victim not in cached:
                    raise InvariantError(f"the policy chose block {victim}, which is the request's or not cached")
                policy.remove(victim)
                cached.remove(victim)
                if self.evictions is not None:
                    self.evictions.append(victim)
        for block in reversed(missing):
            policy.insert(block)
            cached.add(block)
        for block in blocks[capacity:]:
            policy.bypass(block)
        for block in reversed(kept):
            policy.release(block)
        return hit

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless the class invariants hold (call between requests)."""
        if len(self._cached) > self.capacity_blocks:
            raise InvariantError(f"{len(self._cached)} blocks cached in a cache of {self.capacity_blocks}")
        if self.policy.num_evictable != len(self._cached):
            raise InvariantError(f"{self.policy.num_evictable} evictable of {len(self._cached)} cached blocks")
        self.policy.check_invariants()


def make_policy(policy: Policy, trace: Trace | None = None) -> KeyEvictionPolicy:
    """A fresh simulator policy object (for the policies the engine does not ship: FIFO, LFU, OPT).

    Args:
        policy: which one.
        trace: the trace to be simulated; only OPT needs it (it reads the future), and its keys must
            then be the trace's dense block ids.

    Raises:
        ValueError: OPT without a trace, or a policy of the engine's block pool (`Policy.in_block_pool`).
    """
    if policy.in_block_pool is not None:
        raise ValueError(f"{policy.value} is the engine's own policy: it runs through the block pool (PoolCache)")
    if policy is Policy.FIFO:
        return FifoPolicy()
    if policy is Policy.LFU:
        return LfuPolicy()
    if policy is Policy.OPT:
        if trace is None:
            raise ValueError("OPT needs the trace it will be run on (it reads the future)")
        return BeladyPolicy(trace.dense.ids, trace.unique_blocks)
    raise ValueError(f"no policy {policy!r}")


class RequestCache(Protocol):
    """Anything that serves a request's distinct block ids and says how many leading ones it had."""

    def serve(self, blocks: Sequence[int]) -> int: ...


def replay(trace: Trace, cache: RequestCache, on_requests: Callable[[int], None] | None = None) -> np.ndarray:
    """int64 per request: what `cache.serve` returned for it, requests in order, given dense block ids.

    Args:
        trace: the requests.
        cache: the cache (a `SequentialCache`, or any other with the same `serve`).
        on_requests: called with the number of requests done so far, every `PROGRESS_EVERY` requests
            and at the end.
    """
    ids, starts = trace.dense.ids.tolist(), trace.block_starts.tolist()
    hits = np.empty(len(trace), dtype=np.int64)
    for request in range(len(trace)):
        hits[request] = cache.serve(ids[starts[request] : starts[request + 1]])
        if on_requests is not None and (request + 1) % PROGRESS_EVERY == 0:
            on_requests(request + 1)
    if on_requests is not None:
        on_requests(len(trace))
    return hits


def simulate(
    trace: Trace,
    policy: Policy,
    capacity_blocks: int,
    *,
    record_evictions: bool = False,
    on_requests: Callable[[int], None] | None = None,
    pool_keys: list[bytes] | None = None,
) -> PolicyRun:
    """Run `trace` through a sequential cache of `capacity_blocks` blocks under `policy`: the engine's
    block pool for its own policies, a `SequentialCache` for the others.

    Args:
        trace: the requests.
        policy: which eviction policy.
        capacity_blocks: the cache's size in blocks (>= 0).
        record_evictions: keep the evicted block ids, in order, in the result (for small traces).
        on_requests: as for `replay`.
        pool_keys: `pool_replay.prefix_keys(trace)`, for a caller that runs the pool on one trace several
            times (they cost a hash per distinct block); computed here when needed and not given.

    Raises:
        TraceError: a pool policy on a trace whose ids change parents (see `pool_replay.prefix_keys`).
    """
    pool_policy = policy.in_block_pool
    # A cache that holds every distinct block never evicts, so every larger one hits the same: it is
    # built no larger (a block pool's blocks are objects, and a capacity is typed by an operator).
    size = min(capacity_blocks, trace.unique_blocks)
    if size and size == trace.unique_blocks and (pool_policy is None or pool_keys is not None):
        # Nor is it simulated: each request hits the leading blocks seen before, the infinite cache's hits,
        # whatever the policy. (A pool policy without keys still runs: a trace it cannot replay is refused.)
        if on_requests is not None:
            on_requests(len(trace))
        return PolicyRun(policy, capacity_blocks, infinite_hit_blocks(trace), () if record_evictions else None)
    cache: SequentialCache | PoolCache | BeladyCache
    if size == 0:  # caches nothing, whatever the policy (a block pool has at least one block)
        cache = SequentialCache(0, FifoPolicy(), record_evictions=record_evictions)
    elif policy is Policy.OPT:  # SequentialCache under BeladyPolicy, in one loop (analysis.belady)
        cache = BeladyCache(trace.dense.ids, trace.unique_blocks, size, record_evictions=record_evictions)
    elif pool_policy is not None:
        engine_policy = make_eviction_policy(pool_policy, size)
        cache = PoolCache(trace, size, engine_policy, keys=pool_keys, record_evictions=record_evictions)
    else:
        policy_object = make_policy(policy, trace)
        cache = SequentialCache(size, policy_object, record_evictions=record_evictions)
    hits = replay(trace, cache, on_requests)
    evictions = None if cache.evictions is None else tuple(trace.dense.unique[cache.evictions].tolist())
    return PolicyRun(policy, capacity_blocks, hits, evictions)


def infinite_hit_blocks(trace: Trace) -> np.ndarray:
    """int64 per request: its leading blocks seen in any earlier request (the infinite cache's hits)."""
    return leading_seen_blocks(trace.dense.ids, trace.block_starts)


def leading_seen_blocks(dense_ids: np.ndarray, block_starts: np.ndarray) -> np.ndarray:
    """int64 per request: how many of its leading ids (dense, 0..n-1; request r owns
    `dense_ids[block_starts[r]:block_starts[r + 1]]`) occur in an earlier request."""
    seen = bytearray(int(dense_ids.max()) + 1 if len(dense_ids) else 0)
    ids, starts = dense_ids.tolist(), block_starts.tolist()
    hits = np.empty(len(starts) - 1, dtype=np.int64)
    for request in range(len(starts) - 1):
        blocks = ids[starts[request] : starts[request + 1]]
        hit = 0
        for block in blocks:
            if not seen[block]:
                break
            hit += 1
        hits[request] = hit
        for block in blocks:
            seen[block] = 1
    return hits
