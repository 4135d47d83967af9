"""An admission's capacity is decided once, and a waiting request's chain keys are hashed once.

The scheduler asks whether a waiting request can start; the answer (`Admission`) carries what its start
commits, so neither the coordinator, nor a manager, nor the pool asks the pool again when it commits.
A request that cannot start keeps its chain keys (`Request.lookup_keys`): the lookups it repeats each
step hash none of its blocks again.
"""

from __future__ import annotations

import struct

import pytest
import xxhash

from engine.core.assembly import build_core
from engine.core.config import EngineConfig
from engine.core.events import EventLog
from engine.core.kv_groups import kv_groups
from engine.core.namespace import CacheNamespace
from engine.core.request import HitSource, Request, SamplingParams

BLOCK_SIZE = 4
CAPACITY_QUERIES = ("can_allocate", "num_allocatable", "num_free", "num_evictable")


class CountingPool:
    """A block pool seen through its capacity queries: every other attribute passes straight through."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self.queries = 0

    def __getattr__(self, name):
        if name in CAPACITY_QUERIES:
            self.queries += 1
        return getattr(self._pool, name)


def counted_core(attention_spec: tuple[str, ...], num_blocks: int = 32):
    namespace = CacheNamespace("m", "r", "float32", BLOCK_SIZE, attention_spec)
    core = build_core(EngineConfig(block_size=BLOCK_SIZE), kv_groups(attention_spec), namespace, EventLog(), num_blocks)
    pools = []
    for manager in core.kv.managers:
        manager.pool = CountingPool(manager.pool)
        pools.append(manager.pool)
    return core, pools


def step(scheduler):
    out = scheduler.schedule()
    sampled = {chunk.request.request_id: 1 for chunk in out.chunks if chunk.reaches_end}
    scheduler.postprocess(out, sampled)
    return out


def queries_of_one_step(scheduler, pools) -> tuple[list[int], list[str]]:
    for pool in pools:
        pool.queries = 0
    out = step(scheduler)
    return [pool.queries for pool in pools], [chunk.request.request_id for chunk in out.chunks]


@pytest.mark.parametrize("attention_spec", [("full",), ("sliding:6",), ("full", "sliding:6")])
def test_a_new_request_is_admitted_with_one_capacity_query_per_pool(attention_spec):
    core, pools = counted_core(attention_spec)
    core.scheduler.add(Request("a", tuple(range(1, 11)), SamplingParams(max_new_tokens=2)))
    queries, scheduled = queries_of_one_step(core.scheduler, pools)
    assert scheduled == ["a"]
    assert queries == [1] * len(pools)
    core.kv.check_invariants()


@pytest.mark.parametrize("attention_spec", [("full",), ("full", "sliding:6")])
def test_a_fork_child_is_admitted_with_one_capacity_query_per_pool(attention_spec):
    core, pools = counted_core(attention_spec)
    scheduler, kv = core.scheduler, core.kv
    parent = Request("p", tuple(range(1, 11)), SamplingParams(max_new_tokens=1), retain=True)
    scheduler.add(parent)
    while scheduler.has_work:
        step(scheduler)
    child = Request("c", (*parent.all_token_ids, 7, 8), SamplingParams(max_new_tokens=1), parent_id="p",
                    hit_source=HitSource.FORK)  # fmt: skip
    child.seeded_by_fork(kv.fork("p", "c"), kv.ready_mode)
    scheduler.add(child)
    queries, scheduled = queries_of_one_step(scheduler, pools)
    assert scheduled == ["c"]
    assert queries == [1] * len(pools)
    kv.check_invariants()


def test_a_request_that_waits_for_blocks_hashes_each_of_its_blocks_once(monkeypatch):
    core, _ = counted_core(("full",), num_blocks=8)
    scheduler = core.scheduler
    scheduler.add(Request("a", tuple(range(1, 21)), SamplingParams(max_new_tokens=8)))  # 5 blocks, then 6
    step(scheduler)
    waiting_tokens = tuple(range(9000, 9016))  # 4 blocks: never fit beside a's
    scheduler.add(Request("b", waiting_tokens, SamplingParams(max_new_tokens=1)))
    hashed: list[bytes] = []
    digest = xxhash.xxh3_128_digest

    def counting_digest(data: bytes) -> bytes:
        hashed.append(data)
        return digest(data)

    monkeypatch.setattr(xxhash, "xxh3_128_digest", counting_digest)
    marker = struct.pack("<I", waiting_tokens[0])
    for _ in range(5):
        out = step(scheduler)
        assert [chunk.request.request_id for chunk in out.chunks] == ["a"]  # b waits
    waiting_hashes = [data for data in hashed if marker in data]
    assert len(waiting_hashes) == 1  # its first block, once: the lookup misses there every step
