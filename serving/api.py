"""The OpenAI-compatible HTTP API over one engine process (FastAPI; uvicorn serves it, serving/server.py).

    GET  /v1/models             the one model the engine serves
    POST /v1/completions        a prompt as text or token ids
    POST /v1/chat/completions   messages rendered through the model's chat template (serving.prompts)
    POST /tokenize              the ids the engine would see for a prompt or a message list (vLLM's)
    GET  /metrics               the engine's vLLM-named metrics (engine.feeds.metrics_server)

Both completion endpoints take OpenAI's `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`, `user`,
`stream` (server-sent events, `data: {...}` per chunk and `data: [DONE]` last, as OpenAI and vLLM send
them) and vLLM's `ignore_eos` and `cache_salt`. Each choice is one engine request: a response's `id` is
choice 0's engine request id, the one the console shows and `python -m cli why` explains; the choices of
`n > 1` share the prompt's cached blocks (the later ones wait for the first to compute them, then hit).
`usage.prompt_tokens_details.cached_tokens` is the prompt tokens the engine served from its prefix cache.
Choices carry their `token_ids` besides the text (vLLM's `return_token_ids`).

Errors are OpenAI's body (serving/errors.py) with 400 (malformed JSON, wrong types, a prompt the engine
refuses, `max_tokens` or `n` out of bounds), 404 (unknown model), 413 (a body over `max_body_bytes`, by
its Content-Length or as it streams in) and 429 (`max_in_flight` engine requests unfinished).

The engine (engine/engine_process.py) steps in its own process; the handlers talk to it through an
`EngineClient` and never wait for a forward. It is found through a callable at each request, so a
restart (a new engine process) is followed; each engine gets its own gateway (`Bindings`). The console
reads and drives the same engine through serving/console_routes.py's `/engine/...` routes.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from engine.core.config import MAX_NEW_TOKENS
from engine.core.request import MAX_SEED, SamplingParams
from serving.console_routes import EngineHolder, console_router
from serving.engine_client import EngineClient
from serving.errors import ApiError, bad_request, too_large, unknown_model
from serving.gateway import DEFAULT_MAX_IN_FLIGHT, EngineGateway, request_label
from serving.generation import ChoiceText, ChoiceUpdate, Generation
from serving.prompts import encode_chat, encode_text, token_list
from serving.schemas import MAX_N, ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = "data: [DONE]\n\n"
Model = TypeVar("Model", bound=BaseModel)
DISCONNECTED = "the client disconnected"


@dataclass(frozen=True)
class ApiLimits:
    """What one server accepts."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger body is refused (413)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # engine requests started and unfinished; more is 429

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_in_flight < 1:
            raise ValueError("max_body_bytes must be at least 1024 and max_in_flight at least 1")


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
        params = _parse(CompletionRequest, await _read_json(request, limits.max_body_bytes))
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
        params = _parse(ChatCompletionRequest, await _read_json(request, limits.max_body_bytes))
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
        params = _parse(TokenizeRequest, await _read_json(request, limits.max_body_bytes))
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
async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refused (413) past `limit` bytes by its Content-Length or as it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError:
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _parse(model: type[Model], body: dict[str, Any]) -> Model:
    """`body` as `model`, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None  # the top-level field (a union adds member tags)
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None


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


def _samplings(params: SamplingFields, max_new: int) -> list[SamplingParams]:
    """One SamplingParams per choice. Choices of n > 1 get seeds seed, seed + 1, ... (a random base when
    none is given), so their samples differ; a single choice keeps the given seed (or the engine's)."""
    if not 1 <= params.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {params.n}", "n")
    if params.n == 1:
        seeds: list[int | None] = [params.seed]
    else:
        base = params.seed if params.seed is not None else random.randrange(MAX_SEED)
        seeds = [(base + i) % (MAX_SEED + 1) for i in range(params.n)]
    try:
        return [
            SamplingParams(max_new_tokens=max_new, temperature=float(params.temperature), top_p=float(params.top_p),
                           seed=seed, ignore_eos=params.ignore_eos)  # fmt: skip
            for seed in seeds
        ]
    except ValueError as exc:
        raise bad_request(str(exc)) from None


# ------------------------------------------------------------------ responses
async def _respond(
    request: Request, binding: EngineBinding, params: SamplingFields, tokens: list[int], max_new: int, *, chat: bool
) -> Response:
    samplings = _samplings(params, max_new)
    if params.stop_sequences() and binding.engine.tokenizer is None:
        raise bad_request("stop sequences need a model with a tokenizer: this one only takes token ids", "stop")
    generation = await binding.gateway.start(tokens, samplings, label=request_label(params.user), salt=params.cache_salt,
                                       kind="chatcmpl" if chat else "cmpl")  # fmt: skip
    texts = [ChoiceText(binding.engine.tokenizer, params.stop_sequences()) for _ in samplings]
    shape = _Shape(generation.request_id, binding.model_name, chat)
    if params.stream:
        include_usage = params.stream_options is not None and params.stream_options.include_usage
        return _EventStream(_events(request, generation, texts, shape, include_usage), media_type="text/event-stream")
    choices: list[dict[str, Any]] = [{"text": "", "token_ids": [], "finish_reason": None} for _ in samplings]
    try:
        async for update in generation.updates(texts, request.is_disconnected):
            choice = choices[update.index]
            choice["text"] += update.text
            choice["token_ids"] += update.token_ids
            choice["finish_reason"] = update.finish_reason or choice["finish_reason"]
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
    request: Request, generation: Generation, texts: list[ChoiceText], shape: _Shape, include_usage: bool
) -> AsyncIterator[str]:
    try:
        if shape.chat:
            for index in range(generation.num_choices):
                yield _sse(shape.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))  # fmt: skip
        async for update in generation.updates(texts, request.is_disconnected):
            yield _sse(shape.chunk([shape.delta(update)]))
        if include_usage:
            yield _sse({**shape.chunk([]), "usage": generation.usage()})
        yield DONE
    except RuntimeError as exc:
        yield _sse(ApiError(503, str(exc)).body())
    finally:
        generation.close(DISCONNECTED)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Shape:
    """The JSON of one response: completion or chat, whole or in chunks."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def delta(self, update: ChoiceUpdate) -> dict[str, Any]:
        common = {"index": update.index, "logprobs": None, "finish_reason": update.finish_reason,
                  "token_ids": update.token_ids}  # fmt: skip
        if self.chat:
            return {**common, "delta": {"content": update.text} if update.text else {}}
        return {**common, "text": update.text}

    def body(self, choices: list[dict[str, Any]], generation: Generation) -> dict[str, Any]:
        out = []
        for index, (choice, request_id) in enumerate(zip(choices, generation.request_ids)):
            common = {"index": index, "logprobs": None, "finish_reason": choice["finish_reason"],
                      "token_ids": choice["token_ids"], "request_id": request_id}  # fmt: skip
            if self.chat:
                out.append({**common, "message": {"role": "assistant", "content": choice["text"]}})
            else:
                out.append({**common, "text": choice["text"]})
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": out, "usage": generation.usage()}  # fmt: skip
