"""Hand-made traces with exact hit tokens per request and exact eviction order, policy by policy.

LRU and reuse-LRU run through the engine's block pool (analysis/pool_replay.py); the exact orders here
are the pool's. reuse-LRU's own unit tests (history, ties) are in tests/test_eviction.py."""

from __future__ import annotations

import pytest

from analysis.errors import NoVictimError
from analysis.policies import FifoPolicy, LfuPolicy, Policy
from analysis.sequential import SequentialCache, make_policy, simulate
from analysis.stack_distance import lru_curve
from engine.core.errors import InvariantError
from tests.analysis_support import trace_of

A, B, C, D = 1, 2, 3, 4
# Capacity 3: LRU evicts B for D, then C to make room for B, then D for C; OPT evicts C for D (its next
# use is the farthest), so the second [A, B] hits both blocks.
LRU_VS_OPT = [[A, B], [C], [D], [A, B], [C]]


def run(chains, policy, capacity, lengths=None):
    trace = trace_of(chains, lengths)
    result = simulate(trace, policy, capacity, record_evictions=True)
    return trace.hit_tokens(result.hit_blocks).tolist(), result.evictions


def test_lru_evicts_the_least_recently_released_block():
    assert run(LRU_VS_OPT, Policy.LRU, 3) == ([0, 0, 0, 4, 0], (B, C, D))


def test_opt_evicts_the_block_used_farthest_ahead_and_hits_more_than_lru():
    # r2: A is next used at position 4, B at 5, C at 6 -> C goes. r4: A, B, D are never used again; the
    # least recently released of them (D, released at r2) goes.
    assert run(LRU_VS_OPT, Policy.OPT, 3) == ([0, 0, 0, 8, 0], (C, D))


def test_fifo_evicts_the_first_inserted_block_even_if_it_was_reused():
    # A request inserts its tail first, so B entered before A; A's reuse at r3 does not move it.
    assert run(LRU_VS_OPT, Policy.FIFO, 3) == ([0, 0, 0, 4, 0], (B, C, A))


def test_lfu_evicts_the_least_used_block_where_lru_evicts_the_oldest():
    chains = [[A], [A], [B], [C]]
    assert run(chains, Policy.LFU, 2) == ([0, 4, 0, 0], (B,))
    assert run(chains, Policy.LRU, 2) == ([0, 4, 0, 0], (A,))


def test_lfu_breaks_ties_by_release_order():
    assert run(LRU_VS_OPT, Policy.LFU, 3) == ([0, 0, 0, 4, 0], (B, C, D))


def test_reuse_lru_gives_a_reused_block_credit_until_it_runs_out():
    # Capacity 2 -> credit 4 releases per reuse. A is reused once (tier 1), released as #2: due at 6.
    # B (#3) .. E (#6) are due at 3..6 and go first; at r6 A and E are both due at 6, and the lower
    # tier (E) goes; at r7 A is due before F (#7). When A returns at r8 the history remembers its two
    # uses, so it comes back at tier 2.
    E, F, G = 5, 6, 7
    chains = [[A], [A], [B], [C], [D], [E], [F], [G], [A]]
    assert run(chains, Policy.REUSE_LRU, 2) == ([0, 4, 0, 0, 0, 0, 0, 0, 0], (B, C, D, E, A, F))
    assert run(chains, Policy.LRU, 2) == ([0, 4, 0, 0, 0, 0, 0, 0, 0], (A, B, C, D, E, F))


@pytest.mark.parametrize("policy", list(Policy))
def test_a_request_longer_than_the_cache_keeps_its_leading_blocks(policy):
    # Capacity 2: [A, B, C] keeps A and B; C passes through. The repeat hits A and B (8 tokens).
    assert run([[A, B, C], [A, B, C]], policy, 2) == ([0, 8], ())
    if policy.in_block_pool is not None:
        return  # below, C starts one request and follows B in another: no prefix-hash trace does that
    # C was cached alone; the long request needs both places for A and B, so C goes although it is the
    # request's own block (past the capacity), before the request is served.
    assert run([[C], [A, B, C]], policy, 2) == ([0, 0], (C,))


@pytest.mark.parametrize("policy", list(Policy))
def test_capacity_zero_caches_nothing(policy):
    assert run(LRU_VS_OPT, policy, 0) == ([0, 0, 0, 0, 0], ())


@pytest.mark.parametrize("policy", list(Policy))
def test_a_cache_larger_than_the_trace_hits_as_one_that_holds_it_exactly(policy):
    """Above the trace's unique blocks nothing is evicted, so the cache is built at that size (a typed
    capacity of 10^11 blocks builds a pool of 4); the run reports the capacity asked for."""
    trace = trace_of(LRU_VS_OPT)
    exact, huge = simulate(trace, policy, 4), simulate(trace, policy, 10**11)
    assert huge.hit_blocks.tolist() == exact.hit_blocks.tolist() == [0, 0, 0, 2, 1]
    assert huge.capacity_blocks == 10**11


@pytest.mark.parametrize("policy", list(Policy))
def test_a_partial_last_block_hits_only_its_tokens(policy):
    # 6 tokens at 4 per block: the second block holds 2; a repeat hits 6 tokens, not 8.
    assert run([[A, B], [A, B]], policy, 4, lengths=[6, 6]) == ([0, 6], ())


def test_the_lru_curve_agrees_with_the_hand_made_scenarios():
    trace = trace_of(LRU_VS_OPT)
    assert lru_curve(trace).hit_blocks(3).tolist() == [0, 0, 0, 1, 0]
    assert lru_curve(trace_of([[A, B, C], [A, B, C]])).hit_blocks(2).tolist() == [0, 2]


class OwnBlockPolicy(FifoPolicy):
    """Broken on purpose: offers the block touched last, which the running request holds."""

    def touch(self, key):
        super().touch(key)
        self.touched = key

    def victim(self):
        return self.touched


def test_the_simulator_refuses_a_victim_that_belongs_to_the_running_request():
    cache = SequentialCache(2, OwnBlockPolicy())
    cache.serve([A, B])
    with pytest.raises(InvariantError, match="the request's or not cached"):
        cache.serve([A, C])  # A is held, B is the only victim; the policy offers A


def test_victim_with_nothing_evictable_is_an_error_and_can_evict_says_so():
    policy = LfuPolicy()
    policy.insert(A)
    assert not policy.can_evict()
    with pytest.raises(NoVictimError):
        policy.victim()


@pytest.mark.parametrize("policy_class", [FifoPolicy, LfuPolicy])
def test_policies_refuse_misuse(policy_class):
    policy = policy_class()
    policy.insert(A)
    with pytest.raises(ValueError, match="not evictable"):
        policy.remove(A)
    policy.release(A)
    with pytest.raises(ValueError, match="already"):
        policy.release(A)
    with pytest.raises(ValueError, match="already cached"):
        policy.insert(A)


def test_simulator_policies_are_built_without_the_capacity_and_opt_needs_the_trace():
    assert [type(make_policy(p)).__name__ for p in Policy if p.online and p.in_block_pool is None] == [
        "FifoPolicy",
        "LfuPolicy",
    ]
    with pytest.raises(ValueError, match="OPT needs the trace"):
        make_policy(Policy.OPT)


@pytest.mark.parametrize("policy", [Policy.LRU, Policy.REUSE_LRU])
def test_the_engines_policies_run_only_through_its_block_pool(policy):
    assert policy.in_block_pool is not None and policy.in_block_pool.value == policy.value
    with pytest.raises(ValueError, match="runs through the block pool"):
        make_policy(policy)
