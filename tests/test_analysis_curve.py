"""The one-pass LRU curve equals the per-capacity LRU simulation, request by request, at every capacity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from analysis.analyzer import log_spaced_capacities
from analysis.policies import Policy
from analysis.readers import load_trace
from analysis.sequential import SequentialCache, infinite_hit_blocks, replay, simulate
from analysis.stack_distance import INFINITE_DEPTH, lru_curve
from tests.analysis_support import (
    BAILIAN_SAMPLE,
    CONVERSATION_SAMPLE,
    SYNTHETIC_SAMPLE,
    NaiveLru,
    any_chains,
    prefix_chains,
    trace_of,
)


def assert_curve_matches_simulation(trace, capacities):
    """The curve against the LRU simulation, which is the engine's block pool (analysis/pool_replay.py)."""
    curve = lru_curve(trace)
    for capacity in capacities:
        simulated = simulate(trace, Policy.LRU, capacity).hit_blocks
        assert curve.hit_blocks(capacity).tolist() == simulated.tolist(), capacity
        assert curve.hit_tokens(capacity) == trace.hit_tokens(simulated).sum(), capacity


def oracle_hit_blocks(trace, capacity):
    """LRU keyed by block id alone (tests/analysis_support.py), for traces the block pool refuses."""
    return replay(trace, SequentialCache(capacity, NaiveLru())).tolist()


def test_stack_depths_of_a_hand_made_trace():
    # r0 releases B then A (A on top); r1 [A, C]: A at depth 0, C new; r2 [B, A]: B is below C and A.
    trace = trace_of([[1, 2], [1, 3], [2, 1]])
    depths = lru_curve(trace).prefix_depths.tolist()
    assert depths == [INFINITE_DEPTH, INFINITE_DEPTH, 0, INFINITE_DEPTH, 2, 2]
    curve = lru_curve(trace)
    assert [curve.hit_blocks(capacity).tolist() for capacity in range(5)] == [
        oracle_hit_blocks(trace, capacity) for capacity in range(5)
    ]


@settings(max_examples=200, deadline=None)
@given(chains=prefix_chains(), data=st.data())
def test_curve_equals_the_block_pool_at_every_capacity_on_random_prefix_traces(chains, data):
    lengths = [len(chain) * 4 - data.draw(st.integers(0, 3)) for chain in chains]  # some tails partial
    trace = trace_of(chains, lengths)
    assert_curve_matches_simulation(trace, range(0, trace.unique_blocks + 2))


@settings(max_examples=200, deadline=None)
@given(chains=any_chains(), data=st.data())
def test_curve_equals_an_id_keyed_lru_on_traces_whose_ids_change_parents(chains, data):
    """The pool keys blocks by prefix and refuses such traces; the curve keys them by id, as this oracle."""
    lengths = [len(chain) * 4 - data.draw(st.integers(0, 3)) for chain in chains]
    trace = trace_of(chains, lengths)
    curve = lru_curve(trace)
    for capacity in range(0, trace.unique_blocks + 2):
        assert curve.hit_blocks(capacity).tolist() == oracle_hit_blocks(trace, capacity)


@pytest.mark.parametrize("sample", [CONVERSATION_SAMPLE, SYNTHETIC_SAMPLE, BAILIAN_SAMPLE])
def test_curve_equals_simulation_on_the_samples(sample):
    trace = load_trace(sample)
    capacities = (0,) + log_spaced_capacities(trace.unique_blocks + 1, 25)
    assert_curve_matches_simulation(trace, capacities)


def test_split_sample_curve_equals_simulation():
    trace = load_trace(CONVERSATION_SAMPLE).split(16)
    assert_curve_matches_simulation(trace, (1, 30, 700, 5000, 40000))


def test_curve_at_infinity_is_the_infinite_cache():
    trace = load_trace(SYNTHETIC_SAMPLE)
    curve = lru_curve(trace)
    maximum = int(trace.hit_tokens(infinite_hit_blocks(trace)).sum())
    assert curve.max_hit_tokens == maximum == curve.hit_tokens(trace.unique_blocks)
    assert curve.hit_blocks(trace.unique_blocks).tolist() == infinite_hit_blocks(trace).tolist()


def test_hit_tokens_at_reads_many_capacities_at_once():
    trace = load_trace(CONVERSATION_SAMPLE)
    curve = lru_curve(trace)
    capacities = [0, 10, 100, 1000, 10000]
    assert curve.hit_tokens_at(capacities).tolist() == [curve.hit_tokens(c) for c in capacities]
    assert np.all(np.diff(curve.hit_tokens_at(range(0, 5000, 50))) >= 0)  # LRU is a stack algorithm


def test_min_capacity_for_is_the_smallest_capacity_reaching_the_target():
    trace = load_trace(CONVERSATION_SAMPLE)
    curve = lru_curve(trace)
    for fraction in (0.5, 0.8, 0.9, 0.95, 1.0):
        target = int(fraction * curve.max_hit_tokens)
        capacity = curve.min_capacity_for(target)
        assert curve.hit_tokens(capacity) >= target
        assert capacity == 0 or curve.hit_tokens(capacity - 1) < target
    assert curve.min_capacity_for(0) == 0
    with pytest.raises(ValueError, match="no capacity hits"):
        curve.min_capacity_for(curve.max_hit_tokens + 1)


def test_progress_is_reported_up_to_the_last_request():
    trace = load_trace(CONVERSATION_SAMPLE)
    seen = []
    lru_curve(trace, seen.append)
    assert seen[-1] == len(trace)
