"""The columnar trace: arrival order, checks on building, dense ids, token weights, block splitting."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.errors import TraceError
from analysis.readers import load_trace
from analysis.sequential import infinite_hit_blocks
from analysis.stack_distance import reference_tokens
from analysis import trace as trace_module
from analysis.trace import PartialBlocks, Trace, TraceFormat, TraceRequest
from tests.analysis_support import CONVERSATION_SAMPLE, trace_of


def request(arrival: float, ids: tuple[int, ...], length: int, block_size: int = 4) -> TraceRequest:
    return TraceRequest(arrival, length, 1, ids, block_size, request_type=None)


def test_requests_are_put_in_arrival_order_stably():
    requests = [request(2.0, (1, 2), 8), request(1.0, (3,), 4), request(2.0, (4,), 4), request(0.5, (5, 6, 7), 12)]
    trace = Trace.from_requests(requests, TraceFormat.MOONCAKE)
    assert trace.arrival_s.tolist() == [0.5, 1.0, 2.0, 2.0]
    assert [trace.block_ids[a:b].tolist() for a, b in zip(trace.block_starts[:-1], trace.block_starts[1:])] == [
        [5, 6, 7],
        [3],
        [1, 2],
        [4],
    ]
    assert trace.input_lengths.tolist() == [12, 4, 8, 4]


def test_a_trace_is_read_only():
    trace = trace_of([[1, 2], [1]])
    with pytest.raises(ValueError):
        trace.block_ids[0] = 9


def test_building_checks_each_request_and_names_it():
    with pytest.raises(TraceError, match="request 2: hash_ids has 1 ids, but input_length 5"):
        Trace.from_requests([request(0, (1,), 4), request(1, (2,), 5)], TraceFormat.MOONCAKE)
    with pytest.raises(TraceError, match="request 2: block size 8, earlier ones 4"):
        Trace.from_requests([request(0, (1,), 4), request(1, (2,), 8, block_size=8)], TraceFormat.MOONCAKE)
    with pytest.raises(TraceError, match="the trace has no requests"):
        Trace.from_requests([], TraceFormat.MOONCAKE)
    long_output = TraceRequest(0, 4, 2**40 + 1, (1,), 4)
    with pytest.raises(TraceError, match=r"request 1: output_length must be in \[0, 2\*\*40\]"):
        Trace.from_requests([long_output], TraceFormat.MOONCAKE)


def test_a_trace_is_bounded_in_references_and_requests(monkeypatch):
    """Memory grows with a trace's references: building one, or splitting one, past the bound is refused
    before the arrays are made."""
    monkeypatch.setattr(trace_module, "MAX_REFERENCES", 5)
    requests = [request(0, (1, 2), 8), request(1, (1, 2, 3, 4), 16)]  # 6 references
    with pytest.raises(TraceError, match="request 2: a trace holds at most"):
        Trace.from_requests(requests, TraceFormat.MOONCAKE)
    trace = Trace.from_requests(requests[:1], TraceFormat.MOONCAKE)
    assert trace.split(2).num_references == 4
    with pytest.raises(ValueError, match="at block size 1 the trace has 8 references; a trace holds at most"):
        trace.split(1)
    monkeypatch.setattr(trace_module, "MAX_REQUESTS", 1)
    with pytest.raises(TraceError, match="request 2: a trace holds at most"):
        Trace.from_requests([request(0, (1,), 4), request(1, (2,), 4)], TraceFormat.MOONCAKE)


def test_full_block_workloads_count_blocks_by_floor():
    # 10 tokens at 4 per block: 2 full blocks have keys; 2 tokens are never cacheable.
    trace = Trace.from_requests([request(0, (1, 2), 10)], TraceFormat.MOONCAKE, PartialBlocks.DROPPED)
    assert trace.blocks_per_request.tolist() == [2]
    with pytest.raises(TraceError, match=r"floor\(10 / 4\) = 2"):
        Trace.from_requests([request(0, (1, 2, 3), 10)], TraceFormat.MOONCAKE, PartialBlocks.DROPPED)


def test_dense_ids_keep_the_equalities():
    trace = trace_of([[100, 7], [100, 9000], [7]])
    dense = trace.dense
    assert dense.unique.tolist() == [7, 100, 9000]
    assert dense.ids.tolist() == [1, 0, 1, 2, 0]
    assert trace.unique_blocks == 3


def test_a_partial_last_block_weighs_its_own_tokens():
    trace = trace_of([[1, 2, 3], [4]], lengths=[9, 2])
    assert reference_tokens(trace).tolist() == [4, 4, 1, 2]
    assert trace.hit_tokens(np.array([3, 1])).tolist() == [9, 2]
    assert trace.hit_tokens(np.array([2, 0])).tolist() == [8, 0]


def test_split_derives_child_ids_and_cuts_the_partial_tail():
    # Block 5 (full, 8 tokens) -> 5*4+0 .. 5*4+3; block 9 holds 3 tokens -> 2 children of 2 tokens.
    trace = Trace.from_requests([request(0, (5, 9), 11, block_size=8)], TraceFormat.MOONCAKE)
    split = trace.split(2)
    assert split.block_size == 2
    assert split.block_ids.tolist() == [20, 21, 22, 23, 36, 37]
    assert split.block_starts.tolist() == [0, 6]
    assert reference_tokens(split).tolist() == [2, 2, 2, 2, 2, 1]


def test_split_keeps_the_reuse_structure_of_a_real_trace():
    trace = load_trace(CONVERSATION_SAMPLE)
    split = trace.split(16)
    assert split.blocks_per_request.tolist() == (-(-trace.input_lengths // 16)).tolist()
    # Whole 512-token blocks that hit still hit, 32 children at a time; a partial tail can add at most
    # its children, so the split trace hits at least as many tokens.
    assert split.hit_tokens(infinite_hit_blocks(split)).sum() >= trace.hit_tokens(infinite_hit_blocks(trace)).sum()


def test_split_refuses_what_it_cannot_describe():
    trace = trace_of([[1, 2]])
    with pytest.raises(ValueError, match="does not divide"):
        trace.split(3)
    dropped = Trace.from_requests([request(0, (1,), 6)], TraceFormat.MOONCAKE, PartialBlocks.DROPPED)
    with pytest.raises(ValueError, match="partial blocks are cached"):
        dropped.split(2)
    huge = Trace.from_requests([request(0, (2**62,), 4)], TraceFormat.MOONCAKE)
    with pytest.raises(ValueError, match="too large"):
        huge.split(2)
