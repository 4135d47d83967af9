"""Block tables of full-attention layers: every table holds its whole context, from block 0.

Pure Python: no torch. On top of what every manager does (engine/core/single_type_kv_cache_manager.py),
a full group answers prefix lookups: its pool's index is a tree of chains from the namespace roots, so
the longest run of leading blocks found confirms every token before it. A lookup takes the context's
chain keys, which carry their root: the manager never turns a salt into one (engine/core/namespace.py).
"""

from __future__ import annotations

from engine.core.block import Block
from engine.core.block_pool import BlockPool
from engine.core.chain_keys import ChainKeys
from engine.core.errors import require
from engine.core.events import EventKind, EventLog
from engine.core.single_type_kv_cache_manager import BlockTable, HitShare, SingleTypeKVCacheManager, TableStart
from engine.core.kv_groups import HitPlan, max_hit_blocks
from engine.core.namespace import CacheNamespace


class FullAttentionManager(SingleTypeKVCacheManager):
    """The block tables of a full-attention group over a chained pool."""

    def __init__(self, pool: BlockPool, namespace: CacheNamespace, log: EventLog) -> None:
        if not pool.chained:
            raise ValueError("a full-attention group uses a chained pool")
        super().__init__(pool, namespace, log)

    def find_prefix_hit(self, token_ids: list[int], keys: ChainKeys) -> list[Block]:
        """The longest run of leading full blocks of `token_ids` found in the prefix index.

        Capped at `max_hit_blocks` blocks (engine/core/kv_groups.py) so at least one token is always
        computed to produce logits. Changes nothing; pass the result to `allocate`, with `keys.root_key`.

        Args:
            token_ids: the context.
            keys: the context's chain keys under its namespace root (a waiting request keeps its own, so
                its lookups hash no block twice). They are extended as far as this lookup reaches.
        """
        bs = self.block_size
        parent = keys.root_key
        hits: list[Block] = []
        for i in range(max_hit_blocks(len(token_ids), bs)):
            key = keys.key(i, token_ids)
            block = self.pool.lookup(key, parent, token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
            parent = key
        return hits

    def share_leading_blocks(
        self, holder_id: str, request_id: str, num_blocks: int, new_token_ids: list[int], *, root_key: bytes
    ) -> None:
        """Give a new request a table that shares the holder's first `num_blocks` blocks, then reserve
        slots for `new_token_ids` after them: an in-flight hit (engine/core/kv_coordinator.py's `share`).

        The blocks are full of the tokens the holder's table reserved for them, computed or to be computed
        by the holder's chunk in this step; the new table keys them once computed (`cache_full_blocks`),
        like its own. They are referenced, so only their reference counts change. The caller's check
        (`can_allocate(len(new_token_ids))`) said yes: this commit does not ask the pool again.

        Raises:
            ValueError: the request already has a table, the holder's table hangs from another namespace
                root than `root_key` (the new request's), or its first `num_blocks` blocks are not all full
                (or fewer than one).
            KeyError: the holder has no table. Nothing changes on a raise.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        holder = self._tables[holder_id]
        if holder.root_key != root_key:
            raise ValueError(f"request {holder_id!r} holds blocks under another namespace root or salt")
        shared = holder.blocks[:num_blocks]
        if num_blocks < 1 or len(shared) < num_blocks or any(len(b.token_ids) < self.block_size for b in shared):
            raise ValueError(f"request {holder_id!r} holds fewer than {num_blocks} full leading blocks")
        table = BlockTable(
            holder.root_key,
            blocks=shared,
            keys=holder.keys[:num_blocks],
            retired=num_blocks,  # shared state stays under its own chain's retention
            block_ids=holder.block_ids[:num_blocks],
        )
        self.pool.share_held_blocks(shared)
        self._tables[request_id] = table
        tokens = num_blocks * self.block_size
        detail = {
            "cached_tokens": tokens,
            "num_blocks": num_blocks,
            "block_ids": table.block_ids[:],
            "group": self.pool.group,
            "in_flight_from": holder_id,
        }
        self._log.emit(EventKind.HIT, detail, request_id=request_id, block_id=table.block_ids[-1], tokens=tokens)
        self._fill(table, request_id, new_token_ids)

    def hit_share(self, plan: HitPlan) -> HitShare:
        """The full group shares the hits [0, h) and writes from h."""
        return HitShare(plan.full_hits, None, plan.h)

    def check_start(self, start: TableStart) -> None:
        """A full-attention table always starts at block 0."""
        if start.offset:
            raise ValueError("a full-attention table always starts at block 0")

    def check_invariants(self) -> None:
        """Raise InvariantError if a pool or table invariant is broken or a table lost leading blocks."""
        super().check_invariants()
        for rid in self._tables:
            require(self.live_block_ids(rid)[1] == 0, f"{rid}: a full table lost leading blocks")
