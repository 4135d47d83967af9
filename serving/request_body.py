"""An API request's body: read within its bounds, checked for text no tokenizer can take, and parsed.

    body = await read_json(request, max_body_bytes, idle_s)    # a JSON object, or an ApiError (400, 413)
    params = parse(CompletionRequest, body)                      # the pydantic model, or a 400 naming the field

Invariant: every refusal is an `ApiError` with OpenAI's body (serving/errors.py), and a 400 names the
top-level field at fault where there is one (`param`); nothing is read past `max_body_bytes`.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from serving.errors import bad_request, too_large
from serving.schemas import FieldRefused

Model = TypeVar("Model", bound=BaseModel)
# A lone UTF-16 surrogate can only enter a body as a \uD800-\uDFFF escape or as its raw (invalid UTF-8)
# bytes, which `json.loads` lets through: a body without either cannot hold one (the exact check then walks it).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a character"


async def read_json(request: Request, max_body_bytes: int, idle_s: float) -> Any:
    """The body as a JSON object, refused (413) past `max_body_bytes` by its Content-Length or as it streams
    in, and (400) when it stops arriving for `idle_s` before its end (a Content-Length longer than what is
    sent), when the client leaves before its end, or when its text holds a lone surrogate."""
    limit = max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    stream = request.stream()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), idle_s)
            except StopAsyncIteration:
                break
            except TimeoutError:
                announced = f" of the {declared} its Content-Length announced" if declared else ""
                raise bad_request(f"the body stopped arriving after {size} bytes{announced}") from None
            except ClientDisconnect:
                raise bad_request("the client disconnected before its body ended") from None
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    finally:
        await stream.aclose()
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    if _MAYBE_SURROGATE.search(raw):
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """A 400 naming the top-level field whose text (a key or a string, at any depth) holds a lone UTF-16
    surrogate: it is no character, so no tokenizer can take it and no JSON answer can quote it."""
    for field, value in body.items():
        if _SURROGATE.search(field):
            raise bad_request(f"a field name {LONE_SURROGATE}")
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                found = _SURROGATE.search(item) is not None
            elif isinstance(item, dict):
                found = any(_SURROGATE.search(key) for key in item)
                pending.extend(item.values())
            else:
                found = False
                if isinstance(item, list):
                    pending.extend(item)
            if found:
                raise bad_request(f"{field}: the text {LONE_SURROGATE}", field)


def parse(model: type[Model], body: dict[str, Any]) -> Model:
    """`body` as `model`, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(body)
    except FieldRefused as exc:
        raise bad_request(str(exc), exc.param) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None  # the top-level field (a union adds member tags)
        if first["type"] == "extra_forbidden":
            raise bad_request(f"{param}: this server does not take this field (it ignores none)", param) from None
        message = first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {message}" if param else message, param) from None
