"""Property tests: the simulator policies' invariants and order, and the simulation's bounds (OPT, infinite).

Each simulator policy (FIFO, LFU) is driven by random pool-like events (insert, touch by several
holders, release by the last, evict the victim, remove out of turn) next to a naive model that
recomputes the victim from scratch; the policy's victim must be the model's. The engine's own policies
(LRU, reuse-LRU) have the same kind of machine over the real block pool (tests/test_block_pool_properties.py).
Simulations on random traces must keep the cache within capacity, never hit more than the infinite
cache, and never beat OPT (on prefix-consistent traces, where OPT is the exhaustive optimum, which a
brute force confirms).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from analysis.belady import BeladyCache, next_uses
from analysis.policies import FifoPolicy, LfuPolicy, Policy
from analysis.pool_replay import PoolCache, prefix_keys
from analysis.sequential import SequentialCache, infinite_hit_blocks, make_policy, replay, simulate
from engine.core.eviction import make_eviction_policy
from tests.analysis_support import BLOCK_SIZE, any_chains, best_hit_blocks, best_hit_tokens, prefix_chains, trace_of

ONLINE = [policy for policy in Policy if policy.online]
SIMULATOR_POLICIES = [policy for policy in Policy if policy.in_block_pool is None]
POOL_POLICIES = [policy for policy in Policy if policy.in_block_pool is not None]


class NaiveModel:
    """What each policy's victim should be, recomputed from every cached key's history."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.inserts = 0  # insertions so far
        self.releases = 0  # releases so far
        self.inserted: dict[int, int] = {}  # cached key -> its insertion number
        self.released: dict[int, int] = {}  # evictable key -> the number of its last release
        self.uses: dict[int, int] = {}  # cached key -> uses as the policy counts them

    def insert(self, key: int) -> None:
        self.inserts += 1
        self.inserted[key] = self.inserts
        self.uses[key] = 1

    def touch(self, key: int) -> None:
        self.released.pop(key, None)
        self.uses[key] += 1

    def release(self, key: int) -> None:
        self.releases += 1
        self.released[key] = self.releases

    def remove(self, key: int) -> None:
        del self.released[key], self.inserted[key]
        del self.uses[key]

    def victim(self) -> int:
        order = {
            Policy.FIFO: lambda key: self.inserted[key],
            Policy.LFU: lambda key: (self.uses[key], self.released[key]),
        }[self.policy]
        return min(self.released, key=order)


def new_policy(policy: Policy):
    return FifoPolicy() if policy is Policy.FIFO else LfuPolicy()


class PolicyMachine(RuleBasedStateMachine):
    """Random pool events against one policy and its naive model."""

    kind: Policy

    def __init__(self) -> None:
        super().__init__()
        self.policy = new_policy(self.kind)
        self.model = NaiveModel(self.kind)
        self.holders: dict[int, int] = {}  # cached key -> holders (0: evictable)

    def _keys(self, held: bool | None) -> list[int]:
        """Cached keys that are held (True), evictable (False) or either (None)."""
        return sorted(k for k, n in self.holders.items() if held is None or (n > 0) == held)

    @precondition(lambda self: len(self.holders) < 10)
    @rule(data=st.data())
    def insert(self, data):
        key = data.draw(st.sampled_from(sorted(set(range(10)) - set(self.holders))))
        self.policy.insert(key)
        self.model.insert(key)
        self.holders[key] = 1

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def touch(self, data):
        key = data.draw(st.sampled_from(self._keys(None)))
        self.policy.touch(key)
        self.model.touch(key)
        self.holders[key] += 1

    @precondition(lambda self: any(self.holders.values()))
    @rule(data=st.data())
    def release(self, data):
        key = data.draw(st.sampled_from(self._keys(True)))
        self.holders[key] -= 1
        if self.holders[key] == 0:
            self.policy.release(key)
            self.model.release(key)

    @precondition(lambda self: not all(self.holders.values()))
    @rule()
    def evict(self):
        victim = self.policy.victim()
        assert victim == self.model.victim()
        self._remove(victim)

    @precondition(lambda self: not all(self.holders.values()))
    @rule(data=st.data())
    def remove_out_of_turn(self, data):
        self._remove(data.draw(st.sampled_from(self._keys(False))))

    def _remove(self, key):
        assert self.holders[key] == 0, "only evictable keys are removed"
        self.policy.remove(key)
        self.model.remove(key)
        del self.holders[key]

    @invariant()
    def policy_invariants_hold(self):
        self.policy.check_invariants()
        evictable = sum(1 for holders in self.holders.values() if holders == 0)
        assert self.policy.num_evictable == evictable
        assert self.policy.can_evict() == (evictable > 0)


