"""The engine's eviction policies on their own (engine/core/eviction.py): reuse-LRU's credit, ties, history,
and the misuse every policy refuses. The pool-level properties are in tests/test_block_pool_properties.py."""

from __future__ import annotations

import pytest

from engine.core.block import Block
from engine.core.block_pool import BlockPool
from engine.core.errors import InvariantError
from engine.core.events import EventLog
from engine.core.eviction import EvictionPolicyName, LruPolicy, ReuseLruPolicy, make_eviction_policy


def cached(policy, block_id: int, key: bytes) -> Block:
    block = Block(block_id, key=key)
    policy.cached(block)
    return block


def drain(policy) -> list[int]:
    order = []
    while len(policy):
        order.append(policy.pop_victim().block_id)
    return order


def test_reuse_lru_history_restores_the_tier_of_a_block_that_comes_back():
    def victims_after_return(history_per_block: int) -> list[int]:
        policy = ReuseLruPolicy(1, credit_per_reuse=1.0, history_per_block=history_per_block)  # credit 1 release
        a = cached(policy, 0, b"a")
        policy.release([a])  # release #1
        policy.remove(a)
        a.hit_count += 1  # a prefix hit
        policy.release([a])  # reused: tier 1, release #2
        policy.remove(a)
        policy.uncached(a)  # evicted: the history remembers 2 uses
        a = cached(policy, 0, b"a")  # the same content returns in block 0
        b = cached(policy, 1, b"b")
        policy.release([b])  # release #3: due 3
        policy.release([a])  # release #4: 3 uses -> tier 2 -> due 6 (remembered) or tier 0 -> due 4
        c = cached(policy, 2, b"c")
        policy.release([c])  # release #5: due 5
        return drain(policy)

    assert victims_after_return(4) == [1, 2, 0]
    assert victims_after_return(0) == [1, 0, 2]


def test_reuse_lru_breaks_equal_dues_towards_the_lower_tier():
    policy = ReuseLruPolicy(2, credit_per_reuse=1.0)  # credit 2 releases per reuse
    reused = cached(policy, 0, b"r")
    reused.hit_count = 1  # tier 1: due 1 + 2 = 3
    fresh = [cached(policy, i, bytes([i])) for i in (1, 2)]
    policy.release([reused, *fresh])  # fresh: due 2 and 3
    assert [block.block_id for block in policy.in_eviction_order()] == [1, 2, 0]
    assert drain(policy) == [1, 2, 0]


def test_a_chain_released_tail_first_is_evicted_tail_first_under_both_policies():
    for name in EvictionPolicyName:
        policy = make_eviction_policy(name, 8)
        chain = [cached(policy, i, bytes([i])) for i in range(4)]
        for block in chain:
            block.hit_count = 2 if name is EvictionPolicyName.REUSE_LRU else 0
        policy.release(list(reversed(chain)))
        assert drain(policy) == [3, 2, 1, 0], name


def test_policies_refuse_what_the_pool_never_does():
    policy = ReuseLruPolicy(4)
    block = cached(policy, 0, b"k")
    with pytest.raises(ValueError, match="not evictable"):
        policy.remove(block)
    policy.release([block])
    with pytest.raises(ValueError, match="already evictable"):
        policy.release([block])
    assert drain(policy) == [0]
    with pytest.raises(IndexError):
        policy.pop_victim()
    with pytest.raises(IndexError):
        LruPolicy().pop_victim()


def test_a_policy_serves_one_pool_and_the_pool_checks_it():
    policy = LruPolicy()
    pool = BlockPool(2, 2, EventLog(), chained=False, eviction=policy)
    block = pool.allocate_blocks(1, "r", 0, [1, 2])[0]
    pool.cache(block, b"\0" * 16, None, b"")  # a wrong key: content and key disagree
    pool.free_blocks([block], "r")
    with pytest.raises(ValueError, match="serves one pool"):
        BlockPool(2, 2, EventLog(), eviction=policy)
    with pytest.raises(InvariantError, match="key is not the hash of its content"):
        pool.check_invariants()


def test_lru_takes_a_chain_released_tail_first_in_one_batch_and_stops_at_a_block_with_another_child():
    policy = LruPolicy()
    root, child, other_child, grandchild = (Block(i, key=bytes([i])) for i in range(4))
    child.parent = other_child.parent = root
    root.first_child, child.next_sibling, other_child.prev_sibling = child, other_child, child
    grandchild.parent, child.first_child = child, grandchild
    policy.release([grandchild, child, root, other_child])
    assert [b.block_id for b in policy.pop_victims(4)] == [3, 1, 0]  # root still has other_child: stop there
    assert [b.block_id for b in policy.pop_victims(4)] == [2]
    with pytest.raises(IndexError):
        policy.pop_victims(1)
    policy.release([grandchild, child])
    assert [b.block_id for b in policy.pop_victims(1)] == [3]  # no more than asked for
    assert policy.in_eviction_order() == [child] and child.lru_prev is None
