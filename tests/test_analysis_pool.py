"""The analyzer's LRU is the engine's block pool: `PoolCache` replays give the one-pass curve's hits request
by request, on the samples and on token traces keyed as the engine keys them, where the engine's own KV
cache manager, driven request by request, finds the same hits."""

from __future__ import annotations

import pytest

from analysis.analyzer import log_spaced_capacities
from analysis.errors import TraceError
from analysis.own_workloads import Keying, read_run_trace
from analysis.pool_replay import PoolCache, prefix_keys
from analysis.readers import load_trace
from analysis.sequential import replay
from analysis.stack_distance import lru_curve
from engine.core.block_pool import BlockPool
from engine.core.events import EventLog
from engine.core.eviction import LruPolicy, ReuseLruPolicy
from engine.core.full_attention_manager import FullAttentionManager
from tests.analysis_support import BAILIAN_SAMPLE, CONVERSATION_SAMPLE, SYNTHETIC_SAMPLE, trace_of
from tests.manager_support import find_hit, root_key
from tests.own_workload_support import NAMESPACE, token_prompts, write_run_trace


@pytest.mark.parametrize("sample", [CONVERSATION_SAMPLE, SYNTHETIC_SAMPLE, BAILIAN_SAMPLE])
def test_the_block_pool_hits_what_the_lru_curve_says_request_by_request(sample):
    trace = load_trace(sample)
    curve, keys = lru_curve(trace), prefix_keys(trace)
    for capacity in log_spaced_capacities(trace.unique_blocks + 1, 12):
        cache = PoolCache(trace, capacity, LruPolicy(), keys=keys)
        assert replay(trace, cache).tolist() == curve.hit_blocks(capacity).tolist(), capacity
        cache.check_invariants()


def test_the_block_pool_at_16_token_blocks_hits_what_the_curve_says():
    trace = load_trace(CONVERSATION_SAMPLE).split(16)
    curve, keys = lru_curve(trace), prefix_keys(trace)
    for capacity in (10, 700, 5000):
        assert replay(trace, PoolCache(trace, capacity, LruPolicy(), keys=keys)).tolist() == curve.hit_blocks(
            capacity
        ).tolist()


def test_the_pool_evicts_a_chains_tail_first_and_names_its_victims():
    # Capacity 3: [A, B] then [C]: B (the tail, released first) goes for D; then C, then D.
    trace = trace_of([[1, 2], [3], [4], [1, 2], [3]])
    cache = PoolCache(trace, 3, LruPolicy(), record_evictions=True)
    assert replay(trace, cache).tolist() == [0, 0, 0, 1, 0]
    assert trace.dense.unique[cache.evictions].tolist() == [2, 3, 4]


def test_reuse_lru_keeps_a_reused_block_that_lru_evicts():
    # Capacity 2 (credit 4 releases per reuse): A is reused once; four single-use blocks later LRU has
    # evicted it, reuse-LRU still holds it when it returns.
    chains = [[1], [1], [2], [3], [1]]
    trace = trace_of(chains)
    assert replay(trace, PoolCache(trace, 2, LruPolicy())).tolist() == [0, 1, 0, 0, 0]
    assert replay(trace, PoolCache(trace, 2, ReuseLruPolicy(2))).tolist() == [0, 1, 0, 0, 1]


def test_a_trace_whose_ids_change_parents_is_refused_with_its_block():
    with pytest.raises(TraceError, match="block id 3 follows two different blocks"):
        prefix_keys(trace_of([[1, 3], [2, 3]]))


def test_a_token_trace_hits_what_the_engines_kv_cache_manager_hits(tmp_path):
    """The same prompts through the KV cache manager as the engine drives it (lookup, allocate, cache the
    full blocks, free last block first) and through the analyzer: equal hit tokens, request by request.

    The prompts are whole blocks: a partial tail would take a block while its request runs, which the
    sequential mode does not count. And the engine's lookup stops one block short of a prompt's end
    (it always computes the last token); the `+ [0]` below lifts that cap, which the sequential mode
    does not model either (the timed mode does: it runs the engine's own lookup)."""
    prompts = token_prompts()
    trace = read_run_trace(write_run_trace(tmp_path, prompts).open("rb"), Keying(NAMESPACE, None))
    size = NAMESPACE.block_size
    for capacity in (3, 6, 12, 40):
        log = EventLog()
        manager = FullAttentionManager(BlockPool(capacity, size, log), NAMESPACE, log)
        engine_hits = []
        for index, (tokens, salt) in enumerate(prompts):
            kept = tokens[: capacity * size]  # the sequential rule: blocks past the capacity are not kept
            hits = find_hit(manager, kept + [0], salt)  # + [0]: look up every block of `kept`
            manager.allocate(str(index), kept[len(hits) * size :], root_key=root_key(manager, salt), hits=hits)
            manager.cache_full_blocks(str(index))
            manager.free(str(index))
            engine_hits.append(min(len(hits) * size, len(tokens)))
            log.take()
        cache = PoolCache(trace, capacity, LruPolicy())
        analysed = trace.hit_tokens(replay(trace, cache)).tolist()
        assert analysed == engine_hits == trace.hit_tokens(lru_curve(trace).hit_blocks(capacity)).tolist(), capacity
