"""The sequential mode through the engine's own block pool (engine/core/block_pool.py).

`PoolCache` serves a trace's requests, one at a time, through a real `BlockPool` of `capacity_blocks`
blocks under one of the engine's eviction policies (engine/core/eviction.py), exactly as the engine's KV
cache manager drives it, so `replay(trace, PoolCache(...))` gives the sequential mode's numbers of the
policies the engine ships (LRU, reuse-LRU) from the engine's own code. For one request:

  1. lookup: its leading blocks, one `BlockPool.lookup` each (key, parent key and tokens confirmed),
     until the first that is not cached; those are its hit blocks;
  2. `touch_blocks(hits)`, then `allocate_blocks` for the rest of its first `capacity_blocks` blocks
     (free blocks first, then the policy's victims), the new full blocks indexed under their chain keys
     in one `cache_chain` (what `cache` does block by block);
  3. `free_blocks` of every block it holds, last block first (so a chain's tail is evicted first).

That is the simulator's rule (analysis/sequential.py): blocks past the capacity are computed, not kept.

Blocks and keys. A hash-id trace names each block by an id that stands for its whole prefix; the pool
keys a block by the chained hash of its parent's key and its tokens. The adapter gives block `d` (a
dense id) the tokens `[d] * block_size` and the key `chain_key(key of its parent, tokens)`, computed
once per distinct block by `prefix_keys` (the engine's KV cache manager hashes tokens the same way).
So the pool's notion of "the same block" is the trace's exactly when every id always follows the same
parent (true of prefix hashes, and of every trace the readers produce); `prefix_keys` refuses a trace
where an id changes parents.

Why the pool and the simulator agree (tests/test_analysis_pool.py checks it request by request): under
LRU and reuse-LRU a block is never evicted before its descendants (it is released after them, and has
had at least as many uses), so the pool's rule that an evicted block takes its indexed descendants with
it never fires, and a request's cached blocks are always a leading run, which is what the lookup finds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from analysis.errors import TraceError
from analysis.trace import Trace
from engine.core.block_pool import BlockPool
from engine.core.chain_keys import chain_key
from engine.core.errors import require
from engine.core.events import EventKind, EventLog
from engine.core.eviction import EvictionPolicy

ROOT_KEY = chain_key(b"prefix-console/analysis", [])  # the namespace root every trace's chains hang from
ROOT_TEXT = "analysis: trace replay"  # what the root key stands for (the pool's namespace registry)
REQUEST_ID = "trace"  # the request id of every request (events only)


def prefix_keys(trace: Trace) -> list[bytes]:
    """The pool key of every dense block id of `trace` (see the module docstring).

    Raises:
        TraceError: an id follows two different parents (the pool cannot replay such a trace).
    """
    dense = trace.dense.ids
    parents = np.empty_like(dense)
    parents[1:] = dense[:-1]
    parents[trace.block_starts[:-1][trace.blocks_per_request > 0]] = -1  # a first block hangs from the root
    order = np.lexsort((parents, dense))
    by_block, by_parent = dense[order], parents[order]
    changed = (by_block[1:] == by_block[:-1]) & (by_parent[1:] != by_parent[:-1])
    if changed.any():
        block = int(trace.dense.unique[by_block[1:][changed][0]])
        raise TraceError(
            f"block id {block} follows two different blocks; the engine's block pool (LRU, reuse-LRU) keys a "
            "block by its whole prefix, so it replays traces of prefix hashes only"
        )
    _, first = np.unique(dense, return_index=True)
    first_seen = np.sort(first)  # every block after its parent: the parent comes first in its request
    keys: list[bytes] = [b""] * trace.unique_blocks
    size = trace.block_size
    for block, parent in zip(dense[first_seen].tolist(), parents[first_seen].tolist()):
        keys[block] = chain_key(ROOT_KEY if parent < 0 else keys[parent], [block] * size)
    return keys


class PoolCache:
    """A `BlockPool` of `capacity_blocks` blocks serving requests of dense block ids one at a time.

    Invariant (between requests): every block of the pool is free or evictable, and the pool's own
    invariants hold (`check_invariants`).
    """

    def __init__(
        self,
        trace: Trace,
        capacity_blocks: int,
        policy: EvictionPolicy,
        *,
        keys: list[bytes] | None = None,
        record_evictions: bool = False,
    ) -> None:
        """Args:
        trace: the trace whose dense block ids `serve` will be given.
        capacity_blocks: the pool's size (>= 1; a cache of 0 blocks has no pool).
        policy: a fresh engine eviction policy for this pool.
        keys: `prefix_keys(trace)`, when the caller has them already (they cost a hash per block).
        record_evictions: keep the dense ids of evicted blocks, in order, in `evictions`.

        Raises:
            ValueError: a capacity below 1.
            TraceError: a trace the pool cannot replay (see `prefix_keys`).
        """
        if capacity_blocks < 1:
            raise ValueError(f"a block pool holds at least 1 block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size = trace.block_size
        self.log = EventLog(recording=record_evictions)  # the EVICT events name the victims
        self.pool = BlockPool(capacity_blocks, trace.block_size, self.log, eviction=policy)
        self.pool.register_root(ROOT_KEY, ROOT_TEXT)
        self._keys = prefix_keys(trace) if keys is None else keys
        self.evictions: list[int] | None = [] if record_evictions else None  # victims' dense ids, in order
        self._block_of_key = {key: block for block, key in enumerate(self._keys)} if record_evictions else None

    def serve(self, blocks: Sequence[int]) -> int:
        """Run one request of distinct dense block ids; return how many of its leading blocks were cached."""
        pool, keys, size = self.pool, self._keys, self.block_size
        kept = blocks[: self.capacity_blocks]
        parent, parent_key = None, ROOT_KEY
        held = []
        for block in kept:
            found = pool.lookup(keys[block], parent_key, [block] * size)
            if found is None:
                break
            held.append(found)
            parent, parent_key = found, found.key
        hit = len(held)
        if hit:
            pool.touch_blocks(held)
        missing = kept[hit:]
        if missing:
            new = pool.allocate_blocks(len(missing), REQUEST_ID, hit * size)
            for block, physical in zip(missing, new):
                physical.token_ids = [block] * size  # the KV the request computes into it
            pool.cache_chain(new, [keys[block] for block in missing], parent, parent_key)
            held += new
        held.reverse()
        pool.free_blocks(held, REQUEST_ID)
        events = self.log.take()
        if self.evictions is not None:
            evicted = (bytes.fromhex(e.detail["key"]) for e in events if e.kind is EventKind.EVICT)
            self.evictions.extend(self._block_of_key[key] for key in evicted)  # type: ignore[index]
        return hit

    def check_invariants(self) -> None:
        """Raise InvariantError unless the class invariant holds (call between requests)."""
        self.pool.check_invariants()
        unreferenced = self.pool.num_free + self.pool.num_evictable
        require(unreferenced == self.capacity_blocks, "a block is still referenced between requests")
