"""What a history writer owes its callers between a call and the database: numbering, the bound, exact counts.

Both writers (storage.write.writer.EventWriter in-process, storage.write.writer_process.WriterProcess with
its database work in a child) hand each call over as one numbered message and keep this ledger of it:

    * Numbering: messages are numbered from 1 in calling order; `mark()` is the newest number, and
      `done_through()` the newest up to which every message is done (written or dropped).
    * The bound: at most `bound` messages are in flight, handed over and not yet done (0: no bound). A
      message with rows beyond it is refused, its rows counted in `refused`, unless its caller may wait
      (`wait=True`: it waits for room instead). After `close()` every message with rows is refused.
      Messages without rows (a run, a hurry, a close) always go; after `end()` (nothing takes messages
      any more) they are done as soon as they are numbered.
    * Counting: `accepted` counts every row handed over, refused ones included; `queued` the rows of the
      messages in flight. A message leaves the flight once (`done`, `done_through_seq`), so a writer that
      counts what it wrote or dropped keeps accepted == written + queued + dropped, exactly.
    * `lag_s()` is the age of the oldest message with rows in flight.

The ledger has no lock of its own: every method runs under the owner's lock, and waits and notifies on
the owner's condition (`changed`), so the ledger and the state the owner guards with it change together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Handed:
    """One message in flight: handed over, not yet written or dropped."""

    seq: int  # its number, in calling order
    num_rows: int  # rows it carries (0 for a control message)
    since: float  # monotonic time it was handed over


class Ledger:
    """The messages in flight and their counts. See the module docstring for the rules."""

    def __init__(self, changed: threading.Condition, bound: int) -> None:
        self._changed = changed
        self._bound = bound
        self._next_seq = 1
        self.in_flight: dict[int, Handed] = {}  # every message not done, by number (in order)
        self.accepted = 0  # every row handed over, refused ones included
        self.refused = 0  # rows refused at the hand-over: no room, or closed
        self.queued = 0  # rows of the messages in flight
        self.closed = False  # rows are refused from now on
        self._ended = False  # nothing takes messages any more

    def hand_over(self, deliver: Callable[[int], Handed], num_rows: int, wait: bool = False) -> bool:
        """Number a message and have `deliver(number)` pass it on (the owner's queue or outbox); the
        ledger keeps what it returns in flight.

        Returns:
            False if the message was refused (its rows are counted in `refused`). `deliver` is not called
            then, nor after `end()`.
        """
        while num_rows and wait and not self.closed and self._full():
            self._changed.wait()
        self.accepted += num_rows
        if num_rows and (self.closed or self._full()):
            self.refused += num_rows
            return False
        if self._ended:  # a message without rows that nothing will take: done at once
            self._next_seq += 1
            self._changed.notify_all()
            return True
        message = deliver(self._next_seq)
        self._next_seq += 1
        self.in_flight[message.seq] = message
        self.queued += num_rows
        self._changed.notify_all()
        return True

    def done(self, message: Handed) -> None:
        """`message` is written or dropped."""
        del self.in_flight[message.seq]
        self.queued -= message.num_rows
        self._changed.notify_all()

    def done_through_seq(self, seq: int) -> None:
        """Every message up to number `seq` is written or dropped."""
        for message in list(self.in_flight.values()):
            if message.seq > seq:
                return
            self.done(message)

    def close(self) -> None:
        """Refuse every message with rows from now on (waiting callers are refused too)."""
        self.closed = True
        self._changed.notify_all()

    def end(self) -> None:
        """Nothing takes messages any more (the owner settles what it still holds): close, and have every
        later message done at once."""
        self._ended = True
        self.close()

    def mark(self) -> int:
        """The number of the newest message."""
        return self._next_seq - 1

    def done_through(self) -> int:
        """Every message up to this number is written or dropped."""
        return next(iter(self.in_flight), self._next_seq) - 1

    def lag_s(self) -> float:
        """The age of the oldest message with rows in flight (0.0: none)."""
        oldest = next((message.since for message in self.in_flight.values() if message.num_rows), None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def _full(self) -> bool:
        return bool(self._bound) and len(self.in_flight) >= self._bound
