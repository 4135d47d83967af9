"""The OpenAI-compatible request bodies, as pydantic models, and the bounds the API holds them to.

Fields are strict (a string is not a number, a number is not a string), so a body of the wrong shape is a
400 before it reaches the engine. No field is accepted and ignored: the completion bodies refuse every
field they do not define (as OpenAI's server does), and OpenAI's fields this server does not implement
(`UNSUPPORTED`: tools, response formats, ...) are refused by name unless their value asks for nothing
(`response_format: {"type": "text"}`, `tools: []`, ...). These models hold a body to its types and
shape only: every bound on a value (sampling ranges, the context length, token ids in the vocabulary,
`n`, stop sequences, the salt's length) is the engine's admission step's (engine/core/admission.py):
one rule, one place; the API runs it and names the parameter its `AdmissionError` names.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

# OpenAI's request fields this server does not implement, each with the values that ask for nothing (those
# are accepted; any other value is a 400 naming the field). None (JSON null) always asks for nothing.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "metadata": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "prompt_cache_key": (),
    "safety_identifier": (),
    "best_of": (1,),
    "suffix": (),
}


class FieldRefused(Exception):
    """A field refused by name (raised from validators: pydantic lets exceptions other than ValueError through,
    so the API answers with `param` set to the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


Number = StrictInt | StrictFloat  # JSON numbers: 1 and 1.0 are both a temperature of one
TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False  # send one last chunk with the usage, as OpenAI


class SamplingFields(BaseModel):
    """What both completion endpoints take besides the prompt."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = None  # None: the endpoint's default (see `api.max_new_tokens`)
    temperature: Number = 1.0  # OpenAI's default; 0 is greedy
    top_p: Number = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1  # choices
    user: StrictStr | None = None  # the client's label: it names the engine's request ids
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[StrictStr, Number] | None = None  # token id (as a string, as OpenAI) -> bias
    ignore_eos: StrictBool = False  # vLLM's extension
    return_token_ids: StrictBool = True  # vLLM's extension; this server's choices carry them unless told not to
    cache_salt: StrictStr | None = None  # vLLM's: the tenant salt
    logprobs_param: ClassVar[str] = "logprobs"  # the parameter that sets how many likeliest tokens to report

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        """OpenAI's fields this server does not implement: refused by name, or dropped when their value
        asks for nothing."""
        if not isinstance(body, dict) or UNSUPPORTED.keys().isdisjoint(body):
            return body
        for name in UNSUPPORTED.keys() & body.keys():
            value, harmless = body[name], UNSUPPORTED[name]
            if value is not None and not any(type(value) is type(h) and value == h for h in harmless):
                accepted = " or ".join(json.dumps(h) for h in harmless)
                only = f" (it accepts {name} {accepted} or null only)" if harmless else ""
                raise FieldRefused(name, f"{name} is not supported by this server{only}")
        return {name: value for name, value in body.items() if name not in UNSUPPORTED}

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as the engine takes it: (token id, bias) pairs, by token id.

        Raises:
            ValueError: a key that is not a token id written in decimal.
        """
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids, got {key[:40]!r}")
            pairs.append((int(key), float(bias)))
        return tuple(sorted(pairs))

    def num_logprobs(self) -> int | None:
        """How many likeliest tokens to report per output token (None: no logprobs); each endpoint's own."""
        return None

    def stop_given(self) -> list[str]:
        """The stop sequences as given, as a list (what admission counts)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def stop_sequences(self) -> list[str]:
        """The stop sequences to apply (empty strings dropped: they would match everywhere)."""
        return [s for s in self.stop_given() if s]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    echo: StrictBool = False  # refused when true: the API does not echo prompts
    logprobs: StrictInt | None = None  # the legacy form: each token's logprob and this many likeliest ones

    def num_logprobs(self) -> int | None:
        """How many likeliest tokens to report per output token (None: no logprobs)."""
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids (a one-element list of strings is its string)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return prompt[0]
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        """The message as a chat template takes it: text parts joined into one string."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered through the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None  # the newer name of max_tokens; wins when both are given
    logprobs: StrictBool = False  # each output token's logprob
    top_logprobs: StrictInt | None = None  # and this many likeliest tokens at its position (needs logprobs)
    logprobs_param: ClassVar[str] = "top_logprobs"

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldRefused("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def num_logprobs(self) -> int | None:
        """How many likeliest tokens to report per output token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [message.as_template_message() for message in self.messages]


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt or a message list, and the ids the engine would see."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
