"""Block tables: slot allocation, forks, copy-on-write, caching and release, over one block pool.

Pure Python: no torch. A manager decides which physical block each token's KV lives in; the model
runner executes the copies it asks for (`take_copies`) before the next forward. `SingleTypeKVCacheManager`
is the part every attention type shares; each type is a subclass. The names are vLLM v1's: its
`SingleTypeKVCacheManager` is this base class, its `KVCacheCoordinator` is engine/core/kv_coordinator.py,
and its `KVCacheManager` (the facade its scheduler calls) has no counterpart here: the scheduler calls
the coordinator. `FullAttentionManager` (engine/core/full_attention_manager.py) looks prefixes up and
keeps whole tables; `SlidingWindowManager` (engine/core/sliding_window_manager.py) adds the window: it releases
blocks that left it and retires cached state older than the chain's retained tail.

A table maps a request's logical blocks, in order, to physical blocks. Only its last block can be
partially filled. In a sliding-window group a table may start at a logical `offset` > 0: the blocks
before it lay wholly outside the window of the request's newest token and were released.

    logical block:   0    1    2    3    4    5
    full group:     [a]  [b]  [c]  [d]  [e]  [f]        offset 0
    sliding group:            [p]  [q]  [r]  [s]        offset 2: blocks 0-1 released

Invariants (checked by `check_invariants`, on top of the pool's):
  * every reference on a block is held by exactly one table entry: `ref_count` equals the number of
    table entries (over running and retained requests) that point at it;
  * a block shared by several tables holds the same tokens for all of them, so a write into a shared
    partial block always copies it first (copy-on-write); the holder left alone writes in place;
  * `table.keys[i]` is the chained key of logical block i's tokens under the table's namespace root, for
    every i < len(table.keys); those blocks are full;
  * `table.block_ids[i]` is `table.blocks[i].block_id` (kept beside the blocks so that the runner reads a
    table's ids every step without a pass over its blocks).

Each change is a check and a commit, and the pool is asked once: `can_allocate` / `allocate` for a new
table, `can_append` / `append` to grow one (`blocks_to_allocate` / `blocks_to_append` count the blocks
without asking). A commit trusts its check and does not ask the pool again: called without room it is a
caller's bug, which the pool refuses (`NoFreeBlocksError`) when it runs out, possibly mid-commit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from engine.core.arith import ceil_div
from engine.core.block import Block
from engine.core.block_pool import BlockPool
from engine.core.chain_keys import chain_key
from engine.core.errors import require
from engine.core.events import EventKind, EventLog
from engine.core.kv_groups import HitPlan
from engine.core.namespace import CacheNamespace


class TableStart(NamedTuple):
    """Where a new table starts: its first logical block and the chain keys before it."""

    offset: int
    chain_keys: Sequence[bytes]  # keys of logical blocks [0, offset + number of hits), from the lookup


class HitShare(NamedTuple):
    """One group's share of a hit plan: what its new table shares and where the group starts writing."""

    hits: Sequence[Block]  # cached blocks the table shares, from its start on
    start: TableStart | None  # where the table starts; None: at block 0, keyed by the hits' keys
    write_from: int  # the first position this group writes (its hits end here)


class BlockCopy(NamedTuple):
    """Copy the first `num_slots` slots of block `src` into block `dst` (copy-on-write)."""

    src: int
    dst: int
    num_slots: int


@dataclass(slots=True)
class BlockTable:
    """One request's logical-to-physical block map and the key chain of its full blocks."""

    root_key: bytes  # namespace root (with the request's salt) its keys hang from
    blocks: list[Block] = field(default_factory=list)  # logical blocks offset, offset + 1, ...
    keys: list[bytes] = field(default_factory=list)  # chain keys of logical blocks [0, len(keys)), all full
    offset: int = 0  # logical index of blocks[0]; earlier blocks were released (sliding window only)
    # Retention bookkeeping: logical blocks [0, retired) are not this table's to drop from the cache, either
    # because it already did (they left the retained tail) or because it shared them from another chain.
    retired: int = 0
    block_ids: list[int] = field(default_factory=list)  # blocks[i].block_id, changed with `blocks`

    def num_tokens(self, block_size: int) -> int:
        if not self.blocks:
            return self.offset * block_size
        return (self.offset + len(self.blocks) - 1) * block_size + len(self.blocks[-1].token_ids)

    def extend(self, blocks: Sequence[Block]) -> None:
        self.blocks.extend(blocks)
        self.block_ids.extend(block.block_id for block in blocks)


