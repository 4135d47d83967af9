"""The block pool's states and the check of its invariants (engine/core/block_pool.py states them).

Pure Python: no torch, no I/O. Compiled with the pool by mypyc (build_native.py). The pool hands
`check_pool` its parts as a `PoolContents`; the check reads them and changes nothing.
"""

from __future__ import annotations

import enum
from typing import Mapping, NamedTuple, Sequence

from engine.core.block import Block
from engine.core.chain_keys import chain_key
from engine.core.errors import InvariantError, require
from engine.core.eviction import EvictionPolicy


class BlockState(enum.StrEnum):
    """Where a block is in its life (see engine/core/block_pool.py's module docstring)."""

    FREE = "free"  # unreferenced, unkeyed: handed out first
    EVICTABLE = "evictable"  # unreferenced, cached: kept for prefix hits until evicted
    REFERENCED = "referenced"  # held by at least one block table


def block_state(block: Block) -> BlockState:
    """The state a block's reference count and key put it in."""
    if block.ref_count > 0:
        return BlockState.REFERENCED
    return BlockState.EVICTABLE if block.key is not None else BlockState.FREE


class PoolContents(NamedTuple):
    """What the check reads of one pool: its blocks and where it keeps them."""

    blocks: Sequence[Block]  # every block, by id
    block_size: int
    chained: bool  # whether the index is a tree of chains (a full-attention group's pool)
    free: Sequence[Block]  # the free queue, in the order it hands blocks out
    policy: EvictionPolicy  # holds the evictable blocks
    indexed: Mapping[bytes, Block]  # the prefix index: key -> cached block
    roots: Mapping[bytes, str]  # registered namespace root keys


def check_pool(pool: PoolContents) -> None:
    """Raise InvariantError if any pool invariant is broken."""
    free = [block.block_id for block in pool.free]
    require(len(free) == len(set(free)), "a block is twice in the free queue")
    queued = [block.block_id for block in pool.policy.check_invariants(pool.indexed)]
    evictable = set(queued)
    require(len(queued) == len(evictable) == len(pool.policy), "the policy miscounts its blocks")
    by_state: dict[BlockState, set[int]] = {state: set() for state in BlockState}
    for block in pool.blocks:
        by_state[block_state(block)].add(block.block_id)
        if block.block_id not in evictable:
            require(block.lru_prev is None and block.lru_next is None, f"block {block.block_id}: stray LRU link")
    require(set(free) == by_state[BlockState.FREE], "the free queue is not the free blocks")
    require(evictable == by_state[BlockState.EVICTABLE], "the policy does not hold exactly the evictable blocks")
    for block in pool.blocks:
        require(block.ref_count >= 0, f"block {block.block_id}: negative reference count")
        require(len(block.token_ids) <= pool.block_size, f"block {block.block_id} overflows")
        if block.block_id in by_state[BlockState.FREE]:
            require(not block.token_ids, f"free block {block.block_id} still holds tokens")
        if block.key is not None:
            require(pool.indexed.get(block.key) is block, f"block {block.block_id} key not indexed")
    for key, block in pool.indexed.items():
        _check_indexed(pool, key, block)
    _check_child_lists(pool)


def _check_indexed(pool: PoolContents, key: bytes, block: Block) -> None:
    """An indexed block holds the tokens its key hashes and, in a chained pool, hangs from its parent."""
    require(block.key == key, f"block {block.block_id} is indexed under another key")
    require(len(block.token_ids) == pool.block_size, "a partial block is indexed")
    parent_key = block.parent_key
    if parent_key is None:
        raise InvariantError(f"indexed block {block.block_id} has no parent key")
    require(chain_key(parent_key, block.token_ids) == key, "key is not the hash of its content")
    if not pool.chained:
        return
    if parent_key in pool.roots:
        require(block.start_pos == 0, "a root block must start at position 0")
        require(block.parent is None, f"root block {block.block_id} has a parent link")
        return
    parent = pool.indexed.get(parent_key)
    if parent is None:
        raise InvariantError(f"indexed block {block.block_id} hangs from an unindexed parent")
    require(parent.start_pos + pool.block_size == block.start_pos, "chain positions disagree")
    require(block.parent is parent, f"block {block.block_id}: parent link is not its indexed parent")


def _check_child_lists(pool: PoolContents) -> None:
    """Every block's child list is doubly linked, holds exactly the indexed blocks whose parent it is,
    and only indexed blocks carry links."""
    listed = 0
    for block in pool.blocks:
        if block.key is None:
            require(block.parent is None and block.first_child is None, f"unindexed block {block.block_id} linked")
            require(block.prev_sibling is None and block.next_sibling is None, f"block {block.block_id} linked")
        before, child = None, block.first_child
        while child is not None:
            require(child.parent is block, f"block {child.block_id} is listed under a block not its parent")
            require(child.prev_sibling is before, f"block {child.block_id}: sibling links disagree")
            before, child = child, child.next_sibling
            listed += 1
            require(listed <= len(pool.blocks), "a child list loops")
    indexed_children = sum(1 for b in pool.indexed.values() if b.parent is not None)
    require(listed == indexed_children, "a child is missing from its list")
