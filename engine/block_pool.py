"""Physical KV blocks: reference counts, the prefix index and least-recently-used eviction.

Pure Python: no torch, no I/O. The pool only does bookkeeping; the KV tensors live in the model runner
and are addressed by block id.

Every block is in exactly one of three states:

    free        ref_count == 0, no key         -> handed out first by `allocate`
    evictable   ref_count == 0, key in index   -> kept for prefix hits, evicted LRU-first
    referenced  ref_count  > 0                 -> held by block tables, never handed out

The LRU is a queue in release order with lazy deletion. A release appends every block it drops a
reference on to the tail, in one call; the entry is live for a block that became evictable and dead
from the start for one that stays referenced or goes back to the free deque. A live entry is left in
place, dead, when its block is shared again or evicted out of turn. Each block counts its dead entries
in `Block.lru_dead`; they all precede its live one. Popping skips dead entries, and the queue is
compacted once it holds more than twice the pool, so every operation stays O(1) amortized.

Invariants (checked by `check_invariants`):
  * the free deque, the evictable blocks and the referenced blocks are disjoint and cover the pool;
  * each block has `lru_dead` + (1 if evictable else 0) entries in the LRU queue, the live one last;
    `num_evictable` counts the evictable blocks;
  * `index[key]` is a full block whose `key` is `key`, whose key is the chained hash of its
    `parent_key` and its token ids;
  * the index is a tree: an indexed block's `parent_key` is a registered namespace root, or the key
    of an indexed block that holds the preceding `block_size` tokens. So a key identifies the exact
    tokens at the exact positions from the start of the context, in one namespace, and a lookup that
    confirms the stored token ids and parent key can never be fooled by a hash collision. When a block
    leaves the index its indexed descendants leave too (they could never match again);
  * the tree's links live in the blocks (no container per block): an indexed block's `parent` is the
    indexed block under `parent_key` (None under a root), and it is in exactly that parent's child
    list (`first_child`, then `next_sibling`, doubly linked through `prev_sibling`). Blocks outside
    the index, and every block of an unchained pool, have no links.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import xxhash

from engine.events import EventKind, EventLog, EvictReason


# Reading an enum member through its class costs ~0.2 us on Python 3.11 (EnumType defines __getattr__),
# as much as the rest of a small call's bookkeeping; the per-call paths read these instead.
_ALLOCATE, _RELEASE = EventKind.ALLOCATE, EventKind.RELEASE


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when every block is referenced. Callers check `num_allocatable` first."""


KEY_SIZE = 16  # bytes in a chain key (and a namespace root)
# Token ids -> bytes, by block length: a compiled struct packs a block in a third less time than an array.
_TOKEN_PACKERS: dict[int, Callable[..., bytes]] = {}


