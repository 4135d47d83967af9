"""Engine commands the console's block timeline depends on: forks in one action, releases whose events
leave at once, a warm-up that changes nothing, and free blocks that hold nothing."""

from __future__ import annotations

import time

import pytest

from engine.core.config import EngineConfig
from engine.engine import Engine, RequestRejected
from engine.core.events import EventKind
from engine.core.request import SamplingParams
from storage.read.block_history import replay
from tests.engine_support import tokens
from tests.test_block_history import stored

PARAMS = SamplingParams(max_new_tokens=2, ignore_eos=True)


def engine(tmp_path, **overrides) -> Engine:
    fields = dict(model="tiny-llama", device="cpu", block_size=4, num_blocks=32, data_dir=tmp_path)
    return Engine(EngineConfig(**{**fields, **overrides}))


def retained_parent(e: Engine) -> str:
    """A finished, retained parent of one full block and a half-full one (5 prompt tokens + 1 fed back)."""
    parent = e.submit(tokens(5, 1), PARAMS, retain=True)
    e.run_until_idle()
    return parent


def test_fork_many_shares_the_tail_with_every_child_before_any_of_them_copies_it(tmp_path):
    e = engine(tmp_path)
    seen = []
    e.add_listener(lambda events, views: seen.extend(events))
    parent = retained_parent(e)
    tail = e.get(parent).block_table[-1]
    e.start()  # a running engine thread must not step between the children
    try:
        a, b = e.fork_many(parent, [[7], [8]], PARAMS, retain=True)
        while e.has_work():
            time.sleep(0.01)
    finally:
        e.stop()
    life = replay(stored(seen), [tail])[tail]
    assert [(row.event, row.ref_count) for row in life.rows] == [
        ("allocate", 1), ("fork", 2), ("fork", 3), ("cow", 2), ("cow", 1),
    ]  # fmt: skip
    assert e.get(a).cow_copies == e.get(b).cow_copies == 1


def test_fork_many_checks_every_child_before_creating_any(tmp_path):
    e = engine(tmp_path)
    parent = retained_parent(e)
    before = {v.request_id for v in e.requests()}
    with pytest.raises(ValueError, match="already taken"):
        e.fork_many(parent, [[7], [8]], PARAMS, request_ids=["x", "x"])
    with pytest.raises(ValueError, match="vocabulary"):
        e.fork_many(parent, [[7], [10**6]], PARAMS)
    with pytest.raises(RequestRejected):
        e.fork_many(parent, [[7], [8]], SamplingParams(max_new_tokens=200))  # more than the pool holds
    assert {v.request_id for v in e.requests() if v.status != "rejected"} == before
    assert e.get(parent).status == "retained" and e.stats().used_blocks == 2
    e.check_invariants()


def test_a_release_hands_its_events_to_listeners_at_once(tmp_path):
    """Regression: a retained request's RELEASE events waited in the log for the next step, so a
    release on an idle engine never reached the history (the block's last change was missing)."""
    e = engine(tmp_path)
    parent = retained_parent(e)
    seen = []
    e.add_listener(lambda events, views: seen.extend(events))
    e.release(parent)
    releases = [ev for ev in seen if ev.kind is EventKind.RELEASE]
    assert [ev.request_id for ev in releases] == [parent]
    assert sorted(releases[0].detail["block_ids"]) == sorted(e.get(parent).block_table)


def test_warm_up_changes_no_state_and_no_output(tmp_path):
    cold, warm = engine(tmp_path), engine(tmp_path)
    warm.warm_up()
    assert warm.stats() == cold.stats() and not warm.log.take()
    assert [v.ref_count for v in warm.snapshot().blocks] == [0] * 32
    prompt = tokens(30, 2)
    outputs = []
    for e in (cold, warm):
        rid = e.submit(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
        e.run_until_idle()
        outputs.append(e.get(rid).output_token_ids)
    assert outputs[0] == outputs[1]
    with pytest.raises(RuntimeError, match="before it serves"):
        warm.warm_up()  # its cache holds blocks now


def test_free_blocks_show_no_stale_tokens(tmp_path):
    """Regression: a block freed by its last holder still listed the tokens it once held."""
    e = engine(tmp_path)
    parent = retained_parent(e)
    tail = e.get(parent).block_table[-1]
    e.release(parent)
    view = next(v for v in e.snapshot().blocks if v.block_id == tail)
    assert view.state == "free" and view.num_tokens == 0 and view.token_ids == ()


def test_a_prompt_that_is_not_a_list_of_token_ids_is_a_value_error_and_records_nothing(tmp_path):
    e = engine(tmp_path)
    for prompt in (None, 5, "abc", [True, 4], [3.0, 4]):
        with pytest.raises(ValueError, match="prompt must be"):
            e.submit(prompt, PARAMS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="salt must be None or a string"):
        e.submit([3, 4, 5], PARAMS, salt={"tenant": 1})  # type: ignore[arg-type]
    assert e.requests() == [] and not e.has_work()


def test_a_fork_child_waiting_behind_a_request_that_cannot_start_goes_first(tmp_path):
    """The parent finishes unretained, so its waiting child alone holds its 2 blocks; the request ahead of
    the child needs 7 blocks for its prompt, and 6 are free. The child, which needs one more, runs first
    and frees its blocks; then the request starts."""
    e = engine(tmp_path, num_blocks=8, max_num_seqs=1)
    parent = e.submit(list(range(3, 11)), SamplingParams(max_new_tokens=2))
    e.step()
    big = e.submit(list(range(20, 48)), SamplingParams(max_new_tokens=1))
    child = e.fork(parent, [50], SamplingParams(max_new_tokens=1))
    finished = [view.request_id for view in e.run_until_idle(max_steps=200)]
    assert finished == [parent, child, big]
    assert e.get(child).hit_source == "fork" and e.get(child).preemptions == 0
    assert e.stats().used_blocks == 0
    e.check_invariants()


def test_waiting_fork_children_give_their_parents_blocks_back_when_nothing_can_run(tmp_path):
    """Two retained parents of 3 blocks each, a waiting child of each (holding its parent's blocks), then
    both parents released: each child needs 3 more blocks and 2 are free, so neither can start until the
    newest gives its share back. It then starts over from the prefix index, which still has its blocks."""
    e = engine(tmp_path, num_blocks=8, max_num_seqs=1)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    parents = [e.submit(tokens(11, seed), params, retain=True) for seed in (1, 2)]
    e.run_until_idle()
    children = [e.fork(parent, tokens(12, 10 + i), params) for i, parent in enumerate(parents)]
    for parent in parents:
        e.release(parent)
    e.run_until_idle(max_steps=200)
    first, second = (e.get(child) for child in children)
    assert (first.status, second.status) == ("finished", "finished")
    assert (first.hit_source, first.preemptions) == ("fork", 0)
    assert (second.hit_source, second.preemptions) == ("prefix", 1)  # the newest gave its share back
    assert e.stats().used_blocks == 0
    e.check_invariants()
