"""The analysis end to end: miss reasons, hits per type, top prefixes, the JSON, progress, bad configs."""

from __future__ import annotations

import json

import pytest

from analysis.analyzer import AnalysisConfig, Progress, analyze, log_spaced_capacities
from analysis.breakdown import MissBreakdown, PrefixSavings, TypeHits, hit_bounds, miss_breakdown, top_prefixes
from analysis.policies import Policy
from analysis.readers import load_trace
from analysis.report import to_json
from analysis.sequential import infinite_hit_blocks
from analysis.trace import PartialBlocks, Trace, TraceFormat, TraceRequest
from tests.analysis_support import BAILIAN_SAMPLE, CONVERSATION_SAMPLE, trace_of

ALL_POLICIES = tuple(Policy)


def test_bailian_sample_maximum_by_hand():
    # Infinite cache, 16-token blocks: chat 2 reuses 3 blocks of chat 0 (48 tokens), chat 3 the system
    # block (16), chat 5 six blocks of chat 2 (96), chat 6 all four of chat 4 (64), chat 7 repeats chat 1
    # (its 3 blocks cover 33 tokens).
    analysis = analyze(load_trace(BAILIAN_SAMPLE), AnalysisConfig((64,), (Policy.LRU,)))
    assert (analysis.max_hit_tokens, analysis.trace.input_tokens) == (257, 510)
    assert analysis.unavoidable == MissBreakdown(compulsory=253, capacity=0, partial=0, pinned=0, namespace=0)
    assert analysis.max_by_type == (
        TypeHits("text", 3, 280, 144),
        TypeHits("image", 2, 66, 33),
        TypeHits("search", 1, 20, 16),
        TypeHits("file", 2, 144, 64),
    )
    assert analysis.max_top_prefixes == (
        PrefixSavings(0, 6, 6, 1, 96),
        PrefixSavings(30, 33, 4, 1, 64),
        PrefixSavings(0, 2, 3, 1, 48),
        PrefixSavings(10, 12, 3, 1, 33),
        PrefixSavings(0, 0, 1, 1, 16),
    )


def test_misses_split_into_compulsory_and_capacity():
    # Capacity 1 block, LRU: r1 [1, 2] finds 1 cached (its own first block was kept); r2 [3] evicts 1;
    # r3 [1, 2] misses both, although both were seen: 8 capacity tokens; every first sight is compulsory.
    trace = trace_of([[1, 2], [1, 2], [3], [1, 2]])
    point = analyze(trace, AnalysisConfig((4,), (Policy.LRU,))).curve[0]
    assert trace.hit_tokens(infinite_hit_blocks(trace)).tolist() == [0, 8, 0, 8]
    assert (point.capacity_blocks, point.hit_tokens) == (1, 4)
    assert point.misses == MissBreakdown(compulsory=12, capacity=12, partial=0, pinned=0, namespace=0)
    assert point.hit_tokens + point.misses.total == trace.input_tokens


def test_full_block_workloads_count_the_tail_as_partial():
    requests = [TraceRequest(float(i), 10, 1, (1, 2), 4) for i in range(2)]
    trace = Trace.from_requests(requests, TraceFormat.MOONCAKE, PartialBlocks.DROPPED)
    bounds = hit_bounds(trace)
    assert miss_breakdown(trace, bounds.infinite, bounds) == MissBreakdown(8, 0, 4, 0, 0)


def test_top_prefixes_group_requests_by_their_exact_hit_chain():
    trace = trace_of([[1, 2], [1, 2], [1, 2], [1, 3]])
    assert top_prefixes(trace, infinite_hit_blocks(trace), 10) == (
        PrefixSavings(1, 2, 2, 2, 16),
        PrefixSavings(1, 1, 1, 1, 4),
    )
    assert top_prefixes(trace, infinite_hit_blocks(trace), 1) == (PrefixSavings(1, 2, 2, 2, 16),)


