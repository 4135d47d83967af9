"""Property test: LRU's batched victims (`LruPolicy.pop_victims`) evict exactly what one victim at a time
does, in a chained pool where evicting a block takes its indexed descendants with it.

Two pools, one under `LruPolicy` and one under an LRU that gives its victims one per call (the policy
interface's default), get the same random requests: a request may hang a new chain from a cached
block (held or evictable, which it takes a reference on, as a prefix hit does) and releases its blocks
in any order, so a parent can be released before its children and be due before them. After every step
the two pools hand out the same blocks, keep the same index and tree, and queue the same blocks in the
same order; both keep their invariants.
"""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block import Block
from engine.core.block_pool import BlockPool
from engine.core.chain_keys import chain_key
from engine.core.events import EventLog
from engine.core.eviction import EvictionPolicy, LruPolicy

BLOCK_SIZE = 2
NUM_BLOCKS = 6
ROOT = b"\0" * 16


class OneVictimAtATimeLru(LruPolicy):
    """LRU taking one victim per `pop_victims` call: the reference the batched LRU must equal."""

    pop_victims = EvictionPolicy.pop_victims


def state(pool: BlockPool) -> tuple:
    """Everything the two pools must agree on, by block id."""
    ids = lambda block: None if block is None else block.block_id  # noqa: E731
    blocks = [
        (b.ref_count, b.key, b.parent_key, ids(b.parent), ids(b.first_child), ids(b.next_sibling), b.token_ids)
        for b in pool.blocks
    ]
    return blocks, pool.free_in_order(), pool.evictable_in_eviction_order(), pool.num_evictions


class BatchedVictimsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pools = [BlockPool(NUM_BLOCKS, BLOCK_SIZE, EventLog(), eviction=policy)
                      for policy in (LruPolicy(), OneVictimAtATimeLru())]  # fmt: skip
        for pool in self.pools:
            pool.register_root(ROOT, "test")
        self.tables: list[list[int]] = []  # the block ids each running request holds

    @rule(data=st.data(), num=st.integers(1, 4))
    def request(self, data, num):
        """Take a reference on a cached block (or none), allocate `num` blocks and index them as a chain
        hanging from it, unless a key is cached already or the block left the index meanwhile (the
        request holds it, not its ancestors, whose eviction takes it out of the index)."""
        reference = self.pools[0]
        cached = sorted(b.block_id for b in reference.blocks if b.key is not None)
        parent_id = data.draw(st.sampled_from([None, *cached]))
        # Touching an evictable parent takes it out of what can be allocated.
        parent_evictable = parent_id is not None and reference.blocks[parent_id].ref_count == 0
        if not reference.can_allocate(num + parent_evictable):
            return
        contents = data.draw(st.lists(st.integers(0, 3), min_size=num, max_size=num))
        tokens = [token for content in contents for token in [content] * BLOCK_SIZE]
        tables = []
        for pool in self.pools:
            parent: Block | None = None if parent_id is None else pool.blocks[parent_id]
            if parent is not None:
                pool.touch_blocks([parent])
            new = pool.allocate_blocks(num, "r", 0 if parent is None else parent.start_pos + BLOCK_SIZE, tokens)
            parent_key = ROOT if parent is None else parent.key  # None: its own parent's eviction took it
            keys, key = [], parent_key
            for block in new if parent_key is not None else ():
                key = chain_key(key, block.token_ids)
                keys.append(key)
            if keys and len(set(keys)) == len(keys) and all(pool.cached_block(key) is None for key in keys):
                pool.cache_chain(new, keys, parent, parent_key)  # type: ignore[arg-type]
            tables.append(([] if parent is None else [parent.block_id]) + [b.block_id for b in new])
        assert tables[0] == tables[1]
        self.tables.append(tables[0])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        order = data.draw(st.permutations(table))
        for pool in self.pools:
            pool.free_blocks([pool.blocks[b] for b in order], "r")

    @invariant()
    def the_pools_agree(self):
        assert state(self.pools[0]) == state(self.pools[1])
        for pool in self.pools:
            pool.check_invariants()


TestBatchedVictims = BatchedVictimsMachine.TestCase
TestBatchedVictims.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
