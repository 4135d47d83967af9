"""A block's history rebuilt from the engine's events agrees with the pool at every moment.

Two property tests replay the events of the KV-cache-manager and the two-group coordinator state machines
(tests/test_kv_cache_manager_properties.py, tests/test_kv_coordinator_properties.py), JSON round-tripped
as the history stores them, and check after every rule, for every block of every group, that the
rebuilt reference count, holders and state are the pool's own. They would fail if any event that
changes a count left out the blocks it changed (as FORK and HIT once did: a count, or the last id).
Scenario tests pin the rows of the exercise the console draws (issue 15).
"""

from __future__ import annotations

import orjson
from hypothesis import settings
from hypothesis.stateful import invariant

from engine.core.block_pool import BlockPool
from engine.core.events import EventKind, EventLog
from engine.core.eviction import EvictionPolicyName
from engine.core.full_attention_manager import FullAttentionManager
from engine.core.namespace import CacheNamespace
from storage.read.block_history import EVICTABLE_FROM_HERE, SAFE_TO_REUSE, StoredEvent, replay, rows_involving
from tests.test_kv_cache_manager_properties import FullAttentionManagerMachine
from tests.test_kv_coordinator_properties import CoordinatorMachine
from tests.manager_support import find_hit, root_key


def stored(events, first_id: int = 0) -> list[StoredEvent]:
    """Events as `storage.read.queries` reads them back: kinds as values, details through JSON."""
    return [
        StoredEvent(first_id + i, e.step, e.time, e.kind.value, e.request_id, e.block_id, orjson.loads(orjson.dumps(e.detail)))
        for i, e in enumerate(events)
    ]


class _RecordsHistory:
    """Mixed into a state machine: keeps every event and checks the replay against the pools."""

    def _keep_events(self) -> None:
        self.history = getattr(self, "history", [])
        self.history += stored(self.log.take(), len(self.history))

    def _check_history(self, managers) -> None:
        self._keep_events()
        for manager in managers:
            pool, holders = manager.pool, manager.holders()
            group = [e for e in self.history if e.detail.get("group", pool.group) == pool.group]
            lives = replay(group, range(pool.num_blocks))
            for block in pool.blocks:
                life = lives[block.block_id]
                assert life.complete
                last = life.rows[-1] if life.rows else None
                assert (last.ref_count if last else 0) == block.ref_count
                assert sorted(last.holders if last else ()) == sorted(holders.get(block.block_id, ()))
                assert (last.state if last else "free") == pool.state_of(block)


class FullAttentionManagerHistoryMachine(_RecordsHistory, FullAttentionManagerMachine):
    policy = EvictionPolicyName.LRU

    @invariant()
    def evictions_only_touch_unreferenced_blocks(self):  # the base drains the log: keep the events instead
        self._keep_events()

    @invariant()
    def history_agrees_with_the_pool(self):
        self._check_history([self.m])


class CoordinatorHistoryMachine(_RecordsHistory, CoordinatorMachine):
    def _run_chunk(self, rid: str) -> None:  # the base drains the log after each chunk: keep the events
        self.kv.finish_chunk(rid, cacheable=self.cacheable[rid])
        self._keep_events()

    @invariant()
    def history_agrees_with_both_pools(self):
        self._check_history(self.kv.managers)


class ReuseLruFullAttentionManagerHistoryMachine(FullAttentionManagerHistoryMachine):
    policy = EvictionPolicyName.REUSE_LRU


TestFullAttentionManagerHistory = FullAttentionManagerHistoryMachine.TestCase
TestFullAttentionManagerHistory.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestReuseLruFullAttentionManagerHistory = ReuseLruFullAttentionManagerHistoryMachine.TestCase
TestReuseLruFullAttentionManagerHistory.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestCoordinatorHistory = CoordinatorHistoryMachine.TestCase
TestCoordinatorHistory.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------------------------- scenarios
def exercise():
    """Issue 15's exercise on a 4-token-block manager: a parent of one full and one half-full block,
    two forks, each appending a different token, then the parent's release and the children's."""
    log = EventLog()
    m = FullAttentionManager(BlockPool(8, 4, log), CacheNamespace("m", "r", "float32", 4, ("full",)), log)
    m.allocate("p", [1, 2, 3, 4, 5, 6], root_key=root_key(m))
    m.cache_full_blocks("p")
    m.fork("p", "a")
    m.fork("p", "b")
    m.append("a", [7])
    m.append("b", [8])
    m.free("p")
    m.free("a")
    m.free("b")
    return stored(log.take())


def rows(life):
    return [(r.event, r.request_id, r.ref_count, r.holders, r.marker) for r in life.rows]