class SingleTypeKVCacheManager(ABC):
    """Owns every request's block table over one block pool: what every attention type shares."""

    window: int | None = None  # the attention window stats report: None for full attention
    num_window_released = 0  # blocks released because they left the window (the sliding manager counts)
    num_window_evictions = 0  # keys dropped because their state left the window (the sliding manager counts)

    def __init__(self, pool: BlockPool, namespace: CacheNamespace, log: EventLog) -> None:
        """Args:
            pool: the group's blocks.
            namespace: the cache namespace (shared by every group of one engine).
            log: where events go.
        """
        if namespace.block_size != pool.block_size:
            raise ValueError("namespace and pool disagree on block_size")
        self.pool = pool
        self.namespace = namespace
        self.block_size = pool.block_size
        self._log = log
        self._tables: dict[str, BlockTable] = {}
        self._copies: list[BlockCopy] = []
        self.num_cow_copies = 0

    @abstractmethod
    def hit_share(self, plan: HitPlan) -> HitShare:
        """This group's share of a new request's hit plan (each attention type has its own)."""

    # ------------------------------------------------------------------ reading
    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the physical blocks the request holds, in logical order (from its offset)."""
        table = self._tables.get(request_id)
        return [] if table is None else list(table.block_ids)

    def live_block_ids(self, request_id: str) -> tuple[list[int], int]:
        """The request's block ids and the logical index of the first, without a copy: the list is the
        table's own, for reading before the table next changes (the runner's input of one step)."""
        table = self._tables[request_id]
        return table.block_ids, table.offset

    def chain_keys(self, request_id: str) -> list[bytes]:
        """A copy of the chain keys of the request's full blocks, logical block 0 first."""
        return list(self._tables[request_id].keys)

    def num_tokens(self, request_id: str) -> int:
        """Slots filled in the request's table (0 when it has none)."""
        table = self._tables.get(request_id)
        return 0 if table is None else table.num_tokens(self.block_size)

    def tables(self) -> dict[str, list[int]]:
        """Every live table as block ids, by request id."""
        return {rid: list(t.block_ids) for rid, t in self._tables.items()}

    def num_logical_blocks(self) -> int:
        return sum(len(t.blocks) for t in self._tables.values())

    # ------------------------------------------------------------------ allocation
    def blocks_to_allocate(self, num_new_tokens: int, hits: Sequence[Block] = ()) -> int:
        """Blocks `allocate` takes from the allocatable ones: new blocks for the tokens, plus the
        evictable hits (they stop being allocatable once shared). Asks the pool nothing."""
        num_evictable_hits = sum(1 for block in hits if block.ref_count == 0)
        return ceil_div(num_new_tokens, self.block_size) + num_evictable_hits

    def can_allocate(self, num_new_tokens: int, hits: Sequence[Block] = ()) -> bool:
        """Whether `allocate` can give a new table these hits and `num_new_tokens` slots after them."""
        return self.pool.can_allocate(self.blocks_to_allocate(num_new_tokens, hits))

    def allocate(
        self,
        request_id: str,
        new_token_ids: list[int],
        *,
        root_key: bytes,
        hits: Sequence[Block] = (),
        start: TableStart | None = None,
    ) -> None:
        """Give a new request its table: share `hits`, then reserve slots for `new_token_ids` after them.
        The caller's check (`can_allocate`, or `blocks_to_allocate` against the pool) said yes: this
        commit does not ask the pool again.

        Args:
            request_id: the request; it must hold no table yet.
            new_token_ids: tokens whose KV the next forward computes, in position order.
            root_key: the namespace root its keys hang from (the admission's, engine/core/namespace.py),
                registered with the pool.
            hits: cached blocks to share: logical blocks from the table's start on.
            start: where the table starts (see `check_start`); default: logical block 0.

        Raises:
            ValueError: the request already has a table, or this attention type refuses `start`.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        table = BlockTable(root_key=root_key)
        if start is not None:
            self.check_start(start)
            table.offset = start.offset
            table.keys = list(start.chain_keys[: start.offset + len(hits)])
        else:
            table.keys = [block.key for block in hits if block.key is not None]
            require(len(table.keys) == len(hits), f"{request_id}: a hit block is not cached")
        table.retired = table.offset + len(hits)  # shared state stays under its own chain's retention
        self._tables[request_id] = table
        if hits:
            self.pool.touch_blocks(hits)
            table.extend(hits)
            tokens = len(hits) * self.block_size
            ids = [block.block_id for block in hits]
            detail = {"cached_tokens": tokens, "num_blocks": len(hits), "block_ids": ids, "group": self.pool.group}
            self._log.emit(EventKind.HIT, detail, request_id=request_id, block_id=ids[-1], tokens=tokens)
        self._fill(table, request_id, new_token_ids)

    def check_start(self, start: TableStart) -> None:
        """Raise ValueError if a new table of this attention type may not start at `start`."""

    def blocks_to_append(self, request_id: str, num_new_tokens: int) -> int:
        """Blocks `append` takes from the pool: new blocks past the tail's room, plus a copy of a shared
        tail. Asks the pool nothing. Raises KeyError when the request has no table."""
        table = self._tables[request_id]
        need, tail_room = 0, 0
        if table.blocks:
            tail = table.blocks[-1]
            tail_room = self.block_size - len(tail.token_ids)
            if tail_room and tail.ref_count > 1 and num_new_tokens:
                need += 1  # copy-on-write of the shared partial tail
        return need + max(0, ceil_div(num_new_tokens - tail_room, self.block_size))

    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        """Whether `append` can reserve `num_new_tokens` more slots in the request's table."""
        return self.pool.can_allocate(self.blocks_to_append(request_id, num_new_tokens))

    def append(self, request_id: str, token_ids: list[int]) -> int:
        """Reserve slots for `token_ids` after the request's current tokens. The caller's check
        (`can_append`, or `blocks_to_append` against the pool) said yes: this commit does not ask again.

        Returns:
            Copy-on-write copies made (1 when the first token went into a shared partial tail, else 0).

        Raises:
            KeyError: the request has no table.
        """
        return self._fill(self._tables[request_id], request_id, token_ids)

    def _fill(self, table: BlockTable, request_id: str, token_ids: list[int]) -> int:
        """Fill the partial tail (copying it first if shared), then whole new blocks, in position order.
        The caller has checked that the pool has the blocks. Returns the copies made."""
        bs = self.block_size
        start = table.num_tokens(bs)
        filled = 0  # how many of token_ids are placed
        copies = 0
        if token_ids and table.blocks and len(table.blocks[-1].token_ids) < bs:
            tail = table.blocks[-1]
            if tail.ref_count > 1:
                tail = self._copy_on_write(table, request_id)
                copies = 1
            filled = min(bs - len(tail.token_ids), len(token_ids))
            tail.token_ids.extend(token_ids[:filled])
        num_new = ceil_div(len(token_ids) - filled, bs)
        if num_new > 0:
            table.extend(self.pool.allocate_blocks(num_new, request_id, start + filled, token_ids[filled:]))
        return copies

    def _copy_on_write(self, table: BlockTable, request_id: str) -> Block:
        old = table.blocks[-1]
        new = self.pool.allocate(request_id, start_pos=old.start_pos)
        new.token_ids = list(old.token_ids)
        table.blocks[-1] = new
        table.block_ids[-1] = new.block_id
        self.pool.free_blocks([old], request_id)
        self._copies.append(BlockCopy(old.block_id, new.block_id, len(new.token_ids)))
        self.num_cow_copies += 1
        detail = {
            "src_block": old.block_id,
            "dst_block": new.block_id,
            "num_slots": len(new.token_ids),
            "group": self.pool.group,
        }
        self._log.emit(EventKind.COW, detail, request_id=request_id, block_id=new.block_id, tokens=len(new.token_ids))
        return new

    def take_copies(self) -> list[BlockCopy]:
        """Copies the runner must execute before the next forward, oldest first."""
        copies, self._copies = self._copies, []
        return copies

    # ------------------------------------------------------------------ caching, forks, release
    def finish_chunk(self, request_id: str, *, cacheable: bool) -> None:
        """After the forward that computed the request's chunk: key its newly full blocks, offered to
        the prefix index unless `cacheable` is False (see `cache_full_blocks`)."""
        self.cache_full_blocks(request_id, offer=cacheable)

    def cache_full_blocks(self, request_id: str, *, offer: bool = True) -> None:
        """Key every newly full block of the table and offer it to the prefix index.

        Call after the forward that computed their KV: only computed blocks may be hit. Emits one
        CACHE event listing the blocks that entered the index. With `offer=False` the keys are only
        recorded in the table (its chain continues) and nothing enters the index.
        """
        table = self._tables[request_id]
        bs = self.block_size
        blocks, keys, offset = table.blocks, table.keys, table.offset
        first = len(keys)
        if first < offset:
            raise RuntimeError(f"{request_id}: a released block was never keyed")
        cached: list[Block] = []
        key = keys[-1] if keys else table.root_key  # the chain so far ends here
        for i in range(first, offset + len(blocks)):
            block = blocks[i - offset]
            if len(block.token_ids) < bs:
                break
            parent_key, key = key, chain_key(key, block.token_ids)
            keys.append(key)
            if not offer:
                continue
            parent = None
            if i and self.pool.chained:
                parent = blocks[i - 1]
                if parent.key != parent_key:  # our previous block is a duplicate: find the indexed twin
                    grandparent_key = keys[i - 2] if i > 1 else table.root_key
                    parent = self.pool.lookup(parent_key, grandparent_key, parent.token_ids)
                    if parent is None:
                        continue  # the chain above left the index; this block could never be matched
            if self.pool.can_cache(block, key, parent, parent_key):
                self.pool.cache(block, key, parent, parent_key)
                cached.append(block)
        if cached:
            self._emit_cache(table, cached, request_id)

    def _emit_cache(self, table: BlockTable, cached: list[Block], request_id: str) -> None:
        """The CACHE event of blocks that have just entered the index, in table order."""
        root, bs = table.root_key, self.block_size
        keys = [b.key for b in cached if b.key is not None]
        parent_keys = [b.parent_key for b in cached if b.parent_key is not None]
        require(len(keys) == len(parent_keys) == len(cached), f"{request_id}: a cached block has no key")
        detail = {
            "block_ids": [b.block_id for b in cached],
            "keys": [key.hex() for key in keys],
            # Each block's chain parent (None under the namespace root) and tokens: what a KV-event
            # BlockStored carries (engine/feeds/kv_events.py), kept here because a block evicted before the
            # listeners run forgets its tokens.
            "parent_keys": [None if key == root else key.hex() for key in parent_keys],
            "token_ids": [token for b in cached for token in b.token_ids],
            "start_pos": cached[0].start_pos,
            "end_pos": cached[-1].start_pos + bs,
            "group": self.pool.group,
        }
        tokens = len(cached) * bs
        self._log.emit(EventKind.CACHE, detail, request_id=request_id, block_id=cached[0].block_id, tokens=tokens)

    def fork(self, parent_id: str, child_id: str) -> int:
        """Give `child_id` a table that shares every block of the parent's. Returns shared tokens.

        Raises:
            ValueError: the child already has a table. KeyError: the parent has none. Nothing changes.
        """
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        parent = self._tables.get(parent_id)
        if parent is None:
            raise KeyError(f"request {parent_id!r} holds no blocks to fork from")
        # Inherited blocks stay under the parent's retention: the child's are retired up to its tail.
        offset = parent.offset
        child = BlockTable(
            parent.root_key,
            blocks=parent.blocks[:],
            keys=parent.keys[:],
            offset=offset,
            retired=offset + len(parent.blocks),
            block_ids=parent.block_ids[:],
        )
        self.pool.share_held_blocks(child.blocks)
        self._tables[child_id] = child
        shared = child.num_tokens(self.block_size)
        detail = {
            "parent_id": parent_id,
            "shared_blocks": len(child.blocks),
            "block_ids": child.block_ids[:],
            "group": self.pool.group,
        }
        last = child.block_ids[-1] if child.block_ids else None
        self._log.emit(EventKind.FORK, detail, request_id=child_id, block_id=last, tokens=shared)
        return shared

    def free(self, request_id: str) -> None:
        """Release every reference the request holds, last block first (so tails are evicted first)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        table.blocks.reverse()  # the table is gone: its list is handed over, last block first
        self.pool.free_blocks(table.blocks, request_id)

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Drop every unreferenced cached block. Returns (dropped, still cached because referenced)."""
        dropped, kept = self.pool.reset()
        detail = {"dropped_blocks": dropped, "ok": kept == 0, "kept_blocks": kept}
        self._log.emit(EventKind.RESET, detail)
        return dropped, kept

    # ------------------------------------------------------------------ inspection
    def holders(self) -> dict[int, list[str]]:
        """Request ids holding each referenced block, by block id."""
        out: dict[int, list[str]] = {}
        for rid, table in self._tables.items():
            for block in table.blocks:
                out.setdefault(block.block_id, []).append(rid)
        return out

    def check_invariants(self) -> None:
        """Raise InvariantError if a pool or table invariant (module docstrings) is broken."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        bs = self.block_size
        for rid, table in self._tables.items():
            for i, block in enumerate(table.blocks):
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                require(block.start_pos == (table.offset + i) * bs, f"{rid}: block {block.block_id} misplaced")
                if i < len(table.blocks) - 1:
                    require(len(block.token_ids) == bs, f"{rid}: a non-tail block is partial")
            require(table.block_ids == [b.block_id for b in table.blocks], f"{rid}: block ids out of step")
            require(table.offset <= len(table.keys) <= table.offset + len(table.blocks), f"{rid}: keys miscounted")
            for i in range(table.offset, len(table.keys)):
                parent = table.keys[i - 1] if i else table.root_key
                block = table.blocks[i - table.offset]
                require(table.keys[i] == chain_key(parent, block.token_ids), f"{rid}: key chain broken")
        for block in self.pool.blocks:
            held = refs.get(block.block_id, 0)
            require(block.ref_count == held, f"block {block.block_id}: ref_count {block.ref_count} != {held} holders")
