"""storage.write.writer_process's way to its child: numbered messages through an outbox and a sender thread
over a multiprocessing connection, whole and in order, the caller never waiting for the child."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select

from engine.core.events import Event, EventKind
from storage.schema import EVENTS, REQUESTS
from storage.write.writer import WriterOptions
from storage.write.writer_process import WriterProcess
from tests.storage_support import BASE_TIME, FAST, RUN_INFO, cache, count_rows, request_view, wait_for


def padded_events(batch: int, size: int, note_bytes: int) -> list[Event]:
    return [Event(EventKind.CACHE, batch, BASE_TIME, f"req-{batch}", i, 16, {"note": "x" * note_bytes}) for i in range(size)]


def returns_at_once(call: Callable[[], object]) -> None:
    """Run `call` on another thread and give it 30 s: a call that waited for the (stopped) child would hang."""
    caller = threading.Thread(target=call)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "the call waited for the writer process"


def started_writer(tmp_path: Path, **options) -> tuple[WriterProcess, str]:
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = WriterProcess(url, WriterOptions(**{**FAST, **options}))
    writer.start_run(RUN_INFO)
    assert writer.flush(timeout_s=30)
    return writer, url


def test_messages_arrive_whole_and_in_order_after_the_child_was_stalled(tmp_path: Path, engine_for) -> None:
    writer, url = started_writer(tmp_path, item_rows=100)
    os.kill(writer.pid, signal.SIGSTOP)
    try:  # ~4 MB: far more than the pipe holds, so the sender waits and the outbox holds the rest
        returns_at_once(lambda: [writer.submit(padded_events(batch, 100, 400)) for batch in range(100)])
        assert writer.stats().queued == 10_000 and writer.stats().dropped == 0
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    assert writer.flush(timeout_s=60)
    with engine_for(url).connect() as connection:
        steps = connection.scalars(select(EVENTS.c.step).order_by(EVENTS.c.id)).all()
    assert steps == sorted(steps) and len(steps) == 10_000
    assert writer.close(timeout_s=30)


def test_the_bound_refuses_rows_but_never_a_run_or_a_wait(tmp_path: Path) -> None:
    writer, _ = started_writer(tmp_path, queue_items=2, item_rows=10)
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        returns_at_once(lambda: [writer.submit([cache(10 * b + i, BASE_TIME) for i in range(10)]) for b in range(5)])
        stats = writer.stats()
        assert (stats.queued, stats.dropped) == (20, 30)  # two messages in flight, three refused whole
        returns_at_once(lambda: writer.start_run(RUN_INFO))  # a control message goes beyond the bound
        assert not writer.wait(writer.mark(), timeout_s=0.2)  # a wait is sent too, and times out
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    assert writer.flush(timeout_s=30)
    stats = writer.stats()
    assert (stats.written_events, stats.dropped, stats.queued) == (20, 30, 0)
    assert writer.close(timeout_s=30)


def test_a_child_that_went_away_neither_blocks_nor_raises(tmp_path: Path) -> None:
    writer, _ = started_writer(tmp_path, item_rows=100)
    first_pid = writer.pid
    os.kill(first_pid, signal.SIGKILL)
    returns_at_once(lambda: [writer.submit(padded_events(batch, 100, 4000)) for batch in range(20)])
    assert wait_for(lambda: writer.stats().restarts == 1, timeout_s=60)
    assert writer.flush(timeout_s=60)
    stats = writer.stats()
    assert stats.written_events + stats.dropped == 2000 and stats.queued == 0
    assert writer.close(timeout_s=30)


def test_large_views_and_events_cross_whole(tmp_path: Path, engine_for) -> None:
    writer, url = started_writer(tmp_path, item_rows=5000)
    writer.submit(padded_events(0, 5000, 200))  # one ~1.3 MB message
    writer.record_requests([request_view("long", prompt_token_ids=range(100_000), output_token_ids=range(70_000))])
    assert writer.flush(timeout_s=60)
    with engine_for(url).connect() as connection:
        prompt, output = connection.execute(select(REQUESTS.c.prompt_tokens, REQUESTS.c.output_token_ids)).one()
    assert prompt == 100_000 and list(output) == list(range(70_000))  # the prompt's count crosses, not its tokens
    assert count_rows(engine_for(url), EVENTS) == 5000
    assert writer.close(timeout_s=30)


def test_nothing_is_accepted_after_close_and_what_came_before_is_written(tmp_path: Path) -> None:
    writer, _ = started_writer(tmp_path, batch_interval_s=30.0)
    writer.submit([cache(i, BASE_TIME) for i in range(7)])
    assert writer.close(timeout_s=30)
    writer.submit([cache(i, BASE_TIME) for i in range(3)])
    stats = writer.stats()
    assert (stats.written_events, stats.dropped, stats.queued) == (7, 3, 0)
