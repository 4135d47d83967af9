"""`BlockPool.cache_chain`: a run of a table's full blocks indexed in one pass is exactly `cache` block by
block, and a chain it refuses changes nothing (the analyzer's replays and the engine share the pool)."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool
from engine.core.chain_keys import chain_key
from engine.core.events import EventLog

BLOCK_SIZE = 2
ROOT = b"\0" * 16


def pool_with_blocks(contents: list[int]) -> tuple[BlockPool, list, list[bytes]]:
    """A chained pool of 8 blocks, one referenced full block per content, and their chain keys."""
    pool = BlockPool(8, BLOCK_SIZE, EventLog())
    pool.register_root(ROOT, "test")
    tokens = [token for content in contents for token in [content] * BLOCK_SIZE]
    blocks = pool.allocate_blocks(len(contents), "r", 0, tokens)
    keys, key = [], ROOT
    for block in blocks:
        key = chain_key(key, block.token_ids)
        keys.append(key)
    return pool, blocks, keys


def tree(pool: BlockPool) -> list[tuple]:
    """Every block's index state and tree links, by block id."""
    ids = lambda block: None if block is None else block.block_id  # noqa: E731
    return [
        (b.key, b.parent_key, ids(b.parent), ids(b.first_child), ids(b.next_sibling), ids(b.prev_sibling))
        for b in pool.blocks
    ]


def test_a_chain_indexed_in_one_pass_equals_caching_block_by_block() -> None:
    chained, blocks, keys = pool_with_blocks([1, 2, 3])
    chained.cache(blocks[0], keys[0], None, ROOT)
    chained.cache_chain(blocks[1:], keys[1:], blocks[0], keys[0])
    one_by_one, singles, _ = pool_with_blocks([1, 2, 3])
    parent, parent_key = None, ROOT
    for block, key in zip(singles, keys):
        one_by_one.cache(block, key, parent, parent_key)
        parent, parent_key = block, key
    assert tree(chained) == tree(one_by_one)
    assert chained.lookup(keys[2], keys[1], [3, 3]) is blocks[2]
    chained.check_invariants()
    chained.free_blocks(blocks[::-1], "r")
    chained.check_invariants()


@pytest.mark.parametrize(
    "spoil",
    ["partial block", "key already indexed", "key given twice", "block already keyed", "fewer keys", "wrong parent"],
)
def test_a_refused_chain_changes_nothing(spoil: str) -> None:
    pool, blocks, keys = pool_with_blocks([1, 2, 3, 4])
    pool.cache(blocks[0], keys[0], None, ROOT)
    chain, chain_keys, parent, parent_key = blocks[1:], list(keys[1:]), blocks[0], keys[0]
    if spoil == "partial block":
        chain[2].token_ids = chain[2].token_ids[:1]
    elif spoil == "key already indexed":
        chain_keys[1] = keys[0]
    elif spoil == "key given twice":
        chain_keys[2] = chain_keys[0]
    elif spoil == "block already keyed":
        chain = [chain[0], blocks[0], chain[2]]
    elif spoil == "fewer keys":
        chain_keys = chain_keys[:2]
    else:
        parent_key = ROOT  # blocks[0] is not indexed under the root key
    before = tree(pool)
    with pytest.raises(ValueError):
        pool.cache_chain(chain, chain_keys, parent, parent_key)
    assert tree(pool) == before
    assert pool.num_cached == 1
    pool.check_invariants()
