"""Block tables of sliding-window layers: a table keeps only the blocks its newest token can see.

Pure Python: no torch. A query at position p of a layer with window W sees keys in [p - W + 1, p]. On
top of what every manager does (engine/core/single_type_kv_cache_manager.py), a sliding group

  * releases the blocks of a table that lie wholly outside the window of its next token
    (`release_outside_window`, after every chunk), so the table starts at a logical `offset` > 0;
  * keeps cached window state only for the last `retain_tokens` tokens of each chain (W plus the
    backtracking allowance): older cached state of the chain is dropped (`_retire`), when the table
    releases blocks and when it is freed.

Its pool is unchained: a chain's cached blocks are usually only its last windows, so a hit is confirmed
against keys verified elsewhere (the full group's hit, or the request's own chain keys).
"""

from __future__ import annotations

from engine.core.block_pool import BlockPool
from engine.core.events import EventKind, EventLog, EvictReason
from engine.core.single_type_kv_cache_manager import BlockTable, HitShare, SingleTypeKVCacheManager, TableStart
from engine.core.kv_groups import HitPlan
from engine.core.namespace import CacheNamespace


class SlidingWindowManager(SingleTypeKVCacheManager):
    """The block tables of a sliding-window group of window W over an unchained pool."""

    def __init__(
        self, pool: BlockPool, namespace: CacheNamespace, log: EventLog, *, window: int, retain_tokens: int
    ) -> None:
        """Args:
            pool: the group's blocks (an unchained pool).
            namespace: the cache namespace (shared by every group of one engine).
            log: where events go.
            window: W, the tokens a query sees (itself included).
            retain_tokens: how many trailing tokens of a chain keep their cached state (>= W).
        """
        if window < 1 or retain_tokens < window:
            raise ValueError("a sliding group needs window W >= 1 and retain_tokens >= W")
        if pool.chained:
            raise ValueError("a sliding-window group uses an unchained pool")
        super().__init__(pool, namespace, log)
        self.window: int = window
        self.retain_tokens = retain_tokens
        self.num_window_released = 0  # blocks released because they left the sliding window
        self.num_window_evictions = 0  # keys dropped outside the retained window (and their chained children)

    def hit_share(self, plan: HitPlan) -> HitShare:
        """The sliding group shares its window blocks from the plan's offset up to r, and writes from r."""
        return HitShare(plan.sliding_hits, TableStart(plan.sliding_offset, plan.chain_keys), plan.r)

    def finish_chunk(self, request_id: str, *, cacheable: bool) -> None:
        """Key the newly full blocks (as every group does), then release the blocks the window left."""
        super().finish_chunk(request_id, cacheable=cacheable)
        self.release_outside_window(request_id)

    def free(self, request_id: str) -> None:
        """Release every reference the request holds, last block first; the chain then keeps cached
        state only for its last `retain_tokens` tokens."""
        table = self._tables.get(request_id)
        if table is None:
            return
        end_pos = table.num_tokens(self.block_size)
        super().free(request_id)
        self._retire(table, end_pos, request_id, held=False)

    def release_outside_window(self, request_id: str) -> int:
        """Release the blocks that lie wholly outside the window of the next token.

        The next token sits at position `num_tokens`; it sees positions [num_tokens - W + 1, num_tokens).
        Released blocks stay cached while they are within the chain's retained tail. Returns how many
        blocks were released (0 when the request holds no table).
        """
        table = self._tables.get(request_id)
        if table is None:
            return 0
        bs = self.block_size
        next_pos = table.num_tokens(bs)
        first_needed = max(0, next_pos - self.window + 1) // bs
        num_drop = min(first_needed - table.offset, len(table.blocks) - 1)
        if num_drop <= 0:
            return 0
        dropped, table.blocks = table.blocks[:num_drop], table.blocks[num_drop:]
        dropped_ids, table.block_ids = table.block_ids[:num_drop], table.block_ids[num_drop:]
        table.offset += num_drop
        self.num_window_released += num_drop
        self.pool.free_blocks(dropped, request_id)
        detail = {"num_blocks": num_drop, "block_ids": dropped_ids, "group": self.pool.group}
        self._log.emit(
            EventKind.WINDOW_RELEASE, detail, request_id=request_id, block_id=dropped_ids[0], tokens=num_drop * bs
        )
        self._retire(table, next_pos, request_id, held=True)
        return num_drop

    def _retire(self, table: BlockTable, end_pos: int, request_id: str, *, held: bool) -> None:
        """Drop cached, unreferenced state of the chain older than its last `retain_tokens` tokens.

        Args:
            table: the chain's table.
            end_pos: the chain's length now.
            request_id: for the events.
            held: True while the table is live: only blocks it already released are considered.
        """
        limit = max(0, end_pos - self.retain_tokens) // self.block_size
        limit = min(limit, table.offset if held else len(table.keys))
        for i in range(table.retired, limit):
            block = self.pool.cached_block(table.keys[i])
            if block is not None and block.ref_count == 0:
                before = self.pool.num_evictions
                self.pool.evict(block, EvictReason.WINDOW, request_id)
                self.num_window_evictions += self.pool.num_evictions - before
        table.retired = max(table.retired, limit)
