"""Property test: the block pool's free queue and eviction order under random allocate / cache / touch /
release / evict / reset sequences, for each eviction policy.

A model of the pool (a FIFO of free block ids, the evictable ids with their release numbers and tiers,
reference counts, the cached set, reuse-LRU's history of evicted keys) predicts exactly which blocks
every allocation hands out and in what order blocks would be evicted; after every step the pool agrees
with it and its invariants hold. The pool is unchained (no prefix tree), so evicting a block never takes
descendants with it.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_pool import BlockPool
from engine.core.chain_keys import chain_key
from engine.core.events import EventLog, EvictReason
from engine.core.eviction import EvictionPolicyName, LruPolicy, ReuseLruPolicy

BLOCK_SIZE = 2
NUM_BLOCKS = 5
ROOT = b"\0" * 16
# Small reuse-LRU settings, so that credit and history decide orders within a short run.
CREDIT_PER_REUSE, MAX_TIER, HISTORY_PER_BLOCK = 0.4, 2, 1  # credit 2 releases per reuse, history 5 keys


class BlockPoolOrderMachine(RuleBasedStateMachine):
    policy: EvictionPolicyName

    def __init__(self) -> None:
        super().__init__()
        if self.policy is EvictionPolicyName.LRU:
            eviction = LruPolicy()
        else:
            eviction = ReuseLruPolicy(
                NUM_BLOCKS, credit_per_reuse=CREDIT_PER_REUSE, max_tier=MAX_TIER, history_per_block=HISTORY_PER_BLOCK
            )
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, EventLog(), group="sliding", chained=False, eviction=eviction)
        self.free = list(range(NUM_BLOCKS))  # handed out first, from the front
        self.evictable: dict[int, tuple[int, int]] = {}  # block -> (release number, tier)
        self.releases = 0
        self.refs = [0] * NUM_BLOCKS
        self.cached: dict[int, bytes] = {}  # block -> key
        self.uses: dict[int, int] = {}  # cached block -> uses as reuse-LRU counts them
        self.history: OrderedDict[bytes, int] = OrderedDict()  # evicted key -> uses (reuse-LRU)

    # ------------------------------------------------------------------ the model's order
    def _due(self, block: int) -> tuple[float, int, int]:
        released, tier = self.evictable[block]
        if self.policy is EvictionPolicyName.LRU:
            return released, 0, 0
        return released + tier * CREDIT_PER_REUSE * NUM_BLOCKS, tier, released

    def _order(self) -> list[int]:
        return sorted(self.evictable, key=self._due)

    def _uncache(self, block: int) -> None:
        key = self.cached.pop(block)
        uses = self.uses.pop(block)
        self.history[key] = uses
        while len(self.history) > HISTORY_PER_BLOCK * NUM_BLOCKS:
            self.history.popitem(last=False)

    def _held(self) -> list[int]:
        return [b for b in range(NUM_BLOCKS) if self.refs[b]]

    # ------------------------------------------------------------------ rules
    @rule(data=st.data(), num=st.integers(1, 4), full=st.booleans())
    def allocate(self, data, num, full):
        if not self.pool.can_allocate(num):
            assert num > len(self.free) + len(self.evictable)
            return
        expected = []
        for _ in range(num):
            if self.free:
                expected.append(self.free.pop(0))
            else:
                victim = self._order()[0]
                del self.evictable[victim]
                self._uncache(victim)
                expected.append(victim)
        tokens = None
        if full:  # contents from a small alphabet: duplicates, and keys the history remembers, come back
            contents = data.draw(st.lists(st.integers(0, 5), min_size=num, max_size=num))
            tokens = [token for content in contents for token in [content] * BLOCK_SIZE]
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
            assert block.block_id in self.cached or len(block.token_ids) < BLOCK_SIZE or key in self.cached.values()
            return
        self.pool.cache(block, key, None, ROOT)
        self.cached[block.block_id] = key
        self.uses[block.block_id] = 1 + self.history.pop(key, 0)

    @precondition(lambda self: [b for b in self._held() if b in self.cached] or self.evictable)
    @rule(data=st.data())
    def touch(self, data):
        """A prefix hit on cached blocks, held or evictable: evictable ones leave the eviction order."""
        candidates = sorted({b for b in self._held() if b in self.cached} | set(self.evictable))
        chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
        self.pool.touch_blocks([self.pool.blocks[b] for b in chosen])
        for block_id in chosen:
            self.evictable.pop(block_id, None)
            self.refs[block_id] += 1
            self.uses[block_id] += 1

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def release(self, data):
        chosen = data.draw(st.lists(st.sampled_from(self._held()), min_size=1, max_size=3, unique=True))
        self.pool.free_blocks([self.pool.blocks[b] for b in chosen], "r")
        for block_id in chosen:
            self.refs[block_id] -= 1
            if self.refs[block_id]:
                continue
            if block_id in self.cached:
                self.releases += 1
                self.evictable[block_id] = (self.releases, min(self.uses[block_id] - 1, MAX_TIER))
            else:
                self.free.append(block_id)

    @precondition(lambda self: self.evictable)
    @rule(data=st.data())
    def evict_out_of_turn(self, data):
        block_id = data.draw(st.sampled_from(sorted(self.evictable)))
        self.pool.evict(self.pool.blocks[block_id], EvictReason.WINDOW)
        del self.evictable[block_id]
        self._uncache(block_id)
        self.free.append(block_id)

    @rule()
    def reset(self):
        dropped, kept = self.pool.reset()
        assert (dropped, kept) == (len(self.evictable), len(self.cached) - len(self.evictable))
        for block_id in self._order():
            self._uncache(block_id)
            self.free.append(block_id)
        self.evictable = {}

    @invariant()
    def queues_are_in_model_order(self):
        assert self.pool.free_in_order() == self.free
        assert self.pool.evictable_in_eviction_order() == self._order()
        assert [b.ref_count for b in self.pool.blocks] == self.refs
        self.pool.check_invariants()


def machine_for(policy: EvictionPolicyName):
    return type(f"{policy.name}PoolMachine", (BlockPoolOrderMachine,), {"policy": policy})


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLruPoolOrder = machine_for(EvictionPolicyName.LRU).TestCase
TestReuseLruPoolOrder = machine_for(EvictionPolicyName.REUSE_LRU).TestCase
TestLruPoolOrder.settings = TestReuseLruPoolOrder.settings = SETTINGS
