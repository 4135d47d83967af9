"""Physical KV blocks: reference counts, the prefix index and eviction (least recently used by default).

Pure Python: no torch, no I/O. The pool only does bookkeeping; the KV tensors live in the model runner
and are addressed by block id. `make` compiles this module, engine/core/block.py and engine/core/eviction.py with
mypyc (build_native.py): the same source, type-checked at run time and about 1.7x faster.

Every block is in exactly one of three states (`BlockState`):

    free        ref_count == 0, no key         -> in the free queue, handed out first by `allocate_blocks`;
                                                  holds no tokens
    evictable   ref_count == 0, key in index   -> held by the eviction policy, kept for prefix hits
    referenced  ref_count  > 0                 -> in neither, held by block tables, never handed out

The free queue is a FIFO of unkeyed blocks: blocks join at the tail and leave from the head, nothing else.
The eviction policy (engine/core/eviction.py) holds the evictable blocks and names the victim when a block
is needed and none is free. The default, LRU, keeps them least recently used first in a doubly linked
list threaded through the blocks themselves (`Block.lru_prev` / `lru_next`, vLLM's design): a release
appends at the tail, an eviction pops the head, and a prefix hit or an out-of-turn eviction unlinks a
block from the middle, each in O(1). The pool tells the policy when blocks become evictable, stop being
evictable, enter the index and leave it; nothing else.

Invariants (checked by `check_invariants`):
  * the free queue, the policy's evictable blocks and the referenced blocks are disjoint and cover the
    pool: the free queue holds exactly the free blocks, the policy exactly the evictable ones, each once;
  * the policy's queues' links agree in both directions, and blocks outside them carry no LRU links;
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
    the index, and every block of an unchained pool, have no tree links.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Sequence

from engine.core.block import Block
from engine.core.errors import NoFreeBlocksError
from engine.core.events import EventKind, EventLog, EvictReason
from engine.core.eviction import EvictionPolicy, EvictionPolicyName, LruPolicy
from engine.core.pool_invariants import BlockState, PoolContents, block_state, check_pool


class BlockPool:
    """A fixed pool of blocks with a prefix index and policy-ordered eviction of unreferenced cached blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        log: EventLog,
        *,
        group: str = "full",
        chained: bool = True,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        """`eviction` orders the evictable blocks: a fresh policy of this pool's own (engine/core/eviction.py's
        `make_eviction_policy`); None gives LRU."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if eviction is not None and len(eviction):
            raise ValueError("an eviction policy serves one pool: pass a fresh one")
        self.block_size = block_size
        self.group = group  # the KV group these blocks serve ("full" or "sliding")
        # A chained index is a tree (see module docstring). A sliding-window group's index is not: its
        # chains keep only their last windows, so a cached block's parent is usually gone. Its hits are
        # confirmed against a chain verified elsewhere (the full group's, or the request's own keys).
        self.chained = chained
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._log = log
        self._clock = log.clock  # one time source for block stamps and events
        self._free: deque[Block] = deque(self.blocks)  # the free blocks, handed out from the left
        self._evictable: EvictionPolicy = LruPolicy() if eviction is None else eviction  # the evictable blocks
        self._victim_reason = EvictReason(self._evictable.name.value)  # its victims' EVICT reason: the policy's name
        self._index: dict[bytes, Block] = {}  # key -> cached block
        self._roots: dict[bytes, str] = {}  # namespace root key -> the namespace text it hashes
        self.num_evictions = 0
        # Told of each unreferenced block the allocator (or its parent's eviction) drops from the index,
        # before the block forgets its key and tokens: the disk tier's `offer` (engine/core/kv_tier.py).
        # Resets and window evictions are not told: their state is dropped on purpose.
        self.on_evict: Callable[[Block], None] | None = None

    # ------------------------------------------------------------------ capacity
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_allocatable(self) -> int:
        """Blocks `allocate_blocks` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix index (referenced or not)."""
        return len(self._index)

    def can_allocate(self, num: int) -> bool:
        """Whether `allocate_blocks(num, ...)` would succeed now: the pool's capacity query, which a
        caller asks once per decision (the KV cache managers' checks) before it commits."""
        return num <= self.num_allocatable

    # ------------------------------------------------------------------ namespaces
    def register_root(self, root_key: bytes, namespace_text: str) -> None:
        """Bind a namespace root key to its text; a second text under the same key is refused."""
        bound = self._roots.setdefault(root_key, namespace_text)
        if bound != namespace_text:
            raise RuntimeError("namespace root key collision: refusing to share a key space")

    # ------------------------------------------------------------------ allocation
    def allocate(self, request_id: str, start_pos: int) -> Block:
        """Hand out one empty block with a single reference (see `allocate_blocks`)."""
        return self.allocate_blocks(1, request_id, start_pos)[0]

    def allocate_blocks(
        self, num: int, request_id: str, start_pos: int, token_ids: list[int] | None = None
    ) -> list[Block]:
        """Hand out `num` blocks with one reference each: free blocks first, then the policy's victims.

        Args:
            num: how many blocks.
            request_id: the request they are for (events).
            start_pos: context position of the first block's slot 0; the others follow contiguously.
            token_ids: what the blocks will hold, `block_size` per block in order (the caller writes the
                KV); None hands them out empty.

        Raises:
            NoFreeBlocksError: fewer than `num` blocks are free or evictable (the caller's check was
                skipped or is stale); nothing changes.
        """
        free = self._free
        available = len(free) + len(self._evictable)
        if num > available:
            raise NoFreeBlocksError(f"{num} blocks asked for, {available} of {self.num_blocks} available")
        bs = self.block_size
        now = self._clock()
        blocks: list[Block] = []
        while len(blocks) < num:
            if free:  # first (again after a victim whose descendants were evicted with it)
                blocks += [free.popleft() for _ in range(min(len(free), num - len(blocks)))]
                continue
            victims = self._evictable.pop_victims(num - len(blocks))
            self._drop_keys(victims, self._victim_reason, request_id)  # `_uncache` in two steps: victims are usually leaves
            blocks += victims
            if victims[-1].first_child is not None:  # only the last victim can still have indexed descendants
                self._drop_descendants(victims[-1], request_id)
        for i, block in enumerate(blocks):
            block.ref_count = 1
            block.token_ids = [] if token_ids is None else token_ids[i * bs : (i + 1) * bs]
            block.start_pos = start_pos + i * bs
            block.created_at = now
            block.last_used = now
            block.hit_count = 0
        if blocks and self._log.recording:
            ids = [block.block_id for block in blocks]
            detail = {"block_ids": ids, "group": self.group}
            self._log.emit(EventKind.ALLOCATE, detail, request_id=request_id, block_id=ids[0], at=now)
        return blocks

    def touch_blocks(self, blocks: Sequence[Block]) -> None:
        """Take one more reference on each block, cached or already referenced (a prefix hit): stamps its
        use and counts the hit. Cached unreferenced blocks stop being evictable. The caller emits the HIT
        event.

        Raises:
            RuntimeError: a block is free (unreferenced and uncached); nothing changes.
        """
        for block in blocks:
            if block.ref_count == 0 and block.key is None:
                raise RuntimeError(f"block {block.block_id} is free; only cached or held blocks can be shared")
        now = self._clock()
        for block in blocks:
            if block.ref_count == 0:
                self._evictable.remove(block)
            block.ref_count += 1
            block.hit_count += 1
            block.last_used = now

    @staticmethod
    def share_held_blocks(blocks: Iterable[Block]) -> None:
        """Take one more reference on blocks a fork's parent table holds. They are referenced, so outside
        the evictable set, and a fork is not a prefix hit: only the reference count changes. The caller emits
        the FORK event."""
        for block in blocks:
            block.ref_count += 1

    def free_blocks(self, blocks: Sequence[Block], request_id: str) -> None:
        """Drop one reference on each block, in order; one RELEASE event for the call.

        At zero a keyed block becomes evictable (released to the policy in this order); an unkeyed one
        joins the free queue. `blocks`
        are distinct, consecutive entries of one block table, in either order, so only an end can be
        partially filled. Callers pass a table's blocks last-first, so a chain's tail is evicted before
        its head.

        Raises:
            RuntimeError: a block has no reference left to drop; nothing changes.
        """
        for block in blocks:
            if block.ref_count < 1:
                raise RuntimeError(f"block {block.block_id} released more often than referenced; nothing released")
        if not blocks:
            return
        # Interior blocks of a table are full: only the two ends can hold fewer tokens.
        first, last = blocks[0], blocks[-1]
        tokens = len(first.token_ids)
        if last is not first:
            tokens += (len(blocks) - 2) * self.block_size + len(last.token_ids)
        now = self._clock()
        evictable = []
        freed = 0
        for block in blocks:
            block.ref_count -= 1
            block.last_used = now
            if block.ref_count == 0:
                freed += 1
                if block.key is None:
                    self._to_free(block)
                else:
                    evictable.append(block)
        if evictable:
            self._evictable.release(evictable)
        if not self._log.recording:
            return
        ids = [block.block_id for block in blocks]
        detail = {"block_ids": ids, "freed": freed, "group": self.group}
        self._log.emit(EventKind.RELEASE, detail, request_id=request_id, block_id=ids[0], tokens=tokens, at=now)

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

    def can_cache(self, block: Block, key: bytes, parent: Block | None, parent_key: bytes) -> bool:
        """Whether `cache` would index the block under `key` (arguments as for `cache`).

        False when the block is partial or already keyed, when the key is already indexed (an identical
        block exists; block tables are append-only, so the duplicate is simply left unindexed), or when
        the parent is not the indexed block under `parent_key` (its chain left the cache, so this block
        could never be matched).

        Raises:
            RuntimeError: a chained pool's first block under a namespace root that was never registered.
        """
        if block.key is not None or len(block.token_ids) != self.block_size or key in self._index:
            return False
        if not self.chained:
            return True
        if parent is None:
            if parent_key not in self._roots:
                raise RuntimeError("caching under an unregistered namespace root")
            return True
        return parent.key == parent_key and self._index.get(parent_key) is parent

    def cache(self, block: Block, key: bytes, parent: Block | None, parent_key: bytes) -> None:
        """Put one full, referenced block into the index: `cache_chain` of that block alone."""
        self.cache_chain([block], [key], parent, parent_key)

    def cache_chain(self, blocks: Sequence[Block], keys: Sequence[bytes], parent: Block | None, parent_key: bytes) -> None:
        """Index consecutive full, referenced blocks of one table as one chain, in one pass (the caller
        emits the CACHE event): each block under its key, hanging from the block before it.

        Args:
            blocks: the full blocks, held by the caller's table, in table order.
            keys: their keys: `keys[i]` is `chain_key(keys[i - 1], blocks[i].token_ids)`, `parent_key` first.
            parent: the indexed block the chain hangs from, as returned by `lookup` for the caller's
                preceding block; None for the first block of a context.
            parent_key: the parent's key, or the namespace root for the first block.

        Raises:
            ValueError: `can_cache` refuses the first block, another is keyed or partial, or a key is
                given twice or already indexed; nothing changes.
        """
        if len(blocks) != len(keys):
            raise ValueError(f"{len(blocks)} blocks and {len(keys)} keys")
        if not blocks:
            return
        index, size = self._index, self.block_size
        if not self.can_cache(blocks[0], keys[0], parent, parent_key):
            raise ValueError(f"block {blocks[0].block_id} cannot be cached under this key and parent")
        if len(set(keys)) != len(keys) or not index.keys().isdisjoint(keys):
            raise ValueError("a key is given twice, or is already indexed")
        for block in blocks:
            if block.key is not None or len(block.token_ids) != size:
                raise ValueError(f"block {block.block_id} is already keyed, or not full")
        linked = self.chained
        for block, key in zip(blocks, keys):
            block.key = key
            block.parent_key = parent_key
            index[key] = block
            if linked and parent is not None:
                first = parent.first_child
                if first is not None:
                    first.prev_sibling = block
                block.next_sibling = first
                block.parent = parent
                parent.first_child = block
            parent, parent_key = block, key
        if self._evictable.tracks_keys:
            for block in blocks:
                self._evictable.cached(block)

    def evict(self, block: Block, reason: EvictReason, request_id: str | None = None) -> None:
        """Evict one unreferenced cached block (and its indexed descendants) to the free queue.

        Raises:
            RuntimeError: the block is not evictable; nothing changes.
        """
        if block.ref_count != 0 or block.key is None:
            raise RuntimeError(f"block {block.block_id} is not an evictable cached block")
        self._evictable.remove(block)
        self._uncache(block, reason, request_id)
        self._to_free(block)

    def reset(self) -> tuple[int, int]:
        """Evict every unreferenced cached block.

        Returns:
            (dropped, still_cached): blocks evicted, and cached blocks kept because they are referenced.
        """
        dropped = 0
        while self._evictable:
            block = self._evictable.pop_victim()
            dropped += 1 + self._uncache(block, EvictReason.RESET, None)
            self._to_free(block)
        return dropped, len(self._index)

    def _uncache(self, block: Block, reason: EvictReason, request_id: str | None) -> int:
        """Remove a block's key and its indexed descendants' keys. Returns how many descendants.

        The block itself must already be out of the evictable set; the caller decides where it goes.
        Unreferenced descendants move from the evictable set to the free queue.
        """
        self._drop_keys((block,), reason, request_id)
        return 0 if block.first_child is None else self._drop_descendants(block, request_id)

    def _drop_descendants(self, block: Block, request_id: str | None) -> int:
        """`_uncache` of the indexed descendants of a block that has just left the index."""
        removed = 0
        subtree = [block]
        while subtree:
            node = subtree.pop()
            while (child := node.first_child) is not None:
                self._drop_keys((child,), EvictReason.PARENT_EVICTED, request_id)  # unlinks it from `node`
                if child.ref_count == 0:
                    self._evictable.remove(child)
                    self._to_free(child)
                subtree.append(child)
                removed += 1
        return removed

    def _to_free(self, block: Block) -> None:
        """Put an unreferenced, unkeyed block at the free queue's tail. It forgets its tokens: a free
        block holds nothing anyone may read (its KV slots are rewritten before they are read again)."""
        block.token_ids = []
        self._free.append(block)

    def _drop_keys(self, blocks: Sequence[Block], reason: EvictReason, request_id: str | None) -> None:
        """Take blocks out of the index, in order (each one's key, its place in its parent's child list)
        and emit their EVICT events. Their own children stay linked to them: the caller evicts those
        (`_drop_descendants`)."""
        index, policy, recording = self._index, self._evictable, self._log.recording
        offer = self.on_evict if reason is not EvictReason.RESET and reason is not EvictReason.WINDOW else None
        for block in blocks:
            if offer is not None and block.ref_count == 0:
                offer(block)
            parent = block.parent
            if parent is not None:
                before, after = block.prev_sibling, block.next_sibling
                if before is None:
                    parent.first_child = after
                else:
                    before.next_sibling = after
                if after is not None:
                    after.prev_sibling = before
                block.parent = block.prev_sibling = block.next_sibling = None
            if policy.tracks_keys:
                policy.uncached(block)
            key = block.key
            del index[key]  # type: ignore[arg-type]
            block.key = None
            block.parent_key = None
            if recording:
                self._emit_evict(block, key, reason, request_id)  # type: ignore[arg-type]
        self.num_evictions += len(blocks)

    def _emit_evict(self, block: Block, key: bytes, reason: EvictReason, request_id: str | None) -> None:
        """The EVICT event of a block that has just left the index (it was under `key`)."""
        now = self._clock()
        detail = {
            "reason": reason.value,
            "key": key.hex(),
            "start_pos": block.start_pos,
            "end_pos": block.start_pos + len(block.token_ids),
            "age_s": now - block.created_at,
            "hit_count": block.hit_count,
            "last_used": block.last_used,
            "group": self.group,
        }
        self._log.emit(
            EventKind.EVICT, detail, request_id=request_id, block_id=block.block_id, tokens=len(block.token_ids), at=now
        )

    # ------------------------------------------------------------------ inspection
    @staticmethod
    def state_of(block: Block) -> BlockState:
        return block_state(block)

    @property
    def eviction_policy(self) -> EvictionPolicyName:
        """The policy that orders the evictable blocks."""
        return self._evictable.name

    def evictable_in_eviction_order(self) -> list[int]:
        """Ids of the evictable blocks, the next victim first (least recently used first under LRU)."""
        return [block.block_id for block in self._evictable.in_eviction_order()]

    def free_in_order(self) -> list[int]:
        """Ids of the free blocks in the order `allocate_blocks` hands them out."""
        return [block.block_id for block in self._free]

    def check_invariants(self) -> None:
        """Raise InvariantError if any pool invariant (module docstring) is broken."""
        parts = (self.blocks, self.block_size, self.chained, self._free, self._evictable, self._index, self._roots)
        check_pool(PoolContents(*parts))
