"""storage.write.frame_pipe: ordered, whole frames over a pipe whose writer never waits for its reader."""

from __future__ import annotations

import os
import threading

import pytest

from storage.write.frame_pipe import FramePipe, read_frames


def payload(index: int, size: int) -> bytes:
    return index.to_bytes(4, "little") * (size // 4)


def make_pipe(max_backlog: int, on_tick=lambda: None, tick_s: float = 60.0) -> tuple[FramePipe, int]:
    read_fd, write_fd = os.pipe()
    return FramePipe(write_fd, max_backlog, on_tick, tick_s), read_fd


def send_all(pipe: FramePipe, frames: list[tuple[bytes, bool]]) -> list[bool]:
    """Send from another thread and give it 30 s: a send that waited for the (absent) reader would hang."""
    accepted: list[bool] = []
    sender = threading.Thread(target=lambda: accepted.extend(pipe.send(data, droppable) for data, droppable in frames))
    sender.start()
    sender.join(timeout=30)
    assert not sender.is_alive(), "send waited for the reader"
    return accepted


def test_frames_arrive_whole_and_in_order_after_the_reader_was_stalled() -> None:
    pipe, read_fd = make_pipe(max_backlog=100)
    frames = [payload(i, 300_000 + i) for i in range(12)]  # ~3.6 MB: far more than the pipe holds
    assert all(send_all(pipe, [(data, True) for data in frames]))
    assert pipe.backlog > 0  # the reader has not read a byte yet: the rest waits, partly written
    pipe.close()
    with os.fdopen(read_fd, "rb") as reader:
        assert list(read_frames(reader)) == frames


def test_a_full_backlog_refuses_droppable_frames_but_never_control_frames() -> None:
    pipe, read_fd = make_pipe(max_backlog=2)
    big = payload(0, 2_000_000)  # fills the pipe, and its rest starts the backlog
    small = [(payload(i, 64), i != 3) for i in range(1, 5)]  # frame 3 is a control frame
    results = send_all(pipe, [(big, True), *small])
    assert results == [True, True, False, True, False]
    pipe.close()
    with os.fdopen(read_fd, "rb") as reader:
        assert list(read_frames(reader)) == [big, payload(1, 64), payload(3, 64)]


def test_a_reader_that_went_away_neither_blocks_nor_raises() -> None:
    pipe, read_fd = make_pipe(max_backlog=4)
    os.close(read_fd)
    assert all(send_all(pipe, [(payload(i, 500_000), True) for i in range(4)]))
    assert pipe.backlog == 0
    pipe.close()


def test_the_pipe_ticks_while_it_has_nothing_to_write() -> None:
    ticks = threading.Semaphore(0)
    pipe, read_fd = make_pipe(max_backlog=4, on_tick=ticks.release, tick_s=0.01)
    assert ticks.acquire(timeout=10) and ticks.acquire(timeout=10)
    pipe.close()
    os.close(read_fd)


def test_a_cut_off_last_frame_is_not_read(tmp_path) -> None:
    path = tmp_path / "frames"
    read_fd, write_fd = os.pipe()
    pipe = FramePipe(write_fd, 4, lambda: None, 60.0)
    assert pipe.send(b"whole")
    assert pipe.send(b"cut off")
    pipe.close()
    with os.fdopen(read_fd, "rb") as reader:
        data = reader.read()
    path.write_bytes(data[:-2])
    with path.open("rb") as stream:
        assert list(read_frames(stream)) == [b"whole"]


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 65_537])
def test_payload_sizes_round_trip(size: int) -> None:
    pipe, read_fd = make_pipe(max_backlog=4)
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert pipe.send(data)
    pipe.close()
    with os.fdopen(read_fd, "rb") as reader:
        assert list(read_frames(reader)) == [data]


def test_nothing_is_accepted_after_close_and_what_came_before_still_arrives() -> None:
    pipe, read_fd = make_pipe(max_backlog=4)
    assert pipe.send(b"before")
    pipe.close()
    assert not pipe.send(b"after") and not pipe.send(b"control after", droppable=False)
    with os.fdopen(read_fd, "rb") as reader:
        assert list(read_frames(reader)) == [b"before"]
