"""One API request's choices as they come out of the engine: text, token ids, how each choice ended.

A `Generation` is fed on its event loop (`deliver`, which the gateway's listener schedules there once per
engine step) and read on the same loop (`updates`). Each choice's text is decoded from its whole output so far (byte-level BPE pieces only
make characters together), and a stop sequence ends the choice: its text is cut before the sequence and
its engine request is aborted. Text that could still become a stop sequence is held back until it cannot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.snapshot import RequestView

POLL_S = 0.5  # how often a waiting reader checks the engine's health and its client
ENDED = frozenset({"finished", "retained", "released", "rejected", "failed", "aborted"})
FINISH_REASONS = {"eos": "stop", "length": "length"}  # the engine's finish reasons as OpenAI names them
REPLACEMENT_CHAR = "\ufffd"  # what a decode gives for bytes that do not make a character yet


class Gateway(Protocol):
    engine: Any

    def abort(self, request_id: str, reason: str) -> None: ...

    def finished(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ChoiceUpdate:
    """What one choice produced since its last update."""

    index: int  # the choice
    text: str  # new text
    token_ids: list[int]  # new token ids
    finish_reason: str | None  # set on a choice's last update: "stop", "length" or "abort"


class ChoiceText:
    """One choice's output ids made text, cut at the first stop sequence."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1  # characters that may begin a stop sequence
        self._sent_chars = 0
        self._sent_ids = 0
        self.text = ""  # everything sent so far
        self.num_tokens = 0  # output tokens the choice produced up to its end

    def update(self, output_ids: tuple[int, ...], final: bool) -> tuple[str, list[int], bool]:
        """New text and ids for the output so far, and whether a stop sequence matched.

        Args:
            output_ids: the choice's whole output so far.
            final: the engine ended the request: send everything that is left.
        """
        new_ids = list(output_ids[self._sent_ids :])
        self._sent_ids = max(self._sent_ids, len(output_ids))
        self.num_tokens = self._sent_ids
        if self._tokenizer is None:
            return "", new_ids, False
        full = self._tokenizer.decode(list(output_ids), skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            return self._send(full[:cut]), new_ids, True
        if not final:
            end = len(full) - self._hold
            while end > 0 and full[end - 1] == REPLACEMENT_CHAR:  # an unfinished character: wait for its bytes
                end -= 1
            full = full[: max(end, self._sent_chars)]
        return self._send(full), new_ids, False

    def _send(self, text: str) -> str:
        delta = text[self._sent_chars :]
        self._sent_chars = max(self._sent_chars, len(text))
        self.text += delta
        return delta


class Generation:
    """The engine requests (one per choice) of one API request."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop, *, num_choices: int, prompt_tokens: int):
        self._gateway = gateway
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, RequestView]] = asyncio.Queue()
        self.num_choices = num_choices
        self.prompt_tokens = prompt_tokens
        self.request_ids: list[str] = []  # set by the gateway once every choice is submitted
        self.last_views: dict[int, RequestView] = {}  # the newest view of each choice
        self.texts: list[ChoiceText] = []
        self._open: set[int] = set(range(num_choices))

    @property
    def request_id(self) -> str:
        """The engine id of choice 0: the response's id."""
        return self.request_ids[0]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop that reads it: `deliver` must run there."""
        return self._loop

    def deliver(self, index: int, view: RequestView) -> None:
        """A choice's request changed (on the generation's loop; the gateway batches a step's views)."""
        self._queue.put_nowait((index, view))

    def _newest(self, first: tuple[int, RequestView]) -> list[tuple[int, RequestView]]:
        """`first` and every view queued behind it, only the newest per choice: a view holds the whole
        output so far, so a reader that fell behind sends one larger update instead of several."""
        newest = dict([first])
        while not self._queue.empty():
            index, view = self._queue.get_nowait()
            newest[index] = view
        return sorted(newest.items())

    async def updates(
        self, texts: list[ChoiceText], disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[ChoiceUpdate]:
        """Every choice's progress until all have ended.

        Args:
            texts: one decoder per choice.
            disconnected: polled while nothing arrives; when it says the client left, the generation
                stops (its requests are aborted by `close`).

        Raises:
            RuntimeError: the engine's loop died (its failure is the message).
        """
        self.texts = texts
        while self._open:
            try:
                first = await asyncio.wait_for(self._queue.get(), POLL_S)
            except TimeoutError:
                failure = getattr(self._gateway.engine, "failure", None)
                if failure is not None:
                    raise RuntimeError(f"the engine stopped: {failure}") from None
                if disconnected is not None and await disconnected():
                    return
                continue
            for index, view in self._newest(first):
                if index not in self._open:
                    continue  # a choice that already ended (a stop sequence's abort arriving)
                update = self._update(index, view)
                if update is not None:
                    yield update

    def _update(self, index: int, view: RequestView) -> ChoiceUpdate | None:
        """What a choice's newest view adds; ends the choice at a stop sequence or at the engine's end."""
        self.last_views[index] = view
        ended = view.status in ENDED
        text, ids, stopped = self.texts[index].update(view.output_token_ids, final=ended)
        finish = None
        if stopped:
            finish = "stop"
            self._gateway.abort(view.request_id, "a stop sequence matched")
        elif ended:
            finish = FINISH_REASONS.get(view.finish_reason or "", "abort")
        if finish is not None:
            self._open.discard(index)
            self._gateway.finished(view.request_id)
        return ChoiceUpdate(index, text, ids, finish) if text or ids or finish else None

    def close(self, reason: str) -> None:
        """Abort every choice still running (the client went away, or reading failed); idempotent."""
        for index in sorted(self._open):
            if index < len(self.request_ids):
                self._gateway.abort(self.request_ids[index], reason)
        self._open.clear()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object: the prompt counted once, every choice's output, and the prompt tokens
        the engine served from the prefix cache for choice 0 (`prompt_tokens_details.cached_tokens`)."""
        completion = sum(text.num_tokens for text in self.texts)
        first = self.last_views.get(0)
        cached = first.cached_tokens if first is not None else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
