"""The timed mode: the engine's scheduler and pool without the model, on hand-made traces with exact times.

Block size 4; a step costs prefill tokens / 4 s plus decode tokens / 1 s; every number below follows
from the engine's rules (cap of `(prompt - 1) // 4` hit blocks, full blocks cached, tails first evicted).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from analysis.analyzer import AnalysisConfig, Mode, analyze
from analysis.breakdown import MissBreakdown
from analysis.policies import Policy
from analysis.readers import load_trace
from analysis.report import to_json
from analysis.timed import ServiceModel, _ModelFreeServer, prompt_tokens, run_timed
from analysis.trace import Trace, TraceFormat, TraceRequest
from engine.core.eviction import EvictionPolicyName, LruPolicy, ReuseLruPolicy, make_eviction_policy
from tests.analysis_support import CONVERSATION_SAMPLE

SERVICE = ServiceModel(prefill_tokens_per_s=4, decode_tokens_per_s=1, max_num_batched_tokens=64)


def trace_of(*requests: tuple[float, int, int, tuple[int, ...]]) -> Trace:
    """(arrival s, prompt tokens, output tokens, block ids) per request, 4-token blocks."""
    return Trace.from_requests([TraceRequest(*request, 4) for request in requests], TraceFormat.MOONCAKE)


def test_a_request_arriving_while_another_runs_hits_its_held_blocks_after_waiting_for_the_step():
    # t=0: A prefills 8 tokens (2 s). B arrives at 0.5, is admitted at 2 with A's two blocks as its hit
    # (held blocks can be shared), and prefills its third block while A decodes: 4/4 + 1/1 = 2 s.
    trace = trace_of((0.0, 8, 2, (1, 2)), (0.5, 12, 1, (1, 2, 3)))
    run = run_timed(trace, 8, LruPolicy(), SERVICE)
    assert run.hit_blocks.tolist() == [0, 2]
    assert run.queueing_s.tolist() == [0.0, 1.5]
    assert (run.peak_blocks_in_use, run.steps, run.makespan_s, run.preemptions) == (4, 2, 4.0, 0)


def test_a_pool_too_small_for_both_makes_the_second_request_wait_for_the_first_to_finish():
    # Pool of 4: A takes 3 blocks for its prompt and a fourth when it decodes; B (2 blocks) waits until A
    # finishes at t = 3 + 1, then evicts one of A's cached blocks and prefills for 2 s.
    trace = trace_of((0.0, 12, 2, (1, 2, 3)), (0.0, 8, 1, (4, 5)))
    run = run_timed(trace, 4, LruPolicy(), SERVICE)
    assert run.hit_blocks.tolist() == [0, 0]
    assert run.queueing_s.tolist() == [0.0, 4.0]
    assert (run.peak_blocks_in_use, run.steps, run.makespan_s) == (4, 3, 6.0)


def test_a_request_larger_than_the_whole_pool_is_rejected_as_the_engine_rejects_it():
    trace = trace_of((0.0, 8, 2, (1, 2)), (0.5, 12, 1, (1, 2, 3)))  # B needs ceil(13 / 4) = 4 blocks
    run = run_timed(trace, 3, LruPolicy(), SERVICE)
    assert run.rejected.tolist() == [False, True]
    assert run.hit_blocks.tolist() == [0, 0] and np.isnan(run.queueing_s[1])


PINNED = trace_of((0.0, 4, 9, (1,)), (0.0, 4, 1, (2,)), (0.0, 4, 1, (3,)), (7.5, 5, 1, (2, 9)))


def test_blocks_held_by_a_running_request_evict_what_one_at_a_time_service_keeps():
    # Pool of 4. A, B and C prefill together (3 s); B and C finish and cache blocks 2 and 3. A decodes
    # on, and at position 8 (t = 7) needs a third block: it evicts block 2, so D (arriving at 7.5, after
    # block 2) misses it, and waits for A to finish at t = 11. One request at a time, D hits block 2.
    run = run_timed(PINNED, 4, LruPolicy(), SERVICE)
    assert run.hit_blocks.tolist() == [0, 0, 0, 0]
    assert run.queueing_s.tolist() == [0.0, 0.0, 0.0, 3.5]
    assert (run.peak_blocks_in_use, run.steps, run.makespan_s) == (3, 10, 12.25)
    point = analyze(PINNED, AnalysisConfig((16,), (Policy.LRU,), mode=Mode.TIMED, service=SERVICE)).curve[0]
    # D's block is `pinned` (4 tokens); the prompts of one block are `partial`: the engine always computes a
    # prompt's last token, so a 4-token prompt can never hit; D's 1-token tail neither.
    assert point.misses == MissBreakdown(compulsory=0, capacity=0, partial=13, pinned=4, namespace=0)
    assert point.timed.queueing_s["max"] == 3.5 and point.timed.peak_blocks_in_use == 3


def test_a_pool_that_cannot_grow_a_running_request_preempts_the_newest_and_everything_finishes():
    # Two long decodes in a pool of 5: both reach their third block; the newest is preempted, recomputed.
    trace = trace_of((0.0, 4, 9, (1,)), (0.0, 4, 9, (2,)))
    run = run_timed(trace, 5, LruPolicy(), SERVICE)
    assert run.preemptions >= 1
    assert not np.isnan(run.queueing_s).any() and run.peak_blocks_in_use <= 5


def test_synthetic_prompts_give_equal_tokens_to_equal_ids_and_a_partial_block_its_own():
    trace = trace_of((0.0, 6, 1, (7, 8)), (0.0, 5, 1, (7, 9)))
    dense = dict(zip(trace.dense.unique.tolist(), range(trace.unique_blocks)))
    assert prompt_tokens(trace, 0) == [dense[7]] * 4 + [dense[8]] * 2
    assert prompt_tokens(trace, 1) == [dense[7]] * 4 + [dense[9]]


@pytest.mark.parametrize("policy", [Policy.LRU, Policy.REUSE_LRU])
def test_timed_analysis_of_a_sample_accounts_for_every_token(policy):
    trace = load_trace(io.BytesIO(b"".join(CONVERSATION_SAMPLE.read_bytes().splitlines(keepends=True)[:30])))
    service = ServiceModel(prefill_tokens_per_s=200_000, decode_tokens_per_s=20_000)
    analysis = analyze(trace, AnalysisConfig((20_000, 5_000_000), (policy,), mode=Mode.TIMED, service=service))
    small, huge = analysis.curve
    for point in analysis.curve:
        assert point.hit_tokens + point.misses.total == trace.input_tokens
    assert small.hit_tokens < huge.hit_tokens == analysis.max_hit_tokens  # an ample pool hits the maximum
    assert huge.misses.pinned == huge.misses.capacity == 0
    report = to_json(analysis)
    assert report["mode"] == "timed" and set(report["curve"][0]["timed"]["queueing_s"]) == {"p50", "p90", "p99", "max"}


def test_the_timed_mode_refuses_policies_the_engine_does_not_have():
    with pytest.raises(ValueError, match="timed mode runs the engine's scheduler and pool"):
        AnalysisConfig((100,), (Policy.OPT,), mode=Mode.TIMED)


def test_reuse_lru_runs_in_the_timed_mode_too():
    run = run_timed(PINNED, 4, ReuseLruPolicy(4), SERVICE)
    assert run.hit_blocks.tolist() == [0, 0, 0, 0] and run.makespan_s == 12.25


@pytest.mark.parametrize("policy", list(EvictionPolicyName))
def test_a_pool_that_holds_every_context_serves_as_any_larger_one(policy):
    """PINNED's contexts (prompt and output) need 10 blocks in all (13 tokens: 4, then 5, 5 and 6: 2 each).
    `run_timed` builds no larger pool than that, whatever the capacity; a pool of 50 built as it is
    serves exactly the same."""
    bounded = run_timed(PINNED, 10**11, make_eviction_policy(policy, 10**11), SERVICE)
    larger = _ModelFreeServer(PINNED, 50, make_eviction_policy(policy, 50), SERVICE).serve(50, None)
    for field in ("hit_blocks", "queueing_s", "rejected"):
        assert getattr(bounded, field).tolist() == getattr(larger, field).tolist()
    for field in ("peak_blocks_in_use", "preemptions", "steps", "makespan_s"):
        assert getattr(bounded, field) == getattr(larger, field)
    assert bounded.capacity_blocks == 10**11
