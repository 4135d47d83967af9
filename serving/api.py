"""The OpenAI-compatible HTTP API over one engine process (FastAPI; uvicorn serves it, serving/server.py).

    GET  /v1/models             the one model the engine serves
    POST /v1/completions        a prompt as text or token ids
    POST /v1/chat/completions   messages rendered through the model's chat template (serving.prompts)
    POST /tokenize              the ids the engine would see for a prompt or a message list (vLLM's)
    GET  /metrics               the engine's vLLM-named metrics (engine.feeds.metrics_server)

Both completion endpoints take OpenAI's `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`, `user`,
`presence_penalty`, `frequency_penalty`, `logit_bias`, logprobs (chat: `logprobs` + `top_logprobs`;
completions: `logprobs: k`), `stream` (server-sent events, `data: {...}` per chunk and `data: [DONE]`
last, as OpenAI and vLLM send them; with `stream_options.include_usage` every chunk has `usage`, null
until the last) and vLLM's `ignore_eos` and `cache_salt`. Any other field is refused (serving/schemas.py):
none is accepted and ignored. Logprobs are of the model's raw distribution, as vLLM reports them by default
(engine/runner/sampler.py). Each choice is one engine request: a response's `id` is
choice 0's engine request id, the one the console shows and `python -m cli why` explains; the choices of
`n > 1` share the prompt's cached blocks (the later ones wait for the first to compute them, then hit).
`usage.prompt_tokens_details.cached_tokens` is the prompt tokens the engine served from its prefix cache.
Choices carry their `token_ids` besides the text (vLLM's `return_token_ids`).

Errors are OpenAI's body (serving/errors.py) with 400 (malformed JSON, text holding a lone surrogate, a
body shorter than its Content-Length (it stops arriving for `body_idle_s`), wrong types, unsupported
fields, a prompt the engine refuses, sampling values out of bounds; `param` names the field), 404
(unknown model), 413 (a body over `max_body_bytes`, by its Content-Length or as it streams in) and 429
(`max_in_flight` engine requests unfinished).

The engine (engine/engine_process.py) steps in its own process; the handlers talk to it through an
`EngineClient` and never wait for a forward. It is found through a callable at each request, so a
restart (a new engine process) is followed; each engine gets its own gateway (`Bindings`). The console
reads and drives the same engine through serving/console_routes.py's `/engine/...` routes.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from engine.core.config import MAX_NEW_TOKENS
from engine.core.request import MAX_SEED, SamplingError, SamplingParams, TokenLogprobs
from serving.console_routes import EngineHolder, Refused, console_router, refusal_handler
from serving.engine_client import EngineClient
from serving.errors import ApiError, bad_request, too_large, unknown_model
from serving.gateway import DEFAULT_MAX_IN_FLIGHT, EngineGateway, request_label
from serving.generation import ChoiceText, ChoiceUpdate, Generation
from serving.prompts import encode_chat, encode_text, token_list
from serving.schemas import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    FieldRefused,
    SamplingFields,
    TokenizeRequest,
)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = "data: [DONE]\n\n"
Model = TypeVar("Model", bound=BaseModel)
DISCONNECTED = "the client disconnected"
DEFAULT_BODY_IDLE_S = 2.0
# A lone UTF-16 surrogate can only enter a body as a \uD800-\uDFFF escape or as its raw (invalid UTF-8)
# bytes, which `json.loads` lets through: a body without either cannot hold one (the exact check then walks it).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a character"


@dataclass(frozen=True)
class ApiLimits:
    """What one server accepts."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger body is refused (413)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # engine requests started and unfinished; more is 429
    body_idle_s: float = DEFAULT_BODY_IDLE_S  # a body that stops arriving this long before its end is a 400

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_in_flight < 1:
            raise ValueError("max_body_bytes must be at least 1024 and max_in_flight at least 1")
        if not 0 < self.body_idle_s <= 60:
            raise ValueError(f"body_idle_s must be in (0, 60], got {self.body_idle_s}")


class EngineBinding:
    """What the API keeps per engine process: its gateway (with its listener on the client)."""

    def __init__(self, engine: EngineClient, limits: ApiLimits) -> None:
        self.engine = engine
        self.gateway = EngineGateway(engine, max_in_flight=limits.max_in_flight)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def close(self) -> None:
        self.gateway.close()


