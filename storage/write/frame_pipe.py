"""Length-prefixed frames over an OS pipe, written without ever blocking the caller.

`FramePipe` is the writing end: `send` writes a frame straight into the pipe when the pipe has room
(one `os.write` on a non-blocking descriptor, no thread hand-off) and otherwise leaves it, or what is
left of it, in a backlog that a thread of its own writes out as the reader makes room. `read_frames` is
the reading end (blocking); `write_frame` writes one frame to a blocking stream (for a side that may
wait, such as a child process answering its parent).

Invariants:
  * frames reach the reader whole and in the order `send` accepted them: while the backlog holds
    anything, every new frame joins it behind the others;
  * at most `max_backlog` droppable frames wait in the backlog; `send` refuses more (and says so).
    Frames that may not be dropped (control messages) always join, until `close`: after it, `send`
    refuses everything (the descriptor is closed once the backlog is out, and its number may be reused);
  * `send` never waits for the reader: its only system call is one non-blocking write.

Frame: a 4-byte little-endian payload length, then the payload.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import BinaryIO

HEADER = struct.Struct("<I")
MAX_PAYLOAD = 2**32 - 1
# Ask Linux for a larger pipe buffer (the default is 64 KiB; 1 MiB is the unprivileged maximum by
# default) so that bursts go straight in; other systems keep their default.
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_WAIT_WRITABLE_S = 1.0  # the backlog thread rechecks for close this often while the reader is stalled


class FramePipe:
    """The writing end of a pipe: ordered frames, a bounded backlog, a thread that drains it."""

    def __init__(self, fd: int, max_backlog: int, on_tick: Callable[[], None], tick_s: float) -> None:
        """Take ownership of `fd` (the pipe's write end).

        Args:
            max_backlog: droppable frames that may wait for the reader.
            on_tick: called on the backlog thread every `tick_s` seconds while the backlog is empty (its
                owner sends what it held back for too long when its own sender has gone quiet); it must
                not raise.
        """
        os.set_blocking(fd, False)
        try:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
        self._fd = fd
        self._max_backlog = max_backlog
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._waiting = threading.Condition(self._lock)
        self._backlog: deque[tuple[memoryview, bool]] = deque()  # (unwritten bytes, droppable)
        self._num_droppable = 0  # droppable frames in the backlog
        self._broken = False  # the reader is gone: frames are accepted and discarded
        self._closing = False
        self._thread = threading.Thread(target=self._drain, name="frame-pipe", daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Frames waiting for the reader."""
        with self._lock:
            return len(self._backlog)

    def send(self, payload: bytes, droppable: bool = True) -> bool:
        """Write one frame now if the pipe has room, else queue it behind the others.

        Returns:
            False if the frame was refused: the pipe was closed, or it is droppable and `max_backlog`
            droppable frames are waiting.

        Raises:
            ValueError: the payload is longer than a frame can say.
        """
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"a frame holds at most {MAX_PAYLOAD} bytes")
        frame = HEADER.pack(len(payload)) + payload
        with self._lock:
            if self._closing:
                return False
            if self._broken:
                return True  # the reader is gone; its owner learns that from the reader's side
            if self._backlog:
                if droppable and self._num_droppable >= self._max_backlog:
                    return False
                self._queue(memoryview(frame), droppable)
                return True
            written = self._write(frame)
            if written < len(frame):
                self._queue(memoryview(frame)[written:], droppable)
            return True

    def close(self) -> None:
        """Close the pipe once the backlog is written (or the reader is gone); returns at once."""
        with self._lock:
            self._closing = True
            self._waiting.notify()

    def _queue(self, rest: memoryview, droppable: bool) -> None:
        self._backlog.append((rest, droppable))
        self._num_droppable += droppable
        self._waiting.notify()

    def _write(self, data: bytes | memoryview) -> int:
        """One non-blocking write (the lock held). Returns the bytes written; 0 when the pipe is full."""
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # BrokenPipeError and the like: the reader is gone
            self._broken = True
            self._backlog.clear()
            self._num_droppable = 0
            return len(data)

    def _drain(self) -> None:
        """The backlog thread: write the backlog as room appears; tick while there is none."""
        while True:
            with self._lock:
                if not self._backlog and not self._closing:
                    self._waiting.wait(self._tick_s)
                if not self._backlog:
                    if self._closing:
                        os.close(self._fd)  # under the lock: no write can follow on a reused number
                        return
                    tick = True
                else:
                    tick = False
                    rest, droppable = self._backlog[0]
                    written = self._write(rest)
                    if self._backlog and self._backlog[0][0] is rest:
                        if written == len(rest):
                            self._backlog.popleft()
                            self._num_droppable -= droppable
                        else:
                            self._backlog[0] = (rest[written:], droppable)
                    full = written < len(rest)
            if tick:
                self._on_tick()
            elif full:
                select.select([], [self._fd], [], _WAIT_WRITABLE_S)


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    """Write one frame to a blocking stream (the reading side's answers); raises OSError if it is closed."""
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frames(stream: BinaryIO) -> Iterator[bytes]:
    """The payloads of the frames in `stream`, in order, until it ends (a cut-off last frame is dropped)."""
    while True:
        header = stream.read(HEADER.size)
        if len(header) < HEADER.size:
            return
        (size,) = HEADER.unpack(header)
        payload = stream.read(size)
        if len(payload) < size:
            return
        yield payload