def chain_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """The cache key of a full block: a 128-bit hash over its parent's key and its token ids (each as
    4 little-endian bytes, so keys are the same on every platform)."""
    pack = _TOKEN_PACKERS.get(len(token_ids))
    if pack is None:
        pack = _TOKEN_PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}I").pack
    return xxhash.xxh3_128_digest(parent_key + pack(*token_ids))


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block of `block_size` token slots."""

    block_id: int
    token_ids: list[int] = field(default_factory=list)  # filled slots, in order
    ref_count: int = 0  # number of block-table entries pointing here
    start_pos: int = 0  # context position of slot 0 for its current holders
    key: bytes | None = None  # set while the block is in the prefix index
    # `key is not None`, kept beside it so that a release reads a flag instead of the key object (in a large
    # pool those key objects are cold: one cache miss per block).
    indexed: bool = False
    parent_key: bytes | None = None  # the key its chain hangs from (namespace root for block 0)
    created_at: float = 0.0  # when it was last handed out by `allocate`
    # Last allocation, prefix hit or release. A fork's share is not stamped: the parent holds the block,
    # so it cannot be evicted before a release stamps it again.
    last_used: float = 0.0
    hit_count: int = 0  # prefix hits (index lookups that reused it) since allocation; forks are not hits
    lru_dead: int = 0  # its dead entries in the pool's LRU queue (see the module docstring)
    # Prefix-tree links while indexed in a chained pool (see the module docstring).
    parent: Block | None = field(default=None, repr=False)
    first_child: Block | None = field(default=None, repr=False)
    next_sibling: Block | None = field(default=None, repr=False)
    prev_sibling: Block | None = field(default=None, repr=False)


class BlockPool:
    """A fixed pool of blocks with a prefix index and LRU eviction of unreferenced cached blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        log: EventLog,
        *,
        group: str = "full",
        chained: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.group = group  # the KV group these blocks serve ("full" or "sliding")
        # A chained index is a tree (see module docstring). A sliding-window group's index is not: its
        # chains keep only their last windows, so a cached block's parent is usually gone. Its hits are
        # confirmed against a chain verified elsewhere (the full group's, or the request's own keys).
        self.chained = chained
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._log = log
        self._clock = log.clock  # one time source for block stamps and events
        self._free: deque[Block] = deque(self.blocks)  # ref 0, no key; allocated from the left
        self._lru: deque[Block] = deque()  # evictable blocks, oldest release first, with dead entries
        self._num_evictable = 0  # blocks with a live LRU entry
        self._lru_limit = 2 * num_blocks  # compact the LRU queue beyond this many entries
        self._index: dict[bytes, Block] = {}  # key -> cached block
        self._roots: dict[bytes, str] = {}  # namespace root key -> the namespace text it hashes
        self.num_evictions = 0

    # ------------------------------------------------------------------ capacity
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_allocatable(self) -> int:
        """Blocks `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + self._num_evictable

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix index (referenced or not)."""
        return len(self._index)

    # ------------------------------------------------------------------ namespaces
    def register_root(self, root_key: bytes, namespace_text: str) -> None:
        """Bind a namespace root key to its text; a second text under the same key is refused."""
        bound = self._roots.setdefault(root_key, namespace_text)
        if bound != namespace_text:
            raise RuntimeError("namespace root key collision: refusing to share a key space")

    # ------------------------------------------------------------------ allocation
    def allocate(self, request_id: str, start_pos: int) -> Block:
        """Hand out one block with a single reference (see `allocate_blocks`)."""
        return self.allocate_blocks(1, request_id, start_pos)[0]

    def allocate_blocks(
        self, num: int, request_id: str, start_pos: int, token_ids: list[int] | None = None
    ) -> list[Block]:
        """Hand out `num` blocks with one reference each, free blocks first, then evicting LRU.

        Args:
            num: how many blocks.
            request_id: the request they are for (events).
            start_pos: context position of the first block's slot 0; the others follow contiguously.
            token_ids: what the blocks will hold, `block_size` per block in order (the caller writes the
                KV); None hands them out empty.

        Raises:
            NoFreeBlocksError: fewer than `num` blocks are free or evictable; nothing changes.
        """
        if num > len(self._free) + self._num_evictable:
            raise NoFreeBlocksError(f"{num} blocks asked for, {self.num_allocatable} of {self.num_blocks} available")
        free_queue, bs = self._free, self.block_size
        now = self._clock()
        blocks = []
        ids = []
        for i in range(num):
            if free_queue:
                block = free_queue.popleft()
            else:
                block = self._pop_lru()
                self._uncache(block, EvictReason.LRU, request_id)
            block.ref_count = 1
            block.token_ids = [] if token_ids is None else token_ids[i * bs : (i + 1) * bs]
            block.start_pos = start_pos + i * bs
            block.created_at = now
            block.last_used = now
            block.hit_count = 0
            blocks.append(block)
            ids.append(block.block_id)
        if blocks:
            self._log.emit(_ALLOCATE, request_id, ids[0], 0, {"block_ids": ids, "group": self.group}, now)
        return blocks

    def touch_blocks(self, blocks: Sequence[Block]) -> None:
        """Take one more reference on each block, cached or already referenced (a prefix hit): stamps its
        use and counts the hit. Cached unreferenced blocks leave the evictable LRU. The caller emits the
        HIT event.

        Raises:
            RuntimeError: a block is free (unreferenced and uncached); nothing changes.
        """
        for block in blocks:
            if block.ref_count == 0 and block.key is None:
                raise RuntimeError(f"block {block.block_id} is free; only cached or held blocks can be shared")
        now = self._clock()
        for block in blocks:
            if block.ref_count == 0:
                self._num_evictable -= 1
                block.lru_dead += 1  # its LRU entry stays behind, dead
            block.ref_count += 1
            block.hit_count += 1
            block.last_used = now

    @staticmethod
    def share_held_blocks(blocks: Iterable[Block]) -> None:
        """Take one more reference on blocks a fork's parent table holds. They are referenced, so outside
        the LRU, and a fork is not a prefix hit: only the reference count changes. The caller emits the
        FORK event."""
        for block in blocks:
            block.ref_count += 1

    def free_blocks(self, blocks: list[Block], request_id: str, block_ids: list[int] | None = None) -> None:
        """Drop one reference on each block, in order; one RELEASE event for the call.

        At zero a keyed block joins the LRU tail (evictable); an unkeyed one goes back to the free deque.
        `blocks` are distinct, consecutive entries of one block table, in either order, so only an end
        can be partially filled. Callers pass a table's blocks last-first, so a chain's tail is evicted
        before its head. `block_ids`, if given, are the blocks' ids in the same order; the event keeps
        that list, so the caller must not change it afterwards.

        Raises:
            RuntimeError: a block has no reference left to drop; nothing changes.
        """
        now, lru, free_queue = self._clock(), self._lru, self._free
        lru_before, free_before = len(lru), len(free_queue)
        # Every released block joins the LRU tail in one call; the entries of blocks that stay referenced
        # or go back to the free deque are dead from the start.
        lru.extend(blocks)
        free_append = free_queue.append
        dead = 0
        for block in blocks:
            ref_count = block.ref_count = block.ref_count - 1
            block.last_used = now
            if ref_count or not block.indexed:
                if ref_count < 0:
                    self._undo_release(blocks[: blocks.index(block) + 1], lru_before, free_before)
                    raise RuntimeError(f"block {block.block_id} released more often than referenced; nothing released")
                block.lru_dead += 1
                dead += 1
                if not ref_count:
                    free_append(block)
        cached = len(blocks) - dead
        self._num_evictable += cached
        if len(lru) > self._lru_limit:
            self._compact_lru()
        if blocks:
            # Interior blocks of a table are full: only the two ends can hold fewer tokens.
            bs, first, last = self.block_size, blocks[0], blocks[-1]
            tokens = len(first.token_ids)
            if last is not first:
                tokens += (len(blocks) - 2) * bs + len(last.token_ids)
            released = [block.block_id for block in blocks] if block_ids is None else block_ids
            freed = cached + len(free_queue) - free_before
            self._log.emit(
                _RELEASE,
                request_id,
                released[0],
                tokens,
                {"block_ids": released, "freed": freed, "group": self.group},
                now,
            )

    # ------------------------------------------------------------------ prefix index
    def lookup(self, key: bytes, parent_key: bytes, token_ids: list[int]) -> Block | None:
        """The cached block for `key`, only if it holds exactly `token_ids` under `parent_key`."""
        block = self._index.get(key)
        if block is None or block.parent_key != parent_key or block.token_ids != token_ids:
            return None
        return block

    def cached_block(self, key: bytes) -> Block | None:
        """The block indexed under `key`, unconfirmed (for bookkeeping on one's own chain, not for hits)."""
        return self._index.get(key)

    def cache(self, block: Block, key: bytes, parent: Block | None, parent_key: bytes) -> bool:
        """Put a full, referenced block into the index under `key` (the caller emits the CACHE event).

        Args:
            block: the full block, held by the caller's table.
            key: `chain_key(parent_key, block.token_ids)`.
            parent: the indexed block the chain hangs from, as returned by `lookup` for the caller's
                preceding block; None for the first block of a context.
            parent_key: the parent's key, or the namespace root for the first block.

        Returns:
            True when indexed; False when the key is already indexed (an identical block exists; block
            tables are append-only, so the duplicate is simply left unindexed) or when the parent is not
            indexed (its chain left the cache, so this block could never be matched).
        """
        if block.key is not None or len(block.token_ids) != self.block_size or key in self._index:
            return False
        if self.chained:
            if parent is None:
                if parent_key not in self._roots:
                    raise RuntimeError("caching under an unregistered namespace root")
            elif parent.key != parent_key or self._index.get(parent_key) is not parent:
                return False
        block.key = key
        block.indexed = True
        block.parent_key = parent_key
        self._index[key] = block
        if self.chained and parent is not None:
            first = parent.first_child
            if first is not None:
                first.prev_sibling = block
            block.next_sibling = first
            block.parent = parent
            parent.first_child = block
        return True

    def evict(self, block: Block, reason: EvictReason, request_id: str | None = None) -> None:
        """Evict one unreferenced cached block (and its indexed descendants) to the free deque."""
        if block.ref_count != 0 or block.key is None:
            raise RuntimeError(f"block {block.block_id} is not an evictable cached block")
        self._num_evictable -= 1
        block.lru_dead += 1  # its LRU entry dies with its key
        self._uncache(block, reason, request_id)
        self._free.append(block)

    def reset(self) -> tuple[int, int]:
        """Evict every unreferenced cached block.

        Returns:
            (dropped, still_cached): blocks evicted, and cached blocks kept because they are referenced.
        """
        dropped = 0
        while self._num_evictable:
            block = self._pop_lru()
            dropped += 1 + self._uncache(block, EvictReason.RESET, None)
            self._free.append(block)
        return dropped, len(self._index)

    def _undo_release(self, failed: list[Block], lru_before: int, free_before: int) -> None:
        """Give back what a failed `free_blocks` call changed. `failed` are the blocks it reached, in
        release order, the one released once too often last."""
        for _ in range(len(self._lru) - lru_before):
            self._lru.pop()
        for _ in range(len(self._free) - free_before):
            self._free.pop()
        for block in failed[:-1]:
            if block.ref_count or not block.indexed:
                block.lru_dead -= 1  # its entry was dead from the start
        for block in failed:
            block.ref_count += 1

    def _pop_lru(self) -> Block:
        """Take the least recently used evictable block out of the LRU (there must be one)."""
        lru = self._lru
        while True:
            block = lru.popleft()
            if not block.lru_dead:
                self._num_evictable -= 1
                return block
            block.lru_dead -= 1

    def _compact_lru(self) -> None:
        """Drop the LRU queue's dead entries, keeping the live ones in order."""
        live = []
        for block in self._lru:
            if block.lru_dead:
                block.lru_dead -= 1
            else:
                live.append(block)
        self._lru = deque(live)

    def _uncache(self, block: Block, reason: EvictReason, request_id: str | None) -> int:
        """Remove a block's key and its indexed descendants' keys. Returns how many descendants.

        The block itself must already be out of the evictable LRU; the caller decides where it goes.
        Unreferenced descendants move from the LRU to the free deque.
        """
        parent = block.parent
        if parent is not None:  # unlink it from its parent's child list
            before, after = block.prev_sibling, block.next_sibling
            if before is None:
                parent.first_child = after
            else:
                before.next_sibling = after
            if after is not None:
                after.prev_sibling = before
            block.parent = block.prev_sibling = block.next_sibling = None
        self._drop_key(block, reason, request_id)
        # The whole subtree leaves, so its links are cut wholesale, one child list at a time.
        removed = 0
        subtree = [block]
        while subtree:
            node = subtree.pop()
            child, node.first_child = node.first_child, None
            while child is not None:
                following = child.next_sibling
                child.parent = child.prev_sibling = child.next_sibling = None
                self._drop_key(child, EvictReason.PARENT_EVICTED, request_id)
                if child.ref_count == 0:
                    self._num_evictable -= 1
                    child.lru_dead += 1
                    self._free.append(child)
                subtree.append(child)
                removed += 1
                child = following
        return removed

    def _drop_key(self, block: Block, reason: EvictReason, request_id: str | None) -> None:
        """Take one block's key out of the index and emit its EVICT event (links are the caller's)."""
        key = block.key
        assert key is not None and block.parent_key is not None
        del self._index[key]
        now = self._clock()
        self._log.emit(
            EventKind.EVICT,
            request_id,
            block.block_id,
            len(block.token_ids),
            {
                "reason": reason.value,
                "key": key.hex(),
                "start_pos": block.start_pos,
                "end_pos": block.start_pos + len(block.token_ids),
                "age_s": now - block.created_at,
                "hit_count": block.hit_count,
                "last_used": block.last_used,
                "group": self.group,
            },
            now,
        )
        self.num_evictions += 1
        block.key = None
        block.indexed = False
        block.parent_key = None

    # ------------------------------------------------------------------ inspection
    def state_of(self, block: Block) -> str:
        """"free", "evictable" or "referenced"."""
        if block.ref_count > 0:
            return "referenced"
        return "evictable" if block.key is not None else "free"

    def evictable_in_lru_order(self) -> list[int]:
        """Ids of the blocks with a live LRU entry, least recently used first (the order of eviction)."""
        dead_left: dict[int, int] = {}
        order = []
        for block in self._lru:
            dead = dead_left.setdefault(block.block_id, block.lru_dead)
            if dead:
                dead_left[block.block_id] = dead - 1
            else:
                order.append(block.block_id)
        return order

    def check_invariants(self) -> None:
        """Raise AssertionError if any pool invariant (module docstring) is broken."""
        free_ids = [b.block_id for b in self._free]
        assert len(free_ids) == len(set(free_ids)), "a block is twice in the free deque"
        free_set = set(free_ids)
        live = self.evictable_in_lru_order()
        evictable_set = set(live)
        assert len(live) == len(evictable_set), "a block has two live LRU entries"
        assert evictable_set == {b.block_id for b in self.blocks if b.ref_count == 0 and b.key is not None}, (
            "the live LRU entries are not the evictable blocks"
        )
        assert len(evictable_set) == self._num_evictable, "num_evictable does not count the evictable blocks"
        entries: dict[int, int] = {}
        for block in self._lru:
            entries[block.block_id] = entries.get(block.block_id, 0) + 1
        for block in self.blocks:
            expected = block.lru_dead + (block.block_id in evictable_set)
            assert entries.get(block.block_id, 0) == expected, f"block {block.block_id}: LRU entries miscounted"
        referenced = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert not free_set & evictable_set, "free and evictable overlap"
        assert not free_set & referenced, "a referenced block is free"
        assert not evictable_set & referenced, "a referenced block is evictable"
        assert len(free_set) + len(evictable_set) + len(referenced) == self.num_blocks, "states do not cover the pool"
        for block in self.blocks:
            assert block.ref_count >= 0
            assert len(block.token_ids) <= self.block_size
            if block.block_id in free_set:
                assert block.key is None, f"free block {block.block_id} has a key"
            if block.block_id in evictable_set:
                assert block.key is not None, f"evictable block {block.block_id} has no key"
            assert block.indexed == (block.key is not None), f"block {block.block_id}: indexed flag is stale"
            if block.key is not None:
                assert self._index.get(block.key) is block, f"block {block.block_id} key not indexed"
        for key, block in self._index.items():
            assert block.key == key
            assert len(block.token_ids) == self.block_size, "a partial block is indexed"
            assert block.parent_key is not None
            assert chain_key(block.parent_key, block.token_ids) == key, "key is not the hash of its content"
            if not self.chained:
                continue
            if block.parent_key not in self._roots:
                parent = self._index.get(block.parent_key)
                assert parent is not None, f"indexed block {block.block_id} hangs from an unindexed parent"
                assert parent.start_pos + self.block_size == block.start_pos, "chain positions disagree"
                assert block.parent is parent, f"block {block.block_id}: parent link is not its indexed parent"
            else:
                assert block.start_pos == 0, "a root block must start at position 0"
                assert block.parent is None, f"root block {block.block_id} has a parent link"
        self._check_child_lists()

    def _check_child_lists(self) -> None:
        """Every block's child list is doubly linked, holds exactly the indexed blocks whose parent it is,
        and only indexed blocks carry links."""
        listed = 0
        for block in self.blocks:
            if block.key is None:
                assert block.parent is None and block.first_child is None, f"unindexed block {block.block_id} linked"
                assert block.prev_sibling is None and block.next_sibling is None, f"block {block.block_id} linked"
            before, child = None, block.first_child
            while child is not None:
                assert child.parent is block, f"block {child.block_id} is listed under a block not its parent"
                assert child.prev_sibling is before, f"block {child.block_id}: sibling links disagree"
                before, child = child, child.next_sibling
                listed += 1
                assert listed <= self.num_blocks, "a child list loops"
        assert listed == sum(1 for b in self._index.values() if b.parent is not None), "a child is missing from its list"