class Bindings:
    """The binding of the engine `engines()` returns now; a new engine gets a new one, the old is closed."""

    def __init__(self, engines: Callable[[], EngineClient], limits: ApiLimits) -> None:
        self._engines = engines
        self._limits = limits
        self._lock = threading.Lock()
        self._binding: EngineBinding | None = None

    def current(self) -> EngineBinding:
        engine = self._engines()
        with self._lock:
            if self._binding is None or self._binding.engine is not engine:
                if self._binding is not None:
                    self._binding.close()
                self._binding = EngineBinding(engine, self._limits)
            return self._binding

    def close(self) -> None:
        with self._lock:
            if self._binding is not None:
                self._binding.close()
                self._binding = None


def create_app(holder: EngineHolder, limits: ApiLimits | None = None) -> FastAPI:
    """The API over the engine process `holder` runs now (a restart replaces it), and the console's
    `/engine/...` routes over the same process."""
    limits = limits or ApiLimits()
    bindings = Bindings(holder.current, limits)
    app = FastAPI(title="prefix-console OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.bindings = bindings
    app.state.holder = holder
    app.include_router(console_router(holder))
    app.add_exception_handler(Refused, refusal_handler)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        binding = bindings.current()
        card = {"id": binding.model_name, "object": "model", "created": 0, "owned_by": "prefix-console",
                "max_model_len": binding.engine.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        params = _parse(CompletionRequest, await _read_json(request, limits))
        binding = _binding_for(bindings, params.model)
        if params.echo:
            raise bad_request("echo is not supported", "echo")
        prompt = params.single_prompt()
        tokens = _encode(lambda: token_list(prompt, "prompt") if isinstance(prompt, list) else
                         encode_text(binding.engine.tokenizer, prompt), "prompt")  # fmt: skip
        max_new = _max_new_tokens(params.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        return await _respond(request, binding, params, tokens, max_new, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        params = _parse(ChatCompletionRequest, await _read_json(request, limits))
        binding = _binding_for(bindings, params.model)
        tokens = _encode(lambda: encode_chat(binding.engine.tokenizer, params.template_messages()), "messages")
        room = max(1, min(MAX_NEW_TOKENS, binding.engine.max_model_len - len(tokens)))  # vLLM's default: the rest
        given, name = (params.max_completion_tokens, "max_completion_tokens")
        if given is None:
            given, name = params.max_tokens, "max_tokens"
        max_new = _max_new_tokens(given, room, name)
        return await _respond(request, binding, params, tokens, max_new, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        params = _parse(TokenizeRequest, await _read_json(request, limits))
        binding = _binding_for(bindings, params.model) if params.model is not None else bindings.current()
        tokenizer = binding.engine.tokenizer
        if (params.prompt is None) == (params.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'")
        if params.prompt is not None:
            tokens = _encode(lambda: encode_text(tokenizer, params.prompt), "prompt")
        else:
            messages = [m.as_template_message() for m in params.messages or []]
            with_prompt = params.add_generation_prompt
            tokens = _encode(lambda: encode_chat(tokenizer, messages, add_generation_prompt=with_prompt), "messages")
        return {"count": len(tokens), "max_model_len": binding.engine.max_model_len, "tokens": tokens}

    @app.get("/metrics")
    async def metrics() -> Response:
        # Rendered by the engine process after its steps (at most a second old): a scrape never waits for one.
        return Response(bindings.current().engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


# ------------------------------------------------------------------ request checks
async def _read_json(request: Request, limits: ApiLimits) -> Any:
    """The body as a JSON object, refused (413) past `max_body_bytes` by its Content-Length or as it streams
    in, and (400) when it stops arriving for `body_idle_s` before its end (a Content-Length longer than
    what is sent), when the client leaves before its end, or when its text holds a lone surrogate."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    stream = request.stream()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), limits.body_idle_s)
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


def _parse(model: type[Model], body: dict[str, Any]) -> Model:
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


def _binding_for(bindings: Bindings, model: str) -> EngineBinding:
    binding = bindings.current()
    if model != binding.model_name:
        raise unknown_model(model, binding.model_name)
    return binding


def _encode(encode: Callable[[], list[int]], param: str) -> list[int]:
    try:
        return list(encode())
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def _max_new_tokens(given: int | None, default: int, name: str) -> int:
    if given is None:
        return default
    if not 1 <= given <= MAX_NEW_TOKENS:
        raise bad_request(f"{name} must be in [1, {MAX_NEW_TOKENS}], got {given}", name)
    return given


def _samplings(params: SamplingFields, max_new: int, vocab_size: int) -> list[SamplingParams]:
    """One SamplingParams per choice. Choices of n > 1 get seeds seed, seed + 1, ... (a random base when
    none is given), so their samples differ; a single choice keeps the given seed (or the engine's).

    Raises:
        ApiError: 400 naming the parameter out of its bounds (the engine's `SamplingError` names its field).
    """
    if not 1 <= params.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {params.n}", "n")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise bad_request(f"seed must be an integer in [0, 2**63 - 1], got {params.seed}", "seed")
    if params.n == 1:
        seeds: list[int | None] = [params.seed]
    else:
        base = params.seed if params.seed is not None else random.randrange(MAX_SEED)
        seeds = [(base + i) % (MAX_SEED + 1) for i in range(params.n)]
    try:
        logit_bias = params.logit_bias_pairs()
    except ValueError as exc:
        raise bad_request(str(exc), "logit_bias") from None
    outside = [token for token, _ in logit_bias if token >= vocab_size]
    if outside:
        raise bad_request(f"logit_bias names token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}",
                          "logit_bias")  # fmt: skip
    names = {"max_new_tokens": "max_tokens", "logprobs": params.logprobs_param}  # engine field -> API parameter
    try:
        return [
            SamplingParams(max_new_tokens=max_new, temperature=float(params.temperature), top_p=float(params.top_p),
                           seed=seed, ignore_eos=params.ignore_eos, presence_penalty=float(params.presence_penalty),
                           frequency_penalty=float(params.frequency_penalty), logit_bias=logit_bias,
                           logprobs=params.num_logprobs())  # fmt: skip
            for seed in seeds
        ]
    except SamplingError as exc:
        raise bad_request(str(exc), names.get(exc.field, exc.field)) from None


# ------------------------------------------------------------------ responses
async def _respond(
    request: Request, binding: EngineBinding, params: SamplingFields, tokens: list[int], max_new: int, *, chat: bool
) -> Response:
    samplings = _samplings(params, max_new, binding.engine.info.vocab_size)
    if params.stop_sequences() and binding.engine.tokenizer is None:
        raise bad_request("stop sequences need a model with a tokenizer: this one only takes token ids", "stop")
    generation = await binding.gateway.start(tokens, samplings, label=request_label(params.user), salt=params.cache_salt,
                                       kind="chatcmpl" if chat else "cmpl")  # fmt: skip
    texts = [ChoiceText(binding.engine.tokenizer, params.stop_sequences()) for _ in samplings]
    include_usage = params.stream_options is not None and params.stream_options.include_usage
    logprobs = _Logprobs(binding.engine.tokenizer, chat, len(samplings)) if params.num_logprobs() is not None else None
    shape = _Shape(generation.request_id, binding.model_name, chat, logprobs, include_usage, params.return_token_ids)
    if params.stream:
        return _EventStream(_events(request, generation, texts, shape), media_type="text/event-stream")
    choices: list[dict[str, Any]] = [{"text": "", "token_ids": [], "finish_reason": None, "logprobs": None}
                                     for _ in samplings]  # fmt: skip
    try:
        async for update in generation.updates(texts, request.is_disconnected):
            choice = choices[update.index]
            choice["text"] += update.text
            choice["token_ids"] += update.token_ids
            choice["finish_reason"] = update.finish_reason or choice["finish_reason"]
            choice["logprobs"] = _Logprobs.joined(choice["logprobs"], shape.logprobs_of(update, generation))
    except RuntimeError as exc:
        raise ApiError(503, str(exc)) from None
    finally:
        generation.close(DISCONNECTED)
    return JSONResponse(shape.body(choices, generation))


class _EventStream(StreamingResponse):
    """A streamed response that closes its generator however the stream ends: a client that went away
    mid-stream makes the send fail, and closing the generator aborts its engine requests."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _events(
    request: Request, generation: Generation, texts: list[ChoiceText], shape: _Shape
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


class _Shape:
    """The JSON of one response: completion or chat, whole or in chunks."""

    def __init__(
        self, request_id: str, model: str, chat: bool, logprobs: _Logprobs | None, include_usage: bool,
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


class _Logprobs:
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