def test_the_shared_tail_goes_1_3_2_1_0_and_is_safe_to_reuse_after_the_parents_release():
    tail = replay(exercise(), [1])[1]
    assert rows(tail) == [
        ("allocate", "p", 1, ("p",), ""),
        ("fork", "a", 2, ("p", "a"), ""),
        ("fork", "b", 3, ("p", "a", "b"), ""),
        ("cow", "a", 2, ("p", "b"), ""),  # a's first append copies the shared tail: a leaves it
        ("cow", "b", 1, ("p",), ""),  # b's copies too: the parent still holds it and may be forked again
        ("release", "p", 0, (), SAFE_TO_REUSE),
    ]
    assert tail.rows[3].change == "copy-on-write: a moved to its copy, block 2 (2 slots copied)"
    assert tail.complete


def test_the_full_block_stays_shared_until_the_last_child_and_then_is_evictable():
    full = replay(exercise(), [0])[0]
    assert [(r.event, r.ref_count) for r in full.rows] == [
        ("allocate", 1), ("cache", 1), ("fork", 2), ("fork", 3), ("release", 2), ("release", 1), ("release", 0),
    ]  # fmt: skip
    assert full.rows[-1].marker == EVICTABLE_FROM_HERE and full.rows[-1].state == "evictable"


def test_each_childs_copy_is_its_own_from_the_copy_to_its_release():
    copies = replay(exercise(), [2, 3])
    assert rows(copies[2])[0] == ("cow", "a", 1, ("a",), "")
    assert copies[2].rows[0].change == "copy-on-write: a's copy of block 1 (2 slots)"
    assert rows(copies[3])[-1] == ("release", "b", 0, (), SAFE_TO_REUSE)


def test_a_cached_block_is_shared_by_a_prefix_hit_then_evicted_with_its_reason_and_freed():
    log = EventLog()
    m = FullAttentionManager(BlockPool(2, 4, log), CacheNamespace("m", "r", "float32", 4, ("full",)), log)
    m.allocate("p", [1, 2, 3, 4, 5], root_key=root_key(m))
    m.cache_full_blocks("p")
    m.free("p")
    m.allocate("h", [9], root_key=root_key(m), hits=find_hit(m, [1, 2, 3, 4, 9]))
    m.free("h")
    m.allocate("q", [7] * 7, root_key=root_key(m))  # needs both blocks: the cached one is evicted
    life = replay(stored(log.take()), [0])[0]
    assert [(r.event, r.request_id, r.ref_count, r.state, r.marker) for r in life.rows] == [
        ("allocate", "p", 1, "referenced", ""),
        ("cache", "p", 1, "referenced", ""),
        ("release", "p", 0, "evictable", EVICTABLE_FROM_HERE),
        ("hit", "h", 1, "referenced", ""),
        ("release", "h", 0, "evictable", EVICTABLE_FROM_HERE),
        ("evict", "q", 0, "free", ""),
        ("allocate", "q", 1, "referenced", ""),
    ]
    assert life.rows[3].change == "shared by a prefix hit of h"
    assert life.rows[5].change == "evicted (lru): left the prefix index"


def test_a_history_that_starts_mid_life_is_shown_from_the_next_allocation_and_flagged():
    events = exercise()
    late = [e for e in events if e.id > 2]  # the parent's allocation was pruned
    tail = replay(late, [1])[1]
    assert tail.rows == [] and not tail.complete


def test_lives_are_cut_at_each_allocation_and_a_requests_stretch_is_picked_out():
    log = EventLog()
    m = FullAttentionManager(BlockPool(1, 4, log), CacheNamespace("m", "r", "float32", 4, ("full",)), log)
    m.allocate("first", [1, 2], root_key=root_key(m))
    m.free("first")
    m.allocate("second", [3], root_key=root_key(m))
    m.free("second")
    m.allocate("third", [4], root_key=root_key(m))
    life = replay(stored(log.take()), [0])[0]
    assert [r.life for r in life.rows] == [0, 0, 1, 1, 2]
    # The row before (the count "second" found) and the row after (what came next) frame its stretch.
    assert [(r.request_id, r.ref_count) for r in rows_involving(life, ["second"])] == [
        ("first", 0), ("second", 1), ("second", 0), ("third", 1),
    ]  # fmt: skip
    assert rows_involving(life, ["nobody"]) == []


def test_events_name_every_block_whose_count_they_change():
    """Regression (issue 15): FORK carried only a count and HIT only its last block id, so no history
    could say which blocks a fork or a prefix hit shared."""
    log = EventLog()
    m = FullAttentionManager(BlockPool(8, 4, log), CacheNamespace("m", "r", "float32", 4, ("full",)), log)
    m.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], root_key=root_key(m))
    m.cache_full_blocks("a")
    m.fork("a", "b")
    m.allocate("c", [9, 9], root_key=root_key(m), hits=find_hit(m, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]))
    by_kind = {e.kind: e.detail for e in log.take()}
    assert by_kind[EventKind.FORK]["block_ids"] == [0, 1, 2]
    assert by_kind[EventKind.HIT]["block_ids"] == [0, 1] and by_kind[EventKind.HIT]["group"] == "full"
