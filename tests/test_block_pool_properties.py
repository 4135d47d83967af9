"""Property test: the block pool's two queues keep their order under random allocate / cache / touch /
release / evict / reset sequences.

A model of the pool (a FIFO of free block ids, a list of evictable ids in least-recently-used order,
reference counts, the cached set) predicts exactly which blocks every allocation hands out and in what
order blocks would be evicted; after every step the pool agrees with it and its invariants hold.
The pool is unchained (no prefix tree), so evicting a block never takes descendants with it.
"""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_pool import BlockPool, chain_key
from engine.events import EventLog, EvictReason

BLOCK_SIZE = 2
NUM_BLOCKS = 10
ROOT = b"\0" * 16


class BlockPoolOrderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, EventLog(), group="sliding", chained=False)
        self.free = list(range(NUM_BLOCKS))  # handed out first, from the front
        self.lru = []  # evictable, least recently used first
        self.refs = [0] * NUM_BLOCKS
        self.cached: set[int] = set()
        self.next_token = 0

    def _held(self) -> list[int]:
        return [b for b in range(NUM_BLOCKS) if self.refs[b]]

    @rule(num=st.integers(1, 4), full=st.booleans())
    def allocate(self, num, full):
        if not self.pool.can_allocate(num):
            assert num > len(self.free) + len(self.lru)
            return
        expected = []
        for _ in range(num):
            if self.free:
                expected.append(self.free.pop(0))
            else:
                evicted = self.lru.pop(0)
                self.cached.discard(evicted)
                expected.append(evicted)
        tokens = None
        if full:  # distinct contents, so that every block can be cached under its own key
            tokens = list(range(self.next_token, self.next_token + num * BLOCK_SIZE))
            self.next_token += num * BLOCK_SIZE
        blocks = self.pool.allocate_blocks(num, "r", 0, tokens)
        assert [b.block_id for b in blocks] == expected
        for block_id in expected:
            self.refs[block_id] = 1

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def cache(self, data):
        block = self.pool.blocks[data.draw(st.sampled_from(self._held()))]
        key = chain_key(ROOT, block.token_ids) if len(block.token_ids) == BLOCK_SIZE else b""
        if not self.pool.can_cache(block, key, None, ROOT):
            assert block.block_id in self.cached or len(block.token_ids) < BLOCK_SIZE
            return
        self.pool.cache(block, key, None, ROOT)
        self.cached.add(block.block_id)

    @precondition(lambda self: self._held() or self.lru)
    @rule(data=st.data())
    def touch(self, data):
        """A prefix hit on held or evictable blocks: evictable ones leave the middle of the LRU queue."""
        candidates = self._held() + self.lru
        chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
        self.pool.touch_blocks([self.pool.blocks[b] for b in chosen])
        for block_id in chosen:
            if block_id in self.lru:
                self.lru.remove(block_id)
            self.refs[block_id] += 1

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def release(self, data):
        chosen = data.draw(st.lists(st.sampled_from(self._held()), min_size=1, max_size=3, unique=True))
        self.pool.free_blocks([self.pool.blocks[b] for b in chosen], "r")
        for block_id in chosen:
            self.refs[block_id] -= 1
            if not self.refs[block_id]:
                (self.lru if block_id in self.cached else self.free).append(block_id)

    @precondition(lambda self: self.lru)
    @rule(data=st.data())
    def evict_out_of_turn(self, data):
        block_id = data.draw(st.sampled_from(self.lru))
        self.pool.evict(self.pool.blocks[block_id], EvictReason.WINDOW)
        self.lru.remove(block_id)
        self.cached.discard(block_id)
        self.free.append(block_id)

    @rule()
    def reset(self):
        dropped, kept = self.pool.reset()
        assert (dropped, kept) == (len(self.lru), len(self.cached) - len(self.lru))
        self.cached -= set(self.lru)
        self.free += self.lru
        self.lru = []

    @invariant()
    def queues_are_in_model_order(self):
        assert self.pool.free_in_order() == self.free
        assert self.pool.evictable_in_lru_order() == self.lru
        assert [b.ref_count for b in self.pool.blocks] == self.refs
        self.pool.check_invariants()


TestBlockPoolOrderMachine = BlockPoolOrderMachine.TestCase
TestBlockPoolOrderMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
