"""One physical KV block's record: the bookkeeping the block pool keeps per block.

Pure Python: no torch, no I/O. The block pool (engine/core/block_pool.py) owns every field: its reference
count, its place in the prefix index and the index's tree, its stamps. The eviction policies
(engine/core/eviction.py) thread their queues through `lru_prev` / `lru_next`. The KV tensors themselves
live in the model runner, addressed by `block_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block of `block_size` token slots."""

    block_id: int
    token_ids: list[int] = field(default_factory=list)  # filled slots, in order
    ref_count: int = 0  # number of block-table entries pointing here
    start_pos: int = 0  # context position of slot 0 for its current holders
    key: bytes | None = None  # set while the block is in the prefix index
    parent_key: bytes | None = None  # the key its chain hangs from (namespace root for block 0)
    created_at: float = 0.0  # when the pool last handed it out (`allocate_blocks`)
    # Last allocation, prefix hit or release. A fork's share is not stamped: the parent holds the block,
    # so it cannot be evicted before a release stamps it again.
    last_used: float = 0.0
    hit_count: int = 0  # prefix hits (index lookups that reused it) since allocation; forks are not hits
    lru_prev: Block | None = field(default=None, repr=False)  # LRU-queue neighbour towards the head
    lru_next: Block | None = field(default=None, repr=False)  # LRU-queue neighbour towards the tail
    # Prefix-tree links while indexed in a chained pool (the index's tree: engine/core/block_pool.py).
    parent: Block | None = field(default=None, repr=False)
    first_child: Block | None = field(default=None, repr=False)
    next_sibling: Block | None = field(default=None, repr=False)
    prev_sibling: Block | None = field(default=None, repr=False)
