"""The bridge between the API's event loop and the engine thread.

    gateway = EngineGateway(engine, max_in_flight=64)     # adds one listener to the engine
    generation = gateway.start(prompt, sampling, n=2, label="alice", salt=None, kind="chatcmpl")
    async for update in generation.updates(): ...         # tokens as the engine samples them
    gateway.close()                                       # removes the listener

The engine steps on its own thread and tells its listeners, after each step, which requests changed.
The gateway's listener hands the views of the requests it started to their generation's asyncio queue
(`loop.call_soon_threadsafe`), so the event loop never waits on the engine lock for tokens.

Invariants:
    * At most `max_in_flight` engine requests started here are unfinished at once; one more is refused
      (`ApiError` 429) before anything is submitted, so a flood costs a bounded amount of memory.
    * Every request a generation started ends in the engine when the generation is closed: one that is
      still waiting or running is aborted (its blocks freed), whatever ended the generation (the client
      went away, a stop sequence matched, an error).
    * The engine request id is the API's response id: "<kind>-<label>-<N>" (choice 0), "<id>.<i>" for
      choice i of n; the label is the client's `user`, reduced to [A-Za-z0-9_.@-], at most 40 characters.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
from typing import Any

from engine.core.request import SamplingParams
from engine.core.snapshot import RequestView
from engine.engine import Engine
from serving.errors import ApiError, bad_request, too_many_in_flight
from serving.generation import Generation

DEFAULT_MAX_IN_FLIGHT = 64  # engine requests started through the API and not yet ended
MAX_LABEL_CHARS = 40
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.@-]+")
_ID_ATTEMPTS = 1000  # ids tried past ones taken by other clients of the engine (the console's own names)


def _deliver(items: list[tuple[Generation, int, RequestView]]) -> None:
    """Hand one step's views to their generations (on their event loop)."""
    for generation, index, view in items:
        generation.deliver(index, view)


def request_label(user: str | None) -> str | None:
    """The part of a request id that names the client: its `user`, made safe for an id; None when empty."""
    if not user:
        return None
    label = _LABEL_UNSAFE.sub("_", user).strip("_")[:MAX_LABEL_CHARS]
    return label or None


class EngineGateway:
    """Starts API requests on one engine and routes the engine's updates to their generations."""

    def __init__(self, engine: Engine, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[Generation, int]] = {}  # engine request id -> (generation, choice index)
        self._reserved = 0  # choices being submitted, not yet routed
        self._ids = itertools.count()
        engine.add_listener(self._on_step)

    @property
    def in_flight(self) -> int:
        """Engine requests started here and not yet ended."""
        with self._lock:
            return len(self._routes)

    def start(
        self, prompt: list[int], samplings: list[SamplingParams], *, label: str | None, salt: str | None, kind: str
    ) -> Generation:
        """Submit one engine request per sampling (the choices) and return their generation.

        Must be called on the event loop that will read the generation.

        Raises:
            ApiError: 429 when the choices would exceed `max_in_flight`; 400 when the engine refuses the
                prompt (its message); nothing stays submitted then.
        """
        loop = asyncio.get_running_loop()
        n = len(samplings)
        with self._lock:
            if len(self._routes) + self._reserved + n > self.max_in_flight:
                raise too_many_in_flight(self.max_in_flight)
            self._reserved += n  # holds their places in the bound until they are routed
        base = f"{kind}-{label}" if label else kind
        generation = Generation(self, loop, num_choices=n, prompt_tokens=len(prompt))
        submitted: list[str] = []
        try:
            request_id = self._submit_first(base, prompt, samplings[0], salt, generation)
            submitted.append(request_id)
            for index in range(1, n):
                child_id = f"{request_id}.{index}"
                self._route(child_id, generation, index)
                self.engine.submit(prompt, samplings[index], request_id=child_id, salt=salt)
                submitted.append(child_id)
        except ValueError as exc:  # RequestRejected too: the engine's message says why
            for request_id in submitted:
                self.abort(request_id, "a sibling choice was refused")
            self._forget(generation)
            raise bad_request(str(exc), param="prompt") from None
        finally:
            with self._lock:
                self._reserved -= n
        generation.request_ids = submitted
        return generation

    def _submit_first(
        self, base: str, prompt: list[int], sampling: SamplingParams, salt: str | None, generation: Generation
    ) -> str:
        """Submit choice 0 under the next free id "<base>-<N>"; returns the id."""
        for _ in range(_ID_ATTEMPTS):
            request_id = f"{base}-{next(self._ids)}"
            if self._route(request_id, generation, 0):
                try:
                    self.engine.submit(prompt, sampling, request_id=request_id, salt=salt)
                    return request_id
                except ValueError as exc:
                    self._unroute(request_id)
                    if "already taken" not in str(exc):
                        raise
        raise ApiError(503, "no free request id")

    def _route(self, request_id: str, generation: Generation, index: int) -> bool:
        """Route `request_id`'s views to `generation` (registered before it is submitted: the engine
        publishes its SUBMIT at once). False when the id is routed already."""
        with self._lock:
            if request_id in self._routes:
                return False
            self._routes[request_id] = (generation, index)
            return True

    def _unroute(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)

    def _forget(self, generation: Generation) -> None:
        with self._lock:
            for request_id in [rid for rid, (g, _) in self._routes.items() if g is generation]:
                del self._routes[request_id]

    def finished(self, request_id: str) -> None:
        """The generation is done with `request_id` (it ended, or it was aborted): stop routing it."""
        self._unroute(request_id)

    def abort(self, request_id: str, reason: str) -> None:
        """End `request_id` in the engine if it is still waiting or running (its blocks are freed)."""
        self._unroute(request_id)  # first: once the engine says aborted, the request no longer counts here
        try:
            self.engine.abort(request_id, reason)
        except ValueError:
            pass  # unknown to the engine: it was never submitted

    def _on_step(self, events: list[Any], views: list[RequestView]) -> None:
        """The engine's listener (engine thread): hand each changed request of ours to its generation."""
        with self._lock:
            routed = [(*self._routes[v.request_id], v) for v in views if v.request_id in self._routes]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, int, RequestView]]] = {}
        for generation, index, view in routed:
            by_loop.setdefault(generation.loop, []).append((generation, index, view))
        for loop, items in by_loop.items():  # one wake-up of each loop per step, not one per request
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop was closed (its server stopped): nobody reads these any more
                pass

    def close(self) -> None:
        """Stop listening to the engine (the requests still running go on; their generations hear no more)."""
        try:
            self.engine.remove_listener(self._on_step)
        except ValueError:
            pass  # closed twice
