"""Property test: the two-group coordinator (full + sliding) under random workloads.

Rules submit requests (planning and admitting prefix hits, exact and approximate replays), grow them in
chunks (which releases sliding blocks outside the window), fork them, free them and reset the cache.
After every rule the coordinator's invariants hold, every request has tables in all groups or in none,
each group's table spells out exactly its request's context, and the coordinator's computed length is
the one the rules computed.
"""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.assembly import build_core
from engine.core.chain_keys import ChainKeys
from engine.core.config import EngineConfig
from engine.core.events import EventLog
from engine.core.kv_groups import kv_groups
from engine.core.namespace import CacheNamespace
from engine.core.kv_groups import ReplayMode

BLOCK_SIZE = 2
NUM_BLOCKS = 40
WINDOW = 4
BACKTRACK = 2
SPEC = ("sliding:4", "full")  # one layer of each kind: a hybrid model
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]
tokens = st.lists(st.integers(0, 5), min_size=1, max_size=8)


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        log = EventLog()
        namespace = CacheNamespace("m", "r", "float32", BLOCK_SIZE, SPEC)
        config = EngineConfig(block_size=BLOCK_SIZE, window_backtrack=BACKTRACK, allow_approximate_replay=True)
        self.kv = build_core(config, kv_groups(SPEC), namespace, log, NUM_BLOCKS).kv
        self.log = log
        self.context: dict[str, list[int]] = {}  # every request with tables: its whole context
        self.computed: dict[str, int] = {}  # tokens of it the groups hold
        self.cacheable: dict[str, bool] = {}
        self.gone: set[str] = set()  # requests whose tables were freed (or never made)
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _run_chunk(self, rid: str) -> None:
        """What the engine does after the forward: cache what may be cached, release outside the window."""
        self.kv.finish_chunk(rid, cacheable=self.cacheable[rid])
        self.log.take()

    @rule(stem=st.sampled_from(STEMS), tail=tokens, salt=st.sampled_from([None, "t"]), chunk=st.integers(1, 12))
    def submit(self, stem, tail, salt, chunk):
        prompt = stem + tail
        rid = self._new_id()
        plan = self.kv.plan_hit(prompt, ChainKeys(self.kv.roots.root_key(salt), BLOCK_SIZE))
        assert plan.r <= plan.h <= len(prompt) - 1
        for i, block in enumerate(plan.full_hits):
            assert block.token_ids == prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        first = prompt[plan.r : plan.r + chunk]
        admission = self.kv.plan_admission(plan, len(first))
        if admission is None:
            assert not self.kv.has_table(rid)
            self.gone.add(rid)
            return
        reservation = self.kv.admit(rid, first, admission)
        assert reservation.num_copies == 0  # a new table has no shared partial tail to write into
        self.context[rid] = prompt
        self.computed[rid] = plan.r + len(first)
        self.cacheable[rid] = plan.mode is not ReplayMode.APPROXIMATE
        self._run_chunk(rid)

    @precondition(lambda self: self.context)
    @rule(data=st.data(), n=st.integers(1, 12), new=tokens)
    def grow(self, data, n, new):
        """The next chunk of a request: the rest of its prompt, or (once computed) newly sampled tokens."""
        rid = data.draw(st.sampled_from(sorted(self.context)))
        start = self.computed[rid]
        if start == len(self.context[rid]):
            self.context[rid] = self.context[rid] + new
        chunk = self.context[rid][start : start + n]
        growth = self.kv.plan_append(rid, start, len(chunk))
        if growth is None:
            return
        self.kv.append(rid, chunk, growth)
        self.computed[rid] = start + len(chunk)
        self._run_chunk(rid)

    @precondition(lambda self: self.context)
    @rule(data=st.data(), suffix=tokens)
    def fork(self, data, suffix):
        parent = data.draw(st.sampled_from(sorted(self.context)))
        child = self._new_id()
        shared = self.kv.fork(parent, child)
        assert shared == self.computed[parent]  # what every group holds, not what one group holds
        self.context[child] = self.context[parent] + suffix
        self.computed[child] = shared
        self.cacheable[child] = self.cacheable[parent]

    @precondition(lambda self: self.context)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.context)))
        self.kv.free(rid)
        del self.context[rid], self.computed[rid]
        self.gone.add(rid)

    @rule()
    def reset(self):
        dropped, kept = self.kv.reset_prefix_cache()
        assert all(m.pool.num_evictable == 0 for m in self.kv.managers)
        assert kept == sum(m.pool.num_cached for m in self.kv.managers)

    @invariant()
    def coordinator_invariants_hold(self):
        self.kv.check_invariants()

    @invariant()
    def every_request_has_tables_in_all_groups_or_none(self):
        for rid in self.context:
            assert all(m.has_table(rid) for m in self.kv.managers), rid
        for rid in self.gone:
            assert not any(m.has_table(rid) for m in self.kv.managers), rid

    @invariant()
    def tables_spell_their_contexts(self):
        for rid, context in self.context.items():
            assert self.kv.num_tokens(rid) == self.computed[rid]
            for manager in self.kv.managers:
                block_ids, first_block = manager.live_block_ids(rid)
                held = [t for b in block_ids for t in manager.pool.blocks[b].token_ids]
                start = first_block * BLOCK_SIZE
                assert held == context[start : start + len(held)], (rid, manager.pool.group)
                assert start + len(held) >= self.computed[rid]
            sliding = self.kv.sliding
            block_ids, first_block = sliding.live_block_ids(rid)
            first_needed = max(0, self.computed[rid] - WINDOW + 1) // BLOCK_SIZE  # the next token's window
            assert first_block >= first_needed or len(block_ids) == 1, "a block outside the window is held"


TestCoordinatorMachine = CoordinatorMachine.TestCase
TestCoordinatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
