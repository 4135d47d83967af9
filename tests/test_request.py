"""Request transitions: each changes its fields in one place, and a context is read by slices."""

from __future__ import annotations

import re

import pytest

from engine.core.kv_groups import HitPlan, ReplayMode
from engine.core.request import HitSource, PromptKeys, Request, RequestStatus, SamplingParams


def plan(mode: ReplayMode, h: int, r: int) -> HitPlan:
    return HitPlan(h=h, s=0, e=h, r=r, mode=mode, root_key=bytes(16), chain_keys=[])


def test_a_readmission_decides_afresh_whether_its_state_may_be_cached():
    """Regression: only the first admission set `cacheable`, so a request first admitted with an exact
    replay and readmitted after a preemption with an approximate one kept offering approximate state to
    the prefix index."""
    request = Request("a", tuple(range(40)), SamplingParams())
    request.admitted(20, plan(ReplayMode.EXACT, h=36, r=20), now=1.0)
    assert request.cacheable and request.status is RequestStatus.RUNNING
    request.preempted()
    assert (request.status, request.num_computed_tokens, request.preemptions) == (RequestStatus.WAITING, 0, 1)
    request.admitted(28, plan(ReplayMode.APPROXIMATE, h=36, r=28), now=2.0)
    assert not request.cacheable
    # The hit accounting stays the first admission's.
    assert (request.replay_mode, request.replay_from, request.first_scheduled_time) == (ReplayMode.EXACT, 20, 1.0)
    assert (request.cached_tokens, request.hit_source) == (36, HitSource.PREFIX)


def test_a_finished_request_is_retained_only_when_asked():
    kept = Request("a", (1, 2, 3), SamplingParams(), retain=True)
    kept.finished("length", {"full": (4, 5)}, now=3.0, prompt_keys=PromptKeys(b"", b""))
    assert (kept.status, kept.finish_reason, kept.final_block_tables) == (RequestStatus.RETAINED, "length", {"full": (4, 5)})
    dropped = Request("b", (1, 2, 3), SamplingParams(), retain=True)
    dropped.release_when_finished()
    dropped.finished("eos", {}, now=3.0, prompt_keys=PromptKeys(b"", b""))
    assert dropped.status is RequestStatus.FINISHED



def test_a_stopped_request_ends_failed_or_aborted_even_when_retained_and_keeps_no_prompt_keys():
    failed = Request("a", (1, 2, 3), SamplingParams(), retain=True)
    failed.stopped(RequestStatus.FAILED, "non-finite logits", {"full": (4,)}, now=2.0)
    assert (failed.status, failed.finish_reason, failed.finish_time) == (RequestStatus.FAILED, "non-finite logits", 2.0)
    assert failed.final_block_tables == {"full": (4,)} and failed.prompt_keys is None
    aborted = Request("b", (1, 2, 3), SamplingParams())
    aborted.stopped(RequestStatus.ABORTED, "the engine was restarted", {}, now=3.0)
    assert aborted.status is RequestStatus.ABORTED


@pytest.mark.parametrize("status", [RequestStatus.FINISHED, RequestStatus.RETAINED, RequestStatus.WAITING])
def test_a_stop_that_is_not_a_failure_or_an_abort_is_refused_and_changes_nothing(status):
    request = Request("a", (1, 2, 3), SamplingParams())
    with pytest.raises(ValueError, match="failed or aborted"):
        request.stopped(status, "why", {"full": (4,)}, now=2.0)
    assert (request.status, request.finish_reason, request.final_block_tables) == (RequestStatus.WAITING, None, {})

@pytest.mark.parametrize(("start", "end"), [(0, 0), (0, 3), (2, 5), (3, 6), (4, 6), (0, 6), (6, 6)])
def test_tokens_slices_the_context_across_prompt_and_output(start, end):
    request = Request("a", (10, 11, 12, 13), SamplingParams())
    request.append_token(14, now=1.0)
    request.append_token(15, now=2.0)
    assert request.tokens(start, end) == request.all_token_ids[start:end]
    assert request.first_token_time == 1.0 and not request.prefilling


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seed": 2**64}, "seed must be an integer in [0, 2**63 - 1]"),  # torch's generator refused it, after
        ({"seed": -1}, "seed must be an integer"),  # the request was recorded
        ({"seed": 1.5}, "seed must be an integer"),
        ({"temperature": 1e-45}, "temperature must be 0 (greedy) or in [1e-05, 10]"),  # logits / T overflowed
        ({"temperature": float("nan")}, "temperature must be 0"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ],
)
def test_sampling_params_refuse_what_would_fail_later_in_a_step(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**fields)
