"""The OpenAI-compatible HTTP API over one engine process (FastAPI; uvicorn serves it, serving/server.py).

    GET  /v1/models             the one model the engine serves
    POST /v1/completions        a prompt as text or token ids
    POST /v1/chat/completions   messages rendered through the model's chat template (serving.prompts)
    POST /tokenize              the ids the engine would see for a prompt or a message list (vLLM's)
    GET  /metrics               the engine's vLLM-named metrics (engine.feeds.metrics_server)

Both completion endpoints take OpenAI's `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`, `user`,
`presence_penalty`, `frequency_penalty`, `logit_bias`, logprobs (chat: `logprobs` + `top_logprobs`;
completions: `logprobs: k`), `stream` (server-sent events, serving/responses.py) and vLLM's
`ignore_eos` and `cache_salt`. Any other field is refused (serving/schemas.py):
none is accepted and ignored. Logprobs are of the model's raw distribution, as vLLM reports them by default
(engine/runner/sampler.py). Each choice is one engine request: a response's `id` is
choice 0's engine request id, the one the console shows and `python -m cli why` explains; the choices of
`n > 1` share the prompt's cached blocks (the later ones wait for the first to compute them, then hit).
`usage.prompt_tokens_details.cached_tokens` is the prompt tokens the engine served from its prefix cache.

Errors are OpenAI's body (serving/errors.py) with 400 (malformed JSON, text holding a lone surrogate, a
body shorter than its Content-Length (it stops arriving for `body_idle_s`): serving/request_body.py;
wrong types, unsupported fields: serving/schemas.py; any value out of its bounds, which the engine's
admission step (engine/core/admission.py) finds, run here before a request is sent, and the API only
names by its parameter; a prompt the engine rejects; `param` names the field), 404 (unknown model), 413
(a body over `max_body_bytes`, by its Content-Length or as it streams in) and 429 (`max_in_flight`
engine requests unfinished).

The engine (engine/engine_process.py) steps in its own process; the handlers talk to it through an
`EngineClient` and never wait for a forward. It is found through a callable at each request, so a
restart (a new engine process) is followed; each engine gets its own gateway (`Bindings`). The console
reads and drives the same engine through serving/console_routes.py's `/engine/...` routes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.core.admission import MAX_SEED, AdmissionError, ModelLimits, RequestInput, admit, room_for_output
from engine.core.request import SamplingParams
from serving.console_routes import EngineHolder, Refused, console_router, refusal_handler
from serving.engine_client import EngineClient
from serving.errors import ApiError, bad_request, unknown_model
from serving.gateway import DEFAULT_MAX_IN_FLIGHT, EngineGateway, request_label
from serving.generation import ChoiceText
from serving.prompts import encode_chat, encode_text, token_list
from serving.request_body import parse, read_json
from serving.responses import EventStream, Logprobs, Shape, events, whole
from serving.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_BODY_IDLE_S = 2.0


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
        params = parse(CompletionRequest, await read_json(request, limits.max_body_bytes, limits.body_idle_s))
        binding = _binding_for(bindings, params.model)
        if params.echo:
            raise bad_request("echo is not supported", "echo")
        prompt = params.single_prompt()
        tokens = _encode(lambda: token_list(prompt, "prompt") if isinstance(prompt, list) else
                         encode_text(binding.engine.tokenizer, prompt), "prompt")  # fmt: skip
        given = params.max_tokens
        max_new = _MaxTokens("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS if given is None else given)
        return await _respond(request, binding, params, tokens, max_new, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        params = parse(ChatCompletionRequest, await read_json(request, limits.max_body_bytes, limits.body_idle_s))
        binding = _binding_for(bindings, params.model)
        tokens = _encode(lambda: encode_chat(binding.engine.tokenizer, params.template_messages()), "messages")
        if params.max_completion_tokens is not None:
            max_new = _MaxTokens("max_completion_tokens", params.max_completion_tokens)
        else:  # vLLM's default: the rest of the model's positions
            room = room_for_output(len(tokens), _limits(binding))
            max_new = _MaxTokens("max_tokens", room if params.max_tokens is None else params.max_tokens)
        return await _respond(request, binding, params, tokens, max_new, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        params = parse(TokenizeRequest, await read_json(request, limits.max_body_bytes, limits.body_idle_s))
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


class _MaxTokens(NamedTuple):
    """The tokens a request may generate, and the parameter that set them (or would have: a default)."""

    param: str  # "max_tokens" or "max_completion_tokens"
    value: int


def _limits(binding: EngineBinding) -> ModelLimits:
    info = binding.engine.info
    return ModelLimits(info.vocab_size, info.max_model_len)


def _admitted(
    params: SamplingFields, tokens: list[int], max_new: _MaxTokens, limits: ModelLimits, *, chat: bool
) -> list[SamplingParams]:
    """One SamplingParams per choice, once the request passed the engine's admission step
    (engine/core/admission.py) here. Choices of n > 1 get seeds seed, seed + 1, ... (a random base when
    none is given), so their samples differ; a single choice keeps the given seed (or the engine's).

    Raises:
        ApiError: 400 naming the parameter the admission step refused (its `AdmissionError` field, by the
            API's name) or a `logit_bias` key that is not a token id.
    """
    names = {"max_new_tokens": max_new.param, "logprobs": params.logprobs_param, "salt": "cache_salt",
             "num_choices": "n", "prompt": "messages" if chat else "prompt"}  # fmt: skip
    try:
        logit_bias = params.logit_bias_pairs()
    except ValueError as exc:
        raise bad_request(str(exc), "logit_bias") from None
    try:
        sampling = SamplingParams(max_new_tokens=max_new.value, temperature=float(params.temperature),
                                  top_p=float(params.top_p), seed=params.seed, ignore_eos=params.ignore_eos,
                                  presence_penalty=float(params.presence_penalty),
                                  frequency_penalty=float(params.frequency_penalty), logit_bias=logit_bias,
                                  logprobs=params.num_logprobs())  # fmt: skip
        admit(RequestInput(tokens, sampling, params.cache_salt, params.stop_given(), params.n), limits)
    except AdmissionError as exc:
        param = names.get(exc.field, exc.field)
        raise bad_request(exc.describe(param), param) from None
    if params.n == 1:
        return [sampling]
    base = params.seed if params.seed is not None else random.randrange(MAX_SEED)
    return [replace(sampling, seed=(base + i) % (MAX_SEED + 1)) for i in range(params.n)]


# ------------------------------------------------------------------ responses
async def _respond(
    request: Request, binding: EngineBinding, params: SamplingFields, tokens: list[int], max_new: _MaxTokens,
    *, chat: bool,
) -> Response:
    samplings = _admitted(params, tokens, max_new, _limits(binding), chat=chat)
    if params.stop_sequences() and binding.engine.tokenizer is None:
        raise bad_request("stop sequences need a model with a tokenizer: this one only takes token ids", "stop")
    generation = await binding.gateway.start(tokens, samplings, label=request_label(params.user), salt=params.cache_salt,
                                       kind="chatcmpl" if chat else "cmpl")  # fmt: skip
    texts = [ChoiceText(binding.engine.tokenizer, params.stop_sequences()) for _ in samplings]
    include_usage = params.stream_options is not None and params.stream_options.include_usage
    logprobs = Logprobs(binding.engine.tokenizer, chat, len(samplings)) if params.num_logprobs() is not None else None
    shape = Shape(generation.request_id, binding.model_name, chat, logprobs, include_usage, params.return_token_ids)
    if params.stream:
        return EventStream(events(request, generation, texts, shape), media_type="text/event-stream")
    return JSONResponse(await whole(request, generation, texts, shape))
