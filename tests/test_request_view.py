"""What a RequestView answers the console (releasable, holds_blocks, is_final), checked against the
engine's own commands, so a page that asks the view cannot disagree with what the engine then does."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.kv_groups import max_hit_blocks
from engine.core.request import RequestStatus, SamplingParams
from engine.core.snapshot import RequestView, newest_first
from engine.engine import Engine, RequestRejected
from storage.db import db_engine
from storage.read import queries
from storage.write.writer import EventWriter, WriterOptions
from tests.engine_support import tokens
from tests.storage_support import FAST, RUN_INFO

SHORT = SamplingParams(max_new_tokens=2, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=16, ignore_eos=True)
BLOCK_SIZE = 4
NUM_BLOCKS = 32

# status: (holds_blocks, is_final), written out by hand from the request diagram (engine/core/request.py)
ANSWERS = {
    RequestStatus.WAITING: (False, False),
    RequestStatus.RUNNING: (True, False),
    RequestStatus.RETAINED: (True, True),
    RequestStatus.FINISHED: (False, True),
    RequestStatus.RELEASED: (False, True),
    RequestStatus.REJECTED: (False, True),
    RequestStatus.FAILED: (False, True),
    RequestStatus.ABORTED: (False, True),
}
# (status, retain) pairs an operator may release: a retained request now, a retaining one when it finishes
RELEASABLE = {(RequestStatus.RETAINED, False), (RequestStatus.RETAINED, True),
              (RequestStatus.WAITING, True), (RequestStatus.RUNNING, True)}  # fmt: skip


def engine(tmp_path) -> Engine:
    config = EngineConfig(model="tiny-llama", device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, data_dir=tmp_path)
    return Engine(config)


def view(status: str, retain: bool = False, arrival_time: float = 0.0, request_id: str = "r") -> RequestView:
    """A view with every field but the asked ones at an empty value."""
    fields = dict.fromkeys(RequestView._fields)
    fields.update(request_id=request_id, status=status, retain=retain, arrival_time=arrival_time, block_tables={})
    return RequestView(**fields)


def release_accepted(e: Engine, request_id: str) -> bool:
    try:
        e.release(request_id)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("status", list(RequestStatus))
def test_each_status_answers_whether_it_holds_blocks_and_whether_it_is_final(status):
    assert (status.holds_blocks, status.is_final) == ANSWERS[status]
    for retain in (False, True):
        answers = (view(status, retain).holds_blocks, view(status, retain).is_final, view(status, retain).releasable)
        assert answers == (*ANSWERS[status], (status, retain) in RELEASABLE)


@pytest.mark.parametrize("status", list(RequestStatus))
def test_a_view_decoded_from_the_history_wire_with_a_plain_status_answers_the_same(status):
    plain = view(status.value, retain=True)
    assert type(plain.status) is str
    typed = view(status, retain=True)
    assert (plain.holds_blocks, plain.is_final, plain.releasable) == (typed.holds_blocks, typed.is_final, typed.releasable)


def test_a_view_is_releasable_exactly_when_the_engine_accepts_its_release(tmp_path):
    """Every status an engine reaches without a fault (failed needs non-finite logits), with and without
    retain: the view's answer, taken before the release, is the engine's verdict on it."""
    e = engine(tmp_path)
    ids = [e.submit(tokens(5, seed), SHORT, retain=retain) for seed, retain in ((1, False), (2, True), (3, True))]
    e.run_until_idle()  # finished, retained, and a retained one released below
    e.release(ids[2])
    ids += [e.submit(tokens(5, seed), LONG, retain=retain) for seed, retain in ((4, False), (5, True))]
    e.step()  # both prefill and sample: running
    ids += [e.submit(tokens(5, seed), LONG, retain=retain) for seed, retain in ((6, False), (7, True))]  # waiting
    with pytest.raises(RequestRejected):
        e.submit(tokens(NUM_BLOCKS * BLOCK_SIZE, 8), SHORT, request_id="too-large", retain=True)
    ids.append("too-large")
    views = [e.get(rid) for rid in ids]
    assert [(v.status, v.retain) for v in views] == [
        ("finished", False), ("retained", True), ("released", True), ("running", False), ("running", True),
        ("waiting", False), ("waiting", True), ("rejected", True),
    ]  # fmt: skip
    assert [release_accepted(e, v.request_id) for v in views] == [v.releasable for v in views]
    e.retire("replaced")  # the waiting and running ones end aborted
    aborted = [e.get(rid) for rid in ids[3:7]]
    assert {(v.status, v.releasable) for v in aborted} == {(RequestStatus.ABORTED, False)}
    assert [release_accepted(e, v.request_id) for v in aborted] == [False] * 4


def test_a_view_holds_blocks_exactly_when_the_engine_lets_it_be_forked(tmp_path):
    e = engine(tmp_path)
    done, kept = (e.submit(tokens(5, seed), SHORT, retain=retain) for seed, retain in ((1, False), (2, True)))
    e.run_until_idle()
    running = e.submit(tokens(5, 3), LONG)
    e.step()
    waiting = e.submit(tokens(5, 4), LONG)
    for rid in (done, kept, running, waiting):
        holds = e.get(rid).holds_blocks
        try:
            e.fork(rid, [9], SHORT)
        except ValueError:
            assert not holds, rid
        else:
            assert holds, rid
    assert [e.get(rid).holds_blocks for rid in (done, kept, running, waiting)] == [False, True, True, False]


def test_a_view_carries_its_status_as_the_enum_whose_value_the_history_stores(tmp_path):
    e = engine(tmp_path)
    rid = e.submit(tokens(5, 1), SHORT, retain=True)
    e.run_until_idle()
    status = e.get(rid).status
    assert status is RequestStatus.RETAINED and status == "retained" and f"{status}" == "retained"


def test_the_history_stores_the_status_as_the_plain_string_it_always_stored(tmp_path):
    e = engine(tmp_path)
    rid = e.submit(tokens(5, 1), SHORT, retain=True)
    e.run_until_idle()
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = EventWriter(url, WriterOptions(**FAST))
    try:
        run_id = writer.start_run(RUN_INFO)
        writer.record_requests([e.get(rid)])
        assert writer.flush(timeout_s=10)
    finally:
        writer.close()
    db = db_engine(url)
    try:
        status = queries.recent_requests(db, run_id).set_index("request_id").loc[rid, "status"]
    finally:
        db.dispose()
    assert type(status) is str and status == "retained"


def test_the_hit_cap_the_console_shows_is_the_one_the_engine_applies(tmp_path):
    """An 8-token prompt seen before reuses one block, not two: its last token is always computed."""
    e = engine(tmp_path)
    prompt = tokens(2 * BLOCK_SIZE, 1)
    e.submit(prompt, SHORT)
    e.run_until_idle()
    again = e.submit(prompt, SHORT)
    e.run_until_idle()
    assert max_hit_blocks(len(prompt), BLOCK_SIZE) == 1
    assert e.get(again).cached_tokens == max_hit_blocks(len(prompt), BLOCK_SIZE) * BLOCK_SIZE
    assert [max_hit_blocks(n, BLOCK_SIZE) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_newest_first_orders_by_arrival_and_keeps_ties_in_their_given_order():
    views = [view("waiting", arrival_time=t, request_id=rid) for rid, t in (("a", 1.0), ("b", 3.0), ("c", 2.0), ("d", 3.0))]
    assert [v.request_id for v in newest_first(views)] == ["b", "d", "c", "a"]
