"""The requests an engine holds, by id, and the ids it hands out.

Requests leave the table when they end. It holds the live requests (waiting, running) and the retained
ones (fork bases, until released), and the final `RequestView`s of the last `RECENT_ENDED` requests that
ended (finished, released, rejected, failed, aborted); the history database keeps every request. So
nothing here grows with the number of requests an engine ever served, and the retained ones are counted
without a walk.

Invariants (`check_invariants`):
    * `live` holds exactly the requests that are waiting, running or retained; `retained` is the ids of
      the retained ones among them.
    * `ended` holds at most RECENT_ENDED views, oldest first, and no id is both live and ended.
    * An id is claimed once: `claim_id` never hands out an id that is live or recently ended.

Torch-free; the engine calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.core.admission import check_request_id
from engine.core.errors import require
from engine.core.request import Request, RequestStatus
from engine.core.snapshot import RequestView

RECENT_ENDED = 256  # ended requests whose final views the table keeps (`get`, `views`); older: the history
ViewOf = Callable[[Request], RequestView]


class RequestTable:
    """Live, retained and recently ended requests (see the module docstring)."""

    def __init__(self, first_request_number: int = 0) -> None:
        """`first_request_number`: N of the first generated id "req-N" (past the ids already in a shared history)."""
        if first_request_number < 0:
            raise ValueError(f"first_request_number must be non-negative, got {first_request_number}")
        self.live: dict[str, Request] = {}  # waiting, running and retained requests only
        self.retained: set[str] = set()  # the retained ones among them
        self.ended: OrderedDict[str, RequestView] = OrderedDict()  # last RECENT_ENDED ended, oldest first
        self.next_request_number = first_request_number  # the N of the next generated id "req-N"

    def claim_id(self, request_id: str | None, taken: set[str] | frozenset[str] = frozenset()) -> str:
        """A free request id: `request_id` checked, or the next "req-N"; `taken` are ids claimed but not yet
        recorded (the other children of one fork).

        Raises:
            AdmissionError: a malformed id.
            ValueError: an id already taken.
        """
        if request_id is None:  # the next "req-N" that no request holds (a caller may have named one so)
            while (request_id := f"req-{self.next_request_number}") in self.live or request_id in self.ended:
                self.next_request_number += 1
            self.next_request_number += 1
        rid = check_request_id(request_id)
        if rid in self.live or rid in self.ended or rid in taken:
            raise ValueError(f"request id {rid!r} is already taken")
        return rid

    def status_of(self, request_id: str) -> RequestStatus | None:
        """The status of a live, retained or recently ended request; None for an id the table does not know."""
        request = self.live.get(request_id)
        if request is not None:
            return request.status
        ended = self.ended.get(request_id)
        return None if ended is None else RequestStatus(ended.status)

    def fork_base(self, parent_id: str) -> Request:
        """The request `parent_id`, which a fork may share blocks from.

        Raises:
            ValueError: an unknown id, or a request that holds no KV to share (waiting, ended, released).
        """
        status = self.status_of(parent_id)
        if status is None:
            raise ValueError(f"unknown parent request {parent_id!r}")
        parent = self.live.get(parent_id)
        if parent is None or not parent.status.holds_blocks:
            raise ValueError(
                f"cannot fork {parent_id!r}: it is {status.value}; only running or retained requests hold KV to share"
            )
        return parent

    def settle(self, request: Request, view_of: ViewOf) -> None:
        """File a request after a change of status (a new one too): a live one is held, a retained one
        counted; one that ended leaves, its final view (`view_of`) going into the ring of recently ended
        requests (the oldest drops out past RECENT_ENDED). Calling it twice is harmless."""
        rid = request.request_id
        if request.status is RequestStatus.RETAINED or not request.status.is_final:
            self.live[rid] = request
            if request.status is RequestStatus.RETAINED:
                self.retained.add(rid)
            return
        self.retained.discard(rid)
        self.live.pop(rid, None)
        self.ended.pop(rid, None)
        self.ended[rid] = view_of(request)
        while len(self.ended) > RECENT_ENDED:
            self.ended.popitem(last=False)

    def get(self, request_id: str, view_of: ViewOf) -> RequestView:
        """A live or retained request as of now, or a recently ended one as it ended.

        Raises:
            KeyError: an id the table does not know, or one that ended more than RECENT_ENDED requests ago.
        """
        request = self.live.get(request_id)
        if request is not None:
            return view_of(request)
        ended = self.ended.get(request_id)
        if ended is None:
            raise KeyError(f"unknown request {request_id!r}")
        return ended

    def views(self, view_of: ViewOf) -> list[RequestView]:
        """The live and retained requests as of now and the recently ended ones, by arrival, oldest first."""
        views = [*self.ended.values(), *(view_of(r) for r in self.live.values())]
        return sorted(views, key=lambda view: view.arrival_time)

    def check_invariants(self) -> None:
        """Raise InvariantError if an invariant of the module docstring is broken."""
        require(len(self.ended) <= RECENT_ENDED, f"{len(self.ended)} ended requests kept")
        require(not self.ended.keys() & self.live.keys(), "a request is both live and ended")
        retained = {rid for rid, r in self.live.items() if r.status is RequestStatus.RETAINED}
        require(self.retained == retained, "the retained count disagrees with the requests")
        for request in self.live.values():
            require(
                not request.status.is_final or request.status is RequestStatus.RETAINED,
                f"{request.request_id}: {request.status.value} but still held",
            )
