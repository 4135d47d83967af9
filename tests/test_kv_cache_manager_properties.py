"""Property test: random submit / fork / in-flight share / append / finish / retain / release / evict /
reset sequences, under each eviction policy of the pool.

After every step the pool and table invariants hold, and every live table's blocks spell out exactly
its request's context (so sharing and copy-on-write never let one request see another's tokens).
"""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_pool import BlockPool
from engine.core.events import EventKind, EventLog, EvictReason
from engine.core.eviction import EvictionPolicyName, make_eviction_policy
from engine.core.full_attention_manager import FullAttentionManager
from engine.core.namespace import CacheNamespace
from tests.manager_support import find_hit, root_key

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# A small alphabet and a few shared stems make prefix hits and duplicate blocks common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
tokens = st.lists(st.integers(0, 6), min_size=1, max_size=14)


class FullAttentionManagerMachine(RuleBasedStateMachine):
    policy: EvictionPolicyName

    def __init__(self) -> None:
        super().__init__()
        self.log = EventLog()
        ns = CacheNamespace("m", "r", "float32", BLOCK_SIZE, ("full",))
        pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, self.log, eviction=make_eviction_policy(self.policy, NUM_BLOCKS))
        self.m = FullAttentionManager(pool, ns, self.log)
        self.context: dict[str, list[int]] = {}  # live tables: expected tokens
        self.retained: set[str] = set()
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    @rule(stem=st.sampled_from(STEMS), tail=tokens, salt=st.sampled_from([None, "t1"]))
    def submit(self, stem, tail, salt):
        prompt = stem + tail
        rid = self._new_id()
        hits = find_hit(self.m, prompt, salt)
        assert len(hits) * BLOCK_SIZE <= len(prompt) - 1
        for i, block in enumerate(hits):
            assert block.token_ids == prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        new = prompt[len(hits) * BLOCK_SIZE :]
        if self.m.can_allocate(len(new), hits):
            self.m.allocate(rid, new, root_key=root_key(self.m, salt), hits=hits)
            self.m.cache_full_blocks(rid)
            self.context[rid] = prompt
        else:
            assert not self.m.has_table(rid)

    @precondition(lambda self: self.context)
    @rule(data=st.data(), suffix=tokens)
    def fork(self, data, suffix):
        parent = data.draw(st.sampled_from(sorted(self.context)))
        child = self._new_id()
        self.m.fork(parent, child)
        self.context[child] = list(self.context[parent])
        if self.m.can_append(child, len(suffix)):
            self.m.append(child, suffix)
            self.m.cache_full_blocks(child)
            self.context[child] += suffix
        else:
            self.m.free(child)
            del self.context[child]

    @rule(stem=st.sampled_from(STEMS), holder_tail=tokens, tail=tokens, salt=st.sampled_from([None, "t1"]), fails=st.booleans())
    def share_in_flight(self, stem, holder_tail, tail, salt, fails):
        """One step of a burst: a holder's prompt reserved, a new request sharing its full leading blocks
        before they are computed, then the forward: both keyed in chunk order, or (the holder's forward
        went non-finite) both freed, nothing of theirs entering the index."""
        holder_prompt, prompt = stem + holder_tail, stem + tail
        hits = find_hit(self.m, holder_prompt, salt)
        new = holder_prompt[len(hits) * BLOCK_SIZE :]
        if not self.m.can_allocate(len(new), hits):
            return
        indexed_before = {b.key for b in self.m.pool.blocks if b.key is not None}
        holder = self._new_id()
        root = root_key(self.m, salt)
        self.m.allocate(holder, new, root_key=root, hits=hits)
        common = next((i for i, (a, b) in enumerate(zip(holder_prompt, prompt)) if a != b), min(len(prompt), len(holder_prompt)))
        num_blocks = min(common, len(prompt) - 1) // BLOCK_SIZE  # the hit cap: its last token is computed
        rids = [holder]
        if num_blocks and self.m.can_allocate(len(prompt) - num_blocks * BLOCK_SIZE):
            rids.append(self._new_id())
            self.m.share_leading_blocks(holder, rids[1], num_blocks, prompt[num_blocks * BLOCK_SIZE :], root_key=root)
            assert self.m.block_ids(rids[1])[:num_blocks] == self.m.block_ids(holder)[:num_blocks]
        if fails:
            for rid in reversed(rids):
                self.m.free(rid)
            assert {b.key for b in self.m.pool.blocks if b.key is not None} <= indexed_before  # (allocation may evict)
            return
        for rid, context in zip(rids, (holder_prompt, prompt)):
            self.m.cache_full_blocks(rid)
            self.context[rid] = context

    @precondition(lambda self: self.context)
    @rule(data=st.data(), new=tokens)
    def append(self, data, new):
        rid = data.draw(st.sampled_from(sorted(self.context)))
        if rid in self.retained:
            return
        if self.m.can_append(rid, len(new)):
            self.m.append(rid, new)
            self.m.cache_full_blocks(rid)
            self.context[rid] += new

    @precondition(lambda self: self.context)
    @rule(data=st.data(), retain=st.booleans())
    def finish(self, data, retain):
        rid = data.draw(st.sampled_from(sorted(self.context)))
        if rid in self.retained:
            return
        if retain:
            self.retained.add(rid)
        else:
            self.m.free(rid)
            del self.context[rid]

    @precondition(lambda self: self.retained)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.retained)))
        self.retained.discard(rid)
        self.m.free(rid)
        del self.context[rid]

    @precondition(lambda self: self.m.pool.num_evictable)
    @rule()
    def evict_the_next_victim(self):
        block_id = self.m.pool.evictable_in_eviction_order()[0]
        self.m.pool.evict(self.m.pool.blocks[block_id], EvictReason.LRU)

    @rule()
    def reset(self):
        dropped, kept = self.m.reset_prefix_cache()
        assert self.m.pool.num_evictable == 0
        assert kept == self.m.pool.num_cached

    @rule()
    def drain_copies(self):
        for copy in self.m.take_copies():
            assert copy.src != copy.dst
            assert 0 < copy.num_slots < BLOCK_SIZE  # only partial tails are ever copied

    @invariant()
    def invariants_hold(self):
        self.m.check_invariants()

    @invariant()
    def tables_spell_their_contexts(self):
        for rid, expected in self.context.items():
            blocks = [self.m.pool.blocks[b] for b in self.m.block_ids(rid)]
            assert [t for b in blocks for t in b.token_ids] == expected

    @invariant()
    def evictions_only_touch_unreferenced_blocks(self):
        """An evicted block is unreferenced, unless it was allocated again after its eviction (and then
        possibly shared in the same rule, as an in-flight hit shares its holder's new blocks)."""
        events = self.log.take()
        for i, event in enumerate(events):
            if event.kind == EventKind.EVICT and event.detail["reason"] in ("lru", "reuse-lru", "reset"):
                reallocated = any(
                    later.kind == EventKind.ALLOCATE and event.block_id in later.detail["block_ids"]
                    for later in events[i + 1 :]
                )
                assert reallocated or self.m.pool.blocks[event.block_id].ref_count == 0


def machine_for(policy: EvictionPolicyName):
    return type(f"{policy.name}ManagerMachine", (FullAttentionManagerMachine,), {"policy": policy})


TestFullAttentionManagerMachine = machine_for(EvictionPolicyName.LRU).TestCase
TestReuseLruFullAttentionManagerMachine = machine_for(EvictionPolicyName.REUSE_LRU).TestCase
TestFullAttentionManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestReuseLruFullAttentionManagerMachine.settings = TestFullAttentionManagerMachine.settings
