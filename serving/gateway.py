"""The bridge between the API's event loop and the engine process.

    gateway = EngineGateway(client, max_in_flight=64)      # adds one listener to the engine client
    generation = await gateway.start(prompt, samplings, label="alice", salt=None, kind="chatcmpl")
    async for update in generation.updates(texts): ...    # tokens as the engine samples them
    gateway.close()                                        # removes the listener

The engine steps in its own process (engine/engine_process.py) and publishes, after each step, what
changed for each request. The client's receiver thread calls the gateway's listener with those updates;
it hands the ones of the requests started here to their generation's asyncio queue
(`loop.call_soon_threadsafe`), one wake-up per loop per step. Submitting awaits the engine's reply on
the event loop, which goes on serving every other stream meanwhile.

Invariants:
    * At most `max_in_flight` engine requests started here are unfinished at once; one more is refused
      (`ApiError` 429) before anything is submitted, so a flood costs a bounded amount of memory.
    * Every request a generation started ends in the engine when the generation is closed: one that is
      still waiting or running is aborted (its blocks freed), whatever ended the generation (the client
      went away, a stop sequence matched, an error).
    * The engine request id is the API's response id: "<kind>-<label>-<random>" (choice 0), "<id>.<i>" for
      choice i of n, unique across runs and servers as vLLM's are; the label is the client's `user`,
      reduced to [A-Za-z0-9_.@-], at most 40 characters.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import threading

from engine.core.request import SamplingParams
from engine.engine_process import RequestUpdate
from serving.engine_client import EngineClient, EngineCommandError, EngineGone
from serving.errors import ApiError, bad_request, too_many_in_flight
from serving.generation import Generation

DEFAULT_MAX_IN_FLIGHT = 64  # engine requests started through the API and not yet ended
MAX_LABEL_CHARS = 40
ID_RANDOM_BYTES = 12  # 24 hex characters after the kind and label
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.@-]+")


def _deliver(items: list[tuple[Generation, int, RequestUpdate]]) -> None:
    """Hand one step's updates to their generations (on their event loop)."""
    for generation, index, update in items:
        generation.deliver(index, update)


def request_label(user: str | None) -> str | None:
    """The part of a request id that names the client: its `user`, made safe for an id; None when empty."""
    if not user:
        return None
    label = _LABEL_UNSAFE.sub("_", user).strip("_")[:MAX_LABEL_CHARS]
    return label or None


def new_request_id(kind: str, label: str | None) -> str:
    """A fresh API request id: random, so that no two runs (or servers on one history) ever share one."""
    token = secrets.token_hex(ID_RANDOM_BYTES)
    return f"{kind}-{label}-{token}" if label else f"{kind}-{token}"


class EngineGateway:
    """Starts API requests on one engine process and routes its updates to their generations."""

    def __init__(self, engine: EngineClient, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[Generation, int]] = {}  # engine request id -> (generation, choice index)
        self._reserved = 0  # choices being submitted, not yet routed
        engine.add_listener(self._on_step)

    @property
    def in_flight(self) -> int:
        """Engine requests started here and not yet ended."""
        with self._lock:
            return len(self._routes)

    async def start(
        self, prompt: list[int], samplings: list[SamplingParams], *, label: str | None, salt: str | None, kind: str
    ) -> Generation:
        """Submit one engine request per sampling (the choices) and return their generation.

        Must be awaited on the event loop that will read the generation.

        Raises:
            ApiError: 429 when the choices would exceed `max_in_flight`; 400 when the engine refuses the
                prompt (its message); 503 when the engine process is gone; nothing stays submitted then.
        """
        loop = asyncio.get_running_loop()
        n = len(samplings)
        with self._lock:
            if len(self._routes) + self._reserved + n > self.max_in_flight:
                raise too_many_in_flight(self.max_in_flight)
            self._reserved += n  # holds their places in the bound until they are routed
        generation = Generation(self, loop, num_choices=n, prompt_tokens=len(prompt))
        request_id = new_request_id(kind, label)
        ids = [request_id] + [f"{request_id}.{index}" for index in range(1, n)]
        try:
            for index, rid in enumerate(ids):
                self._route(rid, generation, index)  # before submitting: the engine publishes its SUBMIT at once
            replies = [self.engine.call("submit", prompt, sampling, request_id=rid, salt=salt)
                       for rid, sampling in zip(ids, samplings)]  # fmt: skip
            failure: BaseException | None = None
            for reply in replies:
                try:
                    await asyncio.wrap_future(reply)
                except (EngineCommandError, EngineGone) as exc:
                    failure = failure or exc
            if failure is not None:
                for rid in ids:
                    self.abort(rid, "a sibling choice was refused")
                if isinstance(failure, EngineGone):
                    raise ApiError(503, f"the engine is not running: {failure}")
                raise bad_request(str(failure), param="prompt")
        finally:
            with self._lock:
                self._reserved -= n
        generation.request_ids = ids
        return generation

    def _route(self, request_id: str, generation: Generation, index: int) -> None:
        with self._lock:
            self._routes[request_id] = (generation, index)

    def finished(self, request_id: str) -> None:
        """The generation is done with `request_id` (it ended, or it was aborted): stop routing it."""
        with self._lock:
            self._routes.pop(request_id, None)

    def abort(self, request_id: str, reason: str) -> None:
        """End `request_id` in the engine if it is still waiting or running (its blocks are freed); the
        engine applies it before its next step."""
        self.finished(request_id)  # first: once the engine says aborted, the request no longer counts here
        self.engine.tell("abort", request_id, reason)

    def _on_step(self, updates: list[RequestUpdate]) -> None:
        """The client's listener (its receiver thread): hand each update of ours to its generation."""
        with self._lock:
            routed = [(*self._routes[u.request_id], u) for u in updates if u.request_id in self._routes]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, int, RequestUpdate]]] = {}
        for generation, index, update in routed:
            by_loop.setdefault(generation.loop, []).append((generation, index, update))
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
