"""One API request's choices as they come out of the engine: text, token ids, how each choice ended.

A `Generation` is fed on its event loop (`deliver`, which the gateway's listener schedules there once per
engine step, with the new tokens of each choice) and read on the same loop (`updates`). Each choice's text is decoded from its whole output so far (byte-level BPE pieces only
make characters together), and a stop sequence ends the choice: its text is cut before the sequence and
its engine request is aborted. Text that could still become a stop sequence is held back until it cannot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.engine_process import RequestUpdate

POLL_S = 0.5  # how often a waiting reader checks the engine's health
DISCONNECT_CHECK_S = 0.1  # how often a reader checks its client, also while tokens flow
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
        self._queue: asyncio.Queue[tuple[int, RequestUpdate]] = asyncio.Queue()
        self.num_choices = num_choices
        self.prompt_tokens = prompt_tokens
        self.request_ids: list[str] = []  # set by the gateway once every choice is submitted
        self.last_updates: dict[int, RequestUpdate] = {}  # the newest update of each choice
        self.outputs: list[list[int]] = [[] for _ in range(num_choices)]  # each choice's output ids so far
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

    def deliver(self, index: int, update: RequestUpdate) -> None:
        """A choice's request changed (on the generation's loop; the gateway batches a step's updates)."""
        self._queue.put_nowait((index, update))

    def _drain(self, first: tuple[int, RequestUpdate]) -> list[tuple[int, RequestUpdate]]:
        """`first` and every update queued behind it, folded into one per choice (new tokens in order, the
        newest status): a reader that fell behind sends one larger chunk instead of several."""
        folded: dict[int, RequestUpdate] = {}
        item: tuple[int, RequestUpdate] | None = first
        while item is not None:
            index, update = item
            earlier = folded.get(index)
            if earlier is not None:
                update = update._replace(new_token_ids=earlier.new_token_ids + update.new_token_ids,
                                         new_logprobs=earlier.new_logprobs + update.new_logprobs)  # fmt: skip
            folded[index] = update
            item = self._queue.get_nowait() if not self._queue.empty() else None
        return sorted(folded.items())

    async def updates(
        self, texts: list[ChoiceText], disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[ChoiceUpdate]:
        """Every choice's progress until all have ended.

        Args:
            texts: one decoder per choice.
            disconnected: polled every DISCONNECT_CHECK_S, while tokens flow too; when it says the client
                left, the generation stops (its requests are aborted by `close`, before the next step).

        Raises:
            RuntimeError: the engine's loop died (its failure is the message).
        """
        self.texts = texts
        checked = time.monotonic()
        while self._open:
            if disconnected is not None and time.monotonic() - checked >= DISCONNECT_CHECK_S:
                checked = time.monotonic()
                if await disconnected():
                    return
            try:
                first = await asyncio.wait_for(self._queue.get(), min(POLL_S, DISCONNECT_CHECK_S))
            except TimeoutError:
                failure = getattr(self._gateway.engine, "failure", None)
                if failure is not None:
                    raise RuntimeError(f"the engine stopped: {failure}") from None
                continue
            for index, update in self._drain(first):
                if index not in self._open:
                    continue  # a choice that already ended (a stop sequence's abort arriving)
                choice = self._update(index, update)
                if choice is not None:
                    yield choice

    def _update(self, index: int, update: RequestUpdate) -> ChoiceUpdate | None:
        """What a choice's update adds; ends the choice at a stop sequence or at the engine's end."""
        self.last_updates[index] = update
        self.outputs[index] += update.new_token_ids
        ended = update.status in ENDED
        text, ids, stopped = self.texts[index].update(tuple(self.outputs[index]), final=ended)
        finish = None
        if stopped:
            finish = "stop"
            self._gateway.abort(update.request_id, "a stop sequence matched")
        elif ended:
            finish = FINISH_REASONS.get(update.finish_reason or "", "abort")
        if finish is not None:
            self._open.discard(index)
            self._gateway.finished(update.request_id)
        return ChoiceUpdate(index, text, ids, finish) if text or ids or finish else None

    def close(self, reason: str) -> None:
        """Abort every choice still running (the client went away, or reading failed); idempotent."""
        for index in sorted(self._open):
            if index < len(self.request_ids):
                self._gateway.abort(self.request_ids[index], reason)
        self._open.clear()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object: the prompt counted once, every choice's output, and the prompt tokens
        the engine served from the prefix cache for choice 0 (`prompt_tokens_details.cached_tokens`, both
        tiers; `cached_tokens_by_tier` splits them into the pool's memory and the disk tier)."""
        completion = sum(text.num_tokens for text in self.texts)
        first = self.last_updates.get(0)
        cached = first.cached_tokens if first is not None else 0
        disk = first.disk_cached_tokens if first is not None else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "cached_tokens_by_tier": {"memory": cached - disk, "disk": disk}},
        }
