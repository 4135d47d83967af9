"""A generation's updates as OpenAI's response: one JSON body (`whole`) or server-sent events (`events`).

    shape = Shape(generation.request_id, model, chat, logprobs, include_usage, token_ids)
    body = await whole(request, generation, texts, shape)                       # non-streamed
    EventStream(events(request, generation, texts, shape), media_type="text/event-stream")   # streamed

Streamed, each chunk is `data: {...}`, and `data: [DONE]` comes last, as OpenAI and vLLM send them; with
`include_usage` every chunk has `usage`, null until the last. Choices carry their `token_ids` besides the
text (vLLM's `return_token_ids`) unless the request said not to.

Invariant: however a response ends (every choice done, the client gone, the engine stopped, a failed
send), its generation is closed, so every engine request it started that still runs is aborted.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.core.request import TokenLogprobs
from serving.errors import ApiError
from serving.generation import ChoiceText, ChoiceUpdate, Generation

DONE = "data: [DONE]\n\n"
DISCONNECTED = "the client disconnected"


async def whole(request: Request, generation: Generation, texts: list[ChoiceText], shape: Shape) -> dict[str, Any]:
    """The response body once every choice has ended (a client that leaves ends it early).

    Raises:
        ApiError: 503 when the engine stopped meanwhile.
    """
    choices: list[dict[str, Any]] = [{"text": "", "token_ids": [], "finish_reason": None, "logprobs": None}
                                     for _ in range(generation.num_choices)]  # fmt: skip
    try:
        async for update in generation.updates(texts, request.is_disconnected):
            choice = choices[update.index]
            choice["text"] += update.text
            choice["token_ids"] += update.token_ids
            choice["finish_reason"] = update.finish_reason or choice["finish_reason"]
            choice["logprobs"] = Logprobs.joined(choice["logprobs"], shape.logprobs_of(update, generation))
    except RuntimeError as exc:
        raise ApiError(503, str(exc)) from None
    finally:
        generation.close(DISCONNECTED)
    return shape.body(choices, generation)


class EventStream(StreamingResponse):
    """A streamed response that closes its generator however the stream ends: a client that went away
    mid-stream makes the send fail, and closing the generator aborts its engine requests."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def events(
    request: Request, generation: Generation, texts: list[ChoiceText], shape: Shape
) -> AsyncIterator[str]:
    try:
        if shape.chat:
            for index in range(generation.num_choices):
                yield _sse(shape.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))  # fmt: skip
        async for update in generation.updates(texts, request.is_disconnected):
            yield _sse(shape.chunk([shape.delta(update, shape.logprobs_of(update, generation))]))
        if shape.include_usage:
            yield _sse(shape.chunk([], generation.usage()))
        yield DONE
    except RuntimeError as exc:
        yield _sse(ApiError(503, str(exc)).body())
    finally:
        generation.close(DISCONNECTED)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Shape:
    """The JSON of one response: completion or chat, whole or in chunks."""

    def __init__(
        self, request_id: str, model: str, chat: bool, logprobs: Logprobs | None, include_usage: bool,
        token_ids: bool = True,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids  # choices carry their token ids (vLLM's return_token_ids)
        self.model = model
        self.chat = chat
        self.logprobs = logprobs  # None: the request asked for none
        self.include_usage = include_usage  # streamed: every chunk has `usage`, null but in the last (OpenAI's)
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = usage
        return out

    def logprobs_of(self, update: ChoiceUpdate, generation: Generation) -> dict[str, Any] | None:
        """The logprobs of the update's new tokens in OpenAI's shape (None when none were asked for)."""
        if self.logprobs is None:
            return None
        new = generation.last_updates[update.index].new_logprobs  # the engine update this choice update came from
        return self.logprobs.of(update.index, update.token_ids, new)

    def delta(self, update: ChoiceUpdate, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        common = {"index": update.index, "logprobs": logprobs, "finish_reason": update.finish_reason}
        if self.token_ids:
            common["token_ids"] = update.token_ids
        if self.chat:
            return {**common, "delta": {"content": update.text} if update.text else {}}
        return {**common, "text": update.text}

    def body(self, choices: list[dict[str, Any]], generation: Generation) -> dict[str, Any]:
        out = []
        for index, (choice, request_id) in enumerate(zip(choices, generation.request_ids)):
            logprobs = choice["logprobs"]
            if logprobs is None and self.logprobs is not None:
                logprobs = self.logprobs.of(index, [], ())  # asked for, and no token came
            common = {"index": index, "logprobs": logprobs, "finish_reason": choice["finish_reason"],
                      "request_id": request_id}  # fmt: skip
            if self.token_ids:
                common["token_ids"] = choice["token_ids"]
            if self.chat:
                out.append({**common, "message": {"role": "assistant", "content": choice["text"]}})
            else:
                out.append({**common, "text": choice["text"]})
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": out, "usage": generation.usage()}  # fmt: skip


class Logprobs:
    """Each choice's logprobs in OpenAI's shapes, from the engine's `TokenLogprobs` of its new tokens:

        chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                      "refusal": null}
        completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
                      "text_offset": [...]}

    A token's text is its id decoded alone (as vLLM shows it); "token_id:N" for a model without a tokenizer.
    """

    MAX_PIECES = 4096  # token texts kept per response (a response decodes each id once, up to this many)

    def __init__(self, tokenizer: Any, chat: bool, num_choices: int) -> None:
        self._tokenizer = tokenizer
        self._chat = chat
        self._offsets = [0] * num_choices  # completions: characters of the choice's tokens so far
        self._pieces: dict[int, str] = {}

    def of(self, index: int, token_ids: list[int], logprobs: tuple[TokenLogprobs, ...]) -> dict[str, Any]:
        """The logprobs of one choice's new tokens (`token_ids`, one `TokenLogprobs` each)."""
        pairs = list(zip(token_ids, logprobs))
        if self._chat:
            content = [{**self._entry(token, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                       for token, lp in pairs]  # fmt: skip
            return {"content": content, "refusal": None}
        tokens = [self._piece(token) for token, _ in pairs]
        offsets = []
        for piece in tokens:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in pairs],
            "top_logprobs": [{self._piece(t): v for t, v in lp.top} for _, lp in pairs],
            "text_offset": offsets,
        }

    @staticmethod
    def joined(whole: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
        """`part` appended to `whole` (a choice's logprobs so far), list by list."""
        if whole is None or part is None:
            return part if whole is None else whole
        return {key: value + part[key] if isinstance(value, list) else value for key, value in whole.items()}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self._piece(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8", "replace"))}

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = f"token_id:{token}" if self._tokenizer is None else self._tokenizer.decode([token])
            if len(self._pieces) < self.MAX_PIECES:
                self._pieces[token] = piece
        return piece