def machine_for(policy: Policy):
    return type(f"{policy.name}Machine", (PolicyMachine,), {"kind": policy})


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestFifoMachine = machine_for(Policy.FIFO).TestCase
TestLfuMachine = machine_for(Policy.LFU).TestCase
TestFifoMachine.settings = TestLfuMachine.settings = MACHINE_SETTINGS


@settings(max_examples=150, deadline=None)
@given(chains=any_chains(), capacity=st.integers(0, 6), policy=st.sampled_from(SIMULATOR_POLICIES))
def test_every_simulator_policy_stays_within_capacity_and_below_the_infinite_cache(chains, capacity, policy):
    trace = trace_of(chains)
    cache = SequentialCache(capacity, make_policy(policy, trace))
    infinite = infinite_hit_blocks(trace)
    ids, starts = trace.dense.ids.tolist(), trace.block_starts.tolist()
    for request in range(len(trace)):
        hit = cache.serve(ids[starts[request] : starts[request + 1]])
        cache.check_invariants()
        assert hit <= infinite[request]


@settings(max_examples=150, deadline=None)
@given(chains=prefix_chains(), capacity=st.integers(1, 6), policy=st.sampled_from(POOL_POLICIES))
def test_the_block_pool_stays_within_capacity_and_below_the_infinite_cache(chains, capacity, policy):
    trace = trace_of(chains)
    cache = PoolCache(trace, capacity, make_eviction_policy(policy.in_block_pool, capacity))
    infinite = infinite_hit_blocks(trace)
    ids, starts = trace.dense.ids.tolist(), trace.block_starts.tolist()
    for request in range(len(trace)):
        hit = cache.serve(ids[starts[request] : starts[request + 1]])
        cache.check_invariants()
        assert hit <= infinite[request]


@settings(max_examples=150, deadline=None)
@given(chains=prefix_chains(), capacity=st.integers(0, 6))
def test_opt_hits_at_least_as_much_as_every_online_policy(chains, capacity):
    trace = trace_of(chains)
    best = simulate(trace, Policy.OPT, capacity).hit_blocks
    infinite = infinite_hit_blocks(trace)
    assert best.sum() <= infinite.sum()
    for policy in ONLINE:
        assert simulate(trace, policy, capacity).hit_blocks.sum() <= best.sum(), policy


@settings(max_examples=100, deadline=None)
@given(chains=prefix_chains(max_requests=7, max_new=3), capacity=st.integers(1, 4))
def test_opt_is_the_exhaustive_optimum_on_prefix_traces(chains, capacity):
    trace = trace_of(chains)
    assert simulate(trace, Policy.OPT, capacity).hit_blocks.sum() == best_hit_blocks(chains, capacity)


def test_opt_maximises_hit_blocks_which_a_partial_tail_can_make_fewer_tokens():
    # Capacity 2. p is a 1-token block, f and g full. At r2 OPT evicts f (used at r4, after p at r3)
    # and hits p (1 token); keeping f instead would hit 4 tokens at r4. One hit block either way.
    p, f, g = 1, 2, 3
    chains, lengths = [[p], [f], [g], [p], [f]], [1, 4, 4, 1, 4]
    trace = trace_of(chains, lengths)
    opt = simulate(trace, Policy.OPT, 2)
    assert opt.hit_blocks.sum() == best_hit_blocks(chains, 2) == 1
    assert trace.hit_tokens(opt.hit_blocks).sum() == 1
    assert best_hit_tokens(chains, lengths, 2) == 4
    assert BLOCK_SIZE == 4