def test_json_has_the_issues_keys_and_serialises():
    trace = load_trace(CONVERSATION_SAMPLE)
    capacities = (0, 100_000, 1_000_000)
    report = to_json(analyze(trace, AnalysisConfig(capacities, ALL_POLICIES, top_prefixes=3)))
    text = json.dumps(report)  # plain Python values only
    assert json.loads(text) == report
    issue_keys = {"requests", "input_tokens", "block_size", "unique_blocks", "max_hit_ratio", "curve", "misses"}
    issue_keys.add("seconds")
    assert issue_keys <= report.keys()
    assert (report["requests"], report["block_size"], report["unique_blocks"]) == (223, 512, trace.unique_blocks)
    assert [(p["policy"], p["capacity_tokens"]) for p in report["curve"]] == [
        (policy.value, capacity) for policy in ALL_POLICIES for capacity in capacities
    ]
    for point in report["curve"]:
        assert {"policy", "capacity_tokens", "hit_ratio", "hit_tokens"} <= point.keys()
        assert point["hit_tokens"] + sum(point["misses"].values()) == report["input_tokens"]
        assert point["misses"]["compulsory"] == report["misses"]["compulsory"]
        assert point["hit_ratio"] <= report["max_hit_ratio"]
        assert len(point["top_prefixes"]) <= 3
    by_policy = {(p["policy"], p["capacity_tokens"]): p["hit_tokens"] for p in report["curve"]}
    for capacity in capacities:
        assert all(by_policy[p.value, capacity] <= by_policy["opt", capacity] for p in ALL_POLICIES)
    compulsory = report["input_tokens"] - report["max_hit_tokens"]
    assert report["misses"] == {"compulsory": compulsory, "partial": 0, "namespace": 0}


def test_bailian_points_break_hits_down_by_type():
    report = to_json(analyze(load_trace(BAILIAN_SAMPLE), AnalysisConfig((160,), (Policy.LRU, Policy.OPT))))
    for point in report["curve"]:
        assert [t["type"] for t in point["by_type"]] == ["text", "image", "search", "file"]
        assert sum(t["hit_tokens"] for t in point["by_type"]) == point["hit_tokens"]
    assert [t["hit_tokens"] for t in report["by_type"]] == [144, 33, 16, 64]


def test_progress_counts_every_simulated_request_once():
    trace = load_trace(CONVERSATION_SAMPLE)
    ticks: list[Progress] = []
    analyze(trace, AnalysisConfig((100_000, 500_000), (Policy.LRU, Policy.FIFO, Policy.OPT)), ticks.append)
    # infinite cache + one LRU pass + 2 policies x 2 capacities
    assert ticks[-1].done == ticks[-1].total == len(trace) * 6
    assert [t.done for t in ticks] == sorted(t.done for t in ticks)
    assert {t.stage for t in ticks} >= {"infinite cache", "fifo at 100,000 tokens", "opt at 500,000 tokens"}


def test_a_progress_callback_can_stop_the_analysis():
    class Stop(Exception):
        pass

    def stop(progress):
        if progress.stage.startswith("fifo"):
            raise Stop

    with pytest.raises(Stop):
        analyze(load_trace(CONVERSATION_SAMPLE), AnalysisConfig((100_000,), (Policy.LRU, Policy.FIFO)), stop)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacities_tokens": ()}, "at least one capacity"),
        ({"capacities_tokens": (10,), "policies": ()}, "at least one capacity and one policy"),
        ({"capacities_tokens": (-1,)}, "integers >= 0"),
        ({"capacities_tokens": (1.5,)}, "integers >= 0"),
        ({"capacities_tokens": (10, 10)}, "named twice"),
        ({"capacities_tokens": tuple(range(1001))}, "at most 1000"),
        ({"capacities_tokens": (10,), "top_prefixes": -1}, "top_prefixes"),
    ],
)
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AnalysisConfig(**kwargs)


def test_log_spaced_capacities_cover_one_to_the_maximum():
    capacities = log_spaced_capacities(182_790, 100)
    assert capacities[0] == 1 and capacities[-1] == 182_790
    assert list(capacities) == sorted(set(capacities))
    assert log_spaced_capacities(3, 100) == (1, 2, 3)
