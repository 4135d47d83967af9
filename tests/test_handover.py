"""The hand-over ledger both history writers keep (storage/write/handover.py): numbering, the bound, and
counts that add up exactly; and the one contract both writers satisfy (writer_types.HistoryWriter)."""

from __future__ import annotations

import threading
import time

from storage.write.handover import Handed, Ledger
from storage.write.writer_types import HistoryWriter


def ledger_with(bound: int) -> tuple[Ledger, threading.Condition, list[int]]:
    changed = threading.Condition()
    delivered: list[int] = []
    return Ledger(changed, bound), changed, delivered


def hand(ledger: Ledger, delivered: list[int], num_rows: int, wait: bool = False) -> bool:
    def deliver(seq: int) -> Handed:
        delivered.append(seq)
        return Handed(seq, num_rows, time.monotonic())

    return ledger.hand_over(deliver, num_rows, wait)


def test_rows_beyond_the_bound_are_refused_and_counted_once_while_control_messages_go() -> None:
    ledger, changed, delivered = ledger_with(2)
    with changed:
        assert hand(ledger, delivered, 10) and hand(ledger, delivered, 0)
        assert not hand(ledger, delivered, 5)  # two in flight: refused
        assert hand(ledger, delivered, 0)  # a control message always goes
        assert (ledger.accepted, ledger.refused, ledger.queued) == (15, 5, 10)
        assert delivered == [1, 2, 3] and ledger.mark() == 3 and ledger.done_through() == 0
        ledger.done_through_seq(2)
        assert ledger.done_through() == 2 and ledger.queued == 0 and ledger.lag_s() == 0.0


def test_a_caller_that_may_wait_gets_room_when_a_message_is_done() -> None:
    ledger, changed, delivered = ledger_with(1)
    with changed:
        assert hand(ledger, delivered, 3)
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(hand_locked(ledger, changed, delivered, 4)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive() and results == []
    with changed:
        ledger.done(ledger.in_flight[1])
    waiter.join(5)
    assert results == [True] and (ledger.accepted, ledger.refused, ledger.queued) == (7, 0, 4)


def hand_locked(ledger: Ledger, changed: threading.Condition, delivered: list[int], num_rows: int) -> bool:
    with changed:
        return hand(ledger, delivered, num_rows, wait=True)


def test_after_close_rows_are_refused_and_after_end_control_messages_are_done_at_once() -> None:
    ledger, changed, delivered = ledger_with(0)  # 0: no bound
    with changed:
        assert hand(ledger, delivered, 100)
        ledger.close()
        assert not hand(ledger, delivered, 1) and hand(ledger, delivered, 0)
        assert delivered == [1, 2] and ledger.refused == 1
        ledger.done_through_seq(2)
        ledger.end()
        assert hand(ledger, delivered, 0) and delivered == [1, 2]  # nothing takes it: done at once
        assert ledger.mark() == ledger.done_through() == 3
        assert (ledger.accepted, ledger.refused, ledger.queued) == (101, 1, 0)


def test_both_writers_keep_the_one_contract(make_writer, tmp_path) -> None:
    """make_writer (tests/storage_support.py) makes each kind: the in-process thread and the WriterProcess."""
    writer = make_writer(f"sqlite:///{tmp_path / 'h.sqlite'}")
    assert isinstance(writer, HistoryWriter)