def test_opt_can_lose_on_a_trace_whose_ids_change_parents():
    # Capacity 6. Id 1 starts one request and follows 0 in another, which prefix hashes never do. At r3
    # OPT evicts 0 (next used at r5, after 4 at r4); at r5 block 1 is cached but 0 is not, so nothing
    # hits: 2 blocks in all. LFU evicts 4 (one use against two), misses it at r4 and hits [0, 1] at r5:
    # 3 blocks, the exhaustive optimum. OPT minimises block misses, not leading-block misses.
    chains = [[0], [0], [4], [1, 2, 3, 5, 6], [4], [0, 1]]
    trace = trace_of(chains)
    assert simulate(trace, Policy.OPT, 6).hit_blocks.tolist() == [0, 1, 0, 0, 1, 0]
    assert simulate(trace, Policy.LFU, 6).hit_blocks.tolist() == [0, 1, 0, 0, 0, 2]
    assert best_hit_blocks(chains, 6) == 3


@settings(max_examples=200, deadline=None)
@given(chains=st.one_of(prefix_chains(), any_chains()), capacity=st.integers(0, 8))
def test_the_one_loop_opt_cache_serves_as_the_policy_object_does_victim_for_victim(chains, capacity):
    """BeladyCache (the analyzer's OPT) against SequentialCache under BeladyPolicy: the same hits and the
    same victims in the same order, on prefix traces and on traces whose ids change parents, with
    requests larger than the cache."""
    trace = trace_of(chains)
    reference = SequentialCache(capacity, make_policy(Policy.OPT, trace), record_evictions=True)
    fast = BeladyCache(trace.dense.ids, trace.unique_blocks, capacity, record_evictions=True)
    ids, starts = trace.dense.ids.tolist(), trace.block_starts.tolist()
    for request in range(len(trace)):
        blocks = ids[starts[request] : starts[request + 1]]
        assert fast.serve(blocks) == reference.serve(blocks)
        fast.check_invariants()
        assert len(fast) == len(reference) and fast.evictions == reference.evictions


def test_the_one_loop_opt_cache_refuses_a_request_out_of_the_traces_order():
    trace = trace_of([[1, 2], [3]])
    cache = BeladyCache(trace.dense.ids, trace.unique_blocks, 2)
    with pytest.raises(ValueError, match="not the trace's next one"):
        cache.serve(trace.dense.ids.tolist()[2:])


def test_next_uses_name_each_references_next_position_or_never():
    assert next_uses(np.array([5, 7, 5, 5, 7, 9])).tolist() == [2, 4, 3, -1, -1, -1]


@settings(max_examples=60, deadline=None)
@given(chains=prefix_chains(), extra=st.integers(0, 3))
def test_a_cache_holding_every_block_hits_as_its_simulation_does_without_being_simulated(chains, extra):
    """`simulate` reads a cache of at least every distinct block off the infinite cache: the same hits,
    and no evictions, as the policy's own cache gives when it serves the trace."""
    trace = trace_of(chains)
    size = trace.unique_blocks
    keys = prefix_keys(trace)
    for policy in Policy:
        if policy.in_block_pool is not None:
            cache = PoolCache(trace, size, make_eviction_policy(policy.in_block_pool, size), record_evictions=True)
        elif policy is Policy.OPT:
            cache = BeladyCache(trace.dense.ids, size, size, record_evictions=True)
        else:
            cache = SequentialCache(size, make_policy(policy, trace), record_evictions=True)
        served = replay(trace, cache)
        run = simulate(trace, policy, size + extra, record_evictions=True, pool_keys=keys)
        assert run.hit_blocks.tolist() == served.tolist() and run.evictions == () == tuple(cache.evictions), policy
