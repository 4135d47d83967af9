"""Requests leave the engine when they end (issue 43): nothing it holds grows with the requests it served.

A few thousand short requests (submits, seeded samplers, forks of retained parents, releases before and
after the end, aborts, rejections) run through a tiny model; after every round each per-request structure
is bounded by the live and retained requests plus the ring of RECENT_ENDED ended ones. Regression: before,
`Engine._requests` kept every request ever served, and `requests()`, `snapshot()` and `stats()` walked them.
"""

from __future__ import annotations

import random

import pytest

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.core.request_table import RECENT_ENDED
from engine.engine import Engine, RequestRejected
from tests.engine_support import tokens

ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)
TWO = SamplingParams(max_new_tokens=2, ignore_eos=True)


def make_engine(tmp_path, **overrides) -> Engine:
    fields = dict(model="tiny-llama", device="cpu", block_size=4, num_blocks=96, data_dir=tmp_path)
    fields.update(overrides)
    return Engine(EngineConfig(**fields))


def held_ids(engine: Engine) -> dict[str, set[str]]:
    """Request ids of every per-request structure inside the engine."""
    scheduler = engine.scheduler
    held = {
        "requests": set(engine._table.live),
        "retained": set(engine._table.retained),
        "ended": set(engine._table.ended),
        "generators": set(engine._generators),
        "waiting": {r.request_id for r in scheduler.waiting},
        "running": {r.request_id for r in scheduler.running},
    }
    for manager in engine.kv.managers:
        held[f"tables:{manager.pool.group}"] = set(manager.tables())
    if engine._verifier is not None:
        held["verifier"] = set(engine._verifier._logits)
    return held


def assert_bounded(engine: Engine, retained_by_test: set[str]) -> None:
    """Between rounds nothing runs: the engine holds the retained requests, and the ring."""
    assert set(engine._table.live) == retained_by_test
    assert len(engine.requests()) <= len(retained_by_test) + RECENT_ENDED
    held = held_ids(engine)
    assert held["requests"] == retained_by_test == held["retained"]
    assert len(held["ended"]) <= RECENT_ENDED
    for name, ids in held.items():
        if name != "ended":
            assert ids <= held["requests"], name
    assert len(engine.snapshot().requests) == len(engine.requests())
    assert engine.stats().num_retained == len(retained_by_test)
    assert len(engine.log) == 0
    engine.check_invariants()


def serve_round(engine: Engine, rng: random.Random, retained: set[str], n: int) -> int:
    """Submit about `n` requests of every kind and run them to the end; returns how many were submitted."""
    count = 0
    ids = []
    for _ in range(n):
        kind = rng.random()
        salt = rng.choice([None, "a", "b"])
        if kind < 0.45:
            ids.append(engine.submit(tokens(rng.randrange(3, 14), rng.randrange(1 << 30)), ONE, salt=salt))
        elif kind < 0.6:
            seeded = SamplingParams(max_new_tokens=2, temperature=0.8, seed=rng.randrange(100), ignore_eos=True)
            ids.append(engine.submit(tokens(rng.randrange(3, 14), rng.randrange(1 << 30)), seeded))
        elif kind < 0.7 and (bases := sorted(r for r in retained if engine.get(r).status == "retained")):
            parent = rng.choice(bases)
            ids += engine.fork_many(parent, [tokens(2, rng.randrange(1 << 30)) for _ in range(2)], ONE)
            count += 1
        elif kind < 0.8:
            rid = engine.submit(tokens(6, rng.randrange(1 << 30)), TWO, retain=True, salt=salt)
            if rng.random() < 0.3:
                engine.release(rid)  # before it ends: it frees its blocks when it finishes, and leaves
            else:
                retained.add(rid)
        elif kind < 0.9:
            rid = engine.submit(tokens(5, rng.randrange(1 << 30)), TWO)
            engine.abort(rid, "client went away")
        elif kind < 0.95:
            with pytest.raises(RequestRejected):
                engine.submit(tokens(5, 1), SamplingParams(max_new_tokens=1000, ignore_eos=True))
        else:
            engine.run_until_idle()
        count += 1
    engine.run_until_idle()
    while len(retained) > 4:  # fork bases come and go
        engine.release(retained.pop())
    return count


