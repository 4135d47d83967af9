"""Scenario tests for the block pool and KV cache manager: exact block ids, reference counts, orders."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool
from engine.core.errors import InvariantError, NoFreeBlocksError
from engine.core.events import EventKind, EventLog, EvictReason
from engine.core.full_attention_manager import FullAttentionManager
from engine.core.single_type_kv_cache_manager import BlockCopy
from engine.core.namespace import CacheNamespace
from tests.manager_support import find_hit, root_key


def make_manager(num_blocks: int = 8, block_size: int = 4, **ns_overrides) -> FullAttentionManager:
    log = EventLog(clock=iter(range(10**9)).__next__)
    fields = dict(model_id="m", weights_revision="r1", dtype="float32", block_size=block_size, attention_spec=("full",))
    fields.update(ns_overrides)
    return FullAttentionManager(BlockPool(num_blocks, block_size, log), CacheNamespace(**fields), log)


def refs(m: FullAttentionManager, *block_ids: int) -> list[int]:
    return [m.pool.blocks[b].ref_count for b in block_ids]


def prefill(m: FullAttentionManager, rid: str, tokens: list[int], salt: str | None = None) -> list:
    hits = find_hit(m, tokens, salt)
    new = tokens[len(hits) * m.block_size :]
    assert m.can_allocate(len(new), hits)
    m.allocate(rid, new, root_key=root_key(m, salt), hits=hits)
    m.cache_full_blocks(rid)
    return hits


def test_fork_shares_full_and_half_block_then_cow_on_first_append_in_place_on_second():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6])  # one full block, one half-full block
    assert m.block_ids("a") == [0, 1]

    m.fork("a", "b")
    assert m.block_ids("b") == [0, 1]
    assert refs(m, 0, 1) == [2, 2]

    # First writer into the shared half block gets a private copy; the old block loses one reference.
    assert m.can_append("a", 1)
    assert m.append("a", [7]) == 1  # one copy-on-write copy
    assert m.block_ids("a") == [0, 2]
    assert refs(m, 0, 1, 2) == [2, 1, 1]
    assert m.take_copies() == [BlockCopy(src=1, dst=2, num_slots=2)]
    assert m.pool.blocks[2].token_ids == [5, 6, 7]
    assert m.pool.blocks[1].token_ids == [5, 6]

    # The holder left alone writes in place: no copy, no new block.
    assert m.append("b", [8]) == 0
    assert m.block_ids("b") == [0, 1]
    assert m.take_copies() == []
    assert m.pool.blocks[1].token_ids == [5, 6, 8]
    assert refs(m, 0, 1, 2) == [2, 1, 1]
    m.check_invariants()

    # a finishes: its private copy goes free, the shared full block keeps b's reference.
    m.free("a")
    assert refs(m, 0, 1, 2) == [1, 1, 0]
    assert m.pool.state_of(m.pool.blocks[1]) == "referenced"
    # b finishes: only now is the old half block released (it was never keyed, so it goes free).
    m.free("b")
    assert refs(m, 0, 1) == [0, 0]
    assert m.pool.state_of(m.pool.blocks[1]) == "free"
    assert m.pool.state_of(m.pool.blocks[0]) == "evictable"
    m.check_invariants()
    assert m.num_cow_copies == 1


def test_events_record_fork_cow_and_release():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6])
    m.fork("a", "b")
    m.append("b", [9])
    events = m._log.take()
    assert [e.kind for e in events] == [
        EventKind.ALLOCATE, EventKind.CACHE,
        EventKind.FORK,
        EventKind.ALLOCATE, EventKind.RELEASE, EventKind.COW,
    ]
    assert events[0].detail["block_ids"] == [0, 1]  # one event for the call that took both blocks
    # The fork names the blocks it shared, so a block's history can count its references.
    assert events[2].detail == {"parent_id": "a", "shared_blocks": 2, "block_ids": [0, 1], "group": "full"}
    assert events[4].detail["block_ids"] == [1] and events[4].detail["freed"] == 0


def test_prefix_hit_is_capped_so_one_token_is_always_computed():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.free("a")
    assert len(find_hit(m, [1, 2, 3, 4, 5, 6, 7, 8])) == 1  # 8 tokens: cap (8-1)//4 = 1 block
    assert len(find_hit(m, [1, 2, 3, 4, 5, 6, 7, 8, 42])) == 2
    assert len(find_hit(m, [1, 2, 3, 4])) == 0
    assert len(find_hit(m, [1, 2, 3, 9, 5, 6, 7, 8, 42])) == 0  # first block differs


def test_hit_shares_blocks_and_takes_them_out_of_the_lru():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.free("a")
    assert m.pool.evictable_in_eviction_order() == [1, 0]  # released in reverse: tail first
    hits = prefill(m, "b", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11])
    assert [b.block_id for b in hits] == [0, 1]
    assert m.block_ids("b") == [0, 1, 3]  # free blocks are used before evicting cached ones
    assert refs(m, 0, 1) == [1, 1]
    assert m.pool.blocks[0].hit_count == 1
    assert m.pool.evictable_in_eviction_order() == []
    m.check_invariants()


def test_a_fork_takes_references_without_counting_a_prefix_hit():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6])
    head = m.pool.blocks[0]
    stamped = head.last_used
    m.fork("a", "b")
    assert (head.ref_count, head.hit_count, head.last_used) == (2, 0, stamped)  # a fork is not a hit
    m.free("a")
    m.free("b")
    released = head.last_used
    assert released > stamped  # the last release stamps it
    prefill(m, "c", [1, 2, 3, 4, 7])
    assert (head.ref_count, head.hit_count) == (1, 1) and head.last_used > released  # a prefix hit counts
    m.check_invariants()


def test_lru_eviction_order_and_event_detail():
    m = make_manager(num_blocks=4)
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0, 1 cached, block 2 partial
    m.free("a")  # free order: 2 (free list), 1, 0 (LRU)
    m._log.take()
    prefill(m, "b", [20, 21, 22, 23, 24, 25, 26, 27, 28])  # needs 3 blocks: 3, 2, then evicts 1
    assert m.block_ids("b") == [3, 2, 1]
    evicts = [e for e in m._log.take() if e.kind == EventKind.EVICT]
    assert [(e.block_id, e.detail["reason"]) for e in evicts] == [(1, "lru")]
    assert evicts[0].detail["start_pos"] == 4 and evicts[0].detail["end_pos"] == 8
    assert evicts[0].request_id == "b"
    m.check_invariants()


def test_lru_order_is_release_order_through_many_reuses():
    """A hot block shared and released again and again moves to the LRU tail each time (out of the middle
    of the queue and back), the queue holds nothing but the evictable blocks, and eviction still takes the
    coldest block first."""
    m = make_manager(num_blocks=4)
    prefill(m, "cold", [1, 2, 3, 4, 0])  # block 0: cold prefix
    prefill(m, "hot", [9, 9, 9, 9, 0])  # block 2: hot prefix (1 and 3 are the partial tails)
    m.free("cold")
    m.free("hot")
    assert m.pool.evictable_in_eviction_order() == [0, 2]
    for i in range(50):  # far more releases than the pool has blocks
        hits = prefill(m, f"h{i}", [9, 9, 9, 9, i])
        assert [b.block_id for b in hits] == [2]
        m.free(f"h{i}")
        assert m.pool.evictable_in_eviction_order() == [0, 2]
        assert m.pool.num_evictable == len(m.pool.evictable_in_eviction_order()) == 2  # no dead entries
        m.check_invariants()
    m._log.take()
    prefill(m, "new", [5, 6, 7, 8, 5, 6, 7, 8, 5])  # 3 blocks: 2 free, then the coldest cached (0)
    evicted = [e.block_id for e in m._log.take() if e.kind == EventKind.EVICT]
    assert evicted == [0]
    assert m.pool.evictable_in_eviction_order() == [2]
    m.check_invariants()


def test_sharing_a_free_block_is_refused_and_changes_nothing():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.free("a")  # blocks 0 and 1 cached and evictable, block 2 (partial) free
    blocks = [m.pool.blocks[0], m.pool.blocks[1], m.pool.blocks[2]]
    before = ([b.ref_count for b in m.pool.blocks], m.pool.evictable_in_eviction_order(), m.pool.num_evictable)
    with pytest.raises(RuntimeError, match="block 2 is free"):
        m.pool.touch_blocks(blocks)
    assert ([b.ref_count for b in m.pool.blocks], m.pool.evictable_in_eviction_order(), m.pool.num_evictable) == before
    m.check_invariants()


def test_releasing_a_block_too_often_is_refused_and_changes_nothing():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks = [m.pool.blocks[b] for b in m.block_ids("a")]
    m.free("a")
    before = ([b.ref_count for b in m.pool.blocks], m.pool.evictable_in_eviction_order(), m.pool.num_free)
    log_len = len(m._log)
    with pytest.raises(RuntimeError, match="released more often"):
        m.pool.free_blocks(blocks, "a")
    assert ([b.ref_count for b in m.pool.blocks], m.pool.evictable_in_eviction_order(), m.pool.num_free) == before
    assert len(m._log) == log_len
    m.check_invariants()

    prefill(m, "b", [1, 2, 3, 4, 20])  # block 0 referenced again, block 1 still cached, 2 free
    held = m.pool.blocks[m.block_ids("b")[0]]
    before = ([b.ref_count for b in m.pool.blocks], m.pool.evictable_in_eviction_order(), m.pool.num_free)
    with pytest.raises(RuntimeError, match="released more often"):
        m.pool.free_blocks([held, m.pool.blocks[1]], "b")  # the first would succeed, the second cannot
    assert ([b.ref_count for b in m.pool.blocks], m.pool.evictable_in_eviction_order(), m.pool.num_free) == before
    m.check_invariants()

    # Blocks that would stay referenced (shared by a fork) or go back to the free queue (the partial tail)
    # ahead of the failing one: their states and both queues' orders are unchanged too.
    m.fork("b", "c")
    tail, head = (m.pool.blocks[b] for b in m.block_ids("b")[::-1])
    assert (tail.ref_count, head.ref_count, tail.key, head.key is not None) == (2, 2, None, True)
    m.free("c")  # tail and head back to one reference each
    before = ([(b.ref_count, m.pool.state_of(b)) for b in m.pool.blocks], m.pool.evictable_in_eviction_order(),
              m.pool.free_in_order())  # fmt: skip
    with pytest.raises(RuntimeError, match="released more often"):
        m.pool.free_blocks([tail, head, m.pool.blocks[1]], "b")
    after = ([(b.ref_count, m.pool.state_of(b)) for b in m.pool.blocks], m.pool.evictable_in_eviction_order(),
             m.pool.free_in_order())  # fmt: skip
    assert after == before
    m.check_invariants()


def test_evicting_a_parent_drops_its_cached_descendants():
    m = make_manager(num_blocks=4)
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.free("a")
    m.pool.evict(m.pool.blocks[0], EvictReason.LRU)
    assert m.pool.num_cached == 0
    assert m.pool.state_of(m.pool.blocks[1]) == "free"
    reasons = [e.detail["reason"] for e in m._log.take() if e.kind == EventKind.EVICT]
    assert reasons == ["lru", "parent_evicted"]
    m.check_invariants()


def test_a_check_that_says_no_changes_nothing_and_the_pool_refuses_blocks_it_lacks():
    # The commits (`allocate`, `append`) trust their check and do not ask the pool again; the pool's own
    # guard still refuses an allocation it cannot supply, before it changes anything.
    m = make_manager(num_blocks=2)
    prefill(m, "a", [1, 2, 3, 4, 5])
    before = (m.block_ids("a"), refs(m, 0, 1), m.pool.num_allocatable)
    assert not m.can_allocate(9)
    assert m.blocks_to_allocate(9) == 3
    assert not m.has_table("b")
    assert not m.can_append("a", 4)
    assert m.blocks_to_append("a", 4) == 1  # the tail has room for 3 of them
    assert (m.block_ids("a"), refs(m, 0, 1), m.pool.num_allocatable) == before
    with pytest.raises(NoFreeBlocksError):
        m.pool.allocate("x", 0)
    with pytest.raises(NoFreeBlocksError):
        m.pool.allocate_blocks(3, "b", 0, list(range(100, 109)))
    assert (m.block_ids("a"), refs(m, 0, 1), m.pool.num_allocatable) == before
    m.check_invariants()


def test_reset_drops_unreferenced_cached_blocks_and_reports_referenced_ones():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(m, "b", [30, 31, 32, 33, 34])
    m.free("a")
    dropped, kept = m.reset_prefix_cache()
    assert (dropped, kept) == (2, 1)  # a's two blocks dropped, b's full block is in use
    assert find_hit(m, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == []
    m.check_invariants()


def test_duplicate_content_is_not_indexed_twice_and_chain_continues():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5])
    prefill(m, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # hits a's first block
    assert m.block_ids("b")[0] == m.block_ids("a")[0]
    assert m.pool.num_cached == 2
    m.check_invariants()


@pytest.mark.parametrize(
    "override",
    [
        {"weights_revision": "r2"},
        {"dtype": "bfloat16"},
        {"model_id": "other"},
        {"attention_spec": ("sliding:4",)},
        {"kv_layout_version": 2},
    ],
)
def test_same_tokens_under_another_namespace_never_hit(override):
    log = EventLog()
    pool = BlockPool(8, 4, log)
    base = dict(model_id="m", weights_revision="r1", dtype="float32", block_size=4, attention_spec=("full",))
    first = FullAttentionManager(pool, CacheNamespace(**base), log)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prefill(first, "a", tokens)
    second = FullAttentionManager(pool, CacheNamespace(**{**base, **override}), log)
    assert find_hit(second, tokens) == []
    assert len(find_hit(first, tokens)) == 2


def test_another_block_size_never_hits():
    a = CacheNamespace("m", "r1", "float32", 4, ("full",))
    b = CacheNamespace("m", "r1", "float32", 8, ("full",))
    assert a.root_key() != b.root_key()


def test_salt_isolates_tenants():
    m = make_manager()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prefill(m, "a", tokens, salt="tenant-a")
    assert find_hit(m, tokens, "tenant-b") == []
    assert find_hit(m, tokens) == []
    assert len(find_hit(m, tokens, "tenant-a")) == 2


def test_lookup_confirms_tokens_so_a_forged_key_cannot_hit():
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5])
    block = m.pool.blocks[0]
    # Same key, different tokens (as a hash collision would present it): refused.
    assert m.pool.lookup(block.key, block.parent_key, [9, 9, 9, 9]) is None
    assert m.pool.lookup(block.key, b"\0" * 16, [1, 2, 3, 4]) is None
    assert m.pool.lookup(block.key, block.parent_key, [1, 2, 3, 4]) is block


def test_fork_of_unknown_parent_is_an_error_and_changes_nothing():
    m = make_manager()
    with pytest.raises(KeyError):
        m.fork("nope", "child")
    assert not m.has_table("child")
    m.check_invariants()


def test_broken_invariants_raise_invariant_error_not_assertion_error():
    """`check_invariants` raises its own error, so `python -O` (which drops asserts) checks the same."""
    m = make_manager()
    prefill(m, "a", [1, 2, 3, 4, 5])
    m.pool.blocks[0].ref_count += 1  # a reference no table holds
    with pytest.raises(InvariantError, match="holders"):
        m.check_invariants()
    m.pool.blocks[0].ref_count -= 1
    m.free("a")
    assert m.pool.evictable_in_eviction_order() == [0]
    m.pool.blocks[0].lru_next = m.pool.blocks[3]  # a stray link out of the LRU queue
    with pytest.raises(InvariantError, match="LRU"):
        m.check_invariants()