@pytest.mark.parametrize(
    ("overrides", "num_requests"),
    [({}, 3000), ({"attention_override": "hybrid:8", "verify_replay": True}, 600)],
    ids=["full-attention", "hybrid-verified"],
)
def test_serving_thousands_of_requests_keeps_every_per_request_structure_bounded(tmp_path, overrides, num_requests):
    engine = make_engine(tmp_path, **overrides)
    rng = random.Random(43)
    retained: set[str] = set()
    served = 0
    seen = set()
    while served < num_requests:
        served += serve_round(engine, rng, retained, 40)
        assert_bounded(engine, retained)
        seen |= {view.status.value for view in engine.requests()}
    assert seen == {"finished", "retained", "released", "rejected", "aborted"}
    assert engine.stats().fork_query_tokens > 0
    assert len(engine._table.ended) == RECENT_ENDED
    for rid in list(retained):
        engine.release(rid)
        retained.discard(rid)
    assert_bounded(engine, retained)
    assert not engine._table.live and not any(m.tables() for m in engine.kv.managers)


def test_an_ended_request_stays_readable_until_it_leaves_the_ring(tmp_path):
    engine = make_engine(tmp_path)
    first = engine.submit(tokens(5, 1), ONE)
    engine.run_until_idle()
    assert first not in engine._table.live
    view = engine.get(first)
    assert view.status == "finished" and len(view.output_token_ids) == 1
    assert [v.request_id for v in engine.requests()] == [first]
    for i in range(RECENT_ENDED - 1):
        engine.submit(tokens(3, 100 + i), ONE)
        engine.run_until_idle()
    assert engine.get(first) == view  # the last of the ring
    engine.submit(tokens(3, 99), ONE)
    engine.run_until_idle()
    with pytest.raises(KeyError, match="unknown request"):
        engine.get(first)
    assert len(engine.requests()) == RECENT_ENDED
    assert engine.submit(tokens(3, 5), ONE, request_id=first) == first  # the history has the old one


def test_commands_on_a_recently_ended_request_answer_as_before(tmp_path):
    engine = make_engine(tmp_path)
    parent = engine.submit(tokens(6, 2), TWO, retain=True)
    done = engine.submit(tokens(5, 3), ONE)
    engine.run_until_idle()
    assert engine.stats().num_retained == 1 and engine.get(parent).status == "retained"
    with pytest.raises(ValueError, match="already taken"):
        engine.submit(tokens(3, 4), ONE, request_id=done)
    with pytest.raises(ValueError, match="is finished: nothing to release"):
        engine.release(done)
    with pytest.raises(ValueError, match="cannot fork .* it is finished"):
        engine.fork(done, [7])
    assert engine.abort(done, "late") is False
    engine.release(parent)
    assert engine.get(parent).status == "released" and parent not in engine._table.live
    assert engine.stats().num_retained == 0
    with pytest.raises(ValueError, match="is released: nothing to release"):
        engine.release(parent)
    with pytest.raises(RequestRejected):
        engine.submit(tokens(5, 1), SamplingParams(max_new_tokens=1000, ignore_eos=True), request_id="big")
    assert engine.get("big").status == "rejected" and "big" not in engine._table.live
    with pytest.raises(ValueError, match="unknown request"):
        engine.release("nope")
    with pytest.raises(ValueError, match="unknown parent"):
        engine.fork("nope", [7])
    engine.check_invariants()


def test_retire_ends_every_request_and_keeps_none(tmp_path):
    engine = make_engine(tmp_path)
    retained = engine.submit(tokens(6, 2), ONE, retain=True)
    engine.run_until_idle()
    waiting = engine.submit(tokens(6, 3), TWO)
    changed = engine.retire("replaced")
    assert {v.request_id: v.status for v in changed} == {retained: "released", waiting: "aborted"}
    assert not engine._table.live and not engine._table.retained and not engine.has_work()
    assert {v.request_id for v in engine.requests()} == {retained, waiting}
    engine.check_invariants()
