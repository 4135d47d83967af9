"""The OpenAI-compatible request bodies, as pydantic models, and the bounds the API holds them to.

Fields are strict (a string is not a number, a number is not a string), so a body of the wrong shape is a
400 before it reaches the engine. Unknown fields are ignored, as OpenAI's and vLLM's servers do. Bounds the
engine checks itself (sampling ranges, the context length, token ids in the vocabulary) are left to it: one
rule, one place; its `ValueError` becomes a 400 with its message.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

MAX_N = 8  # choices per request (each is one engine request)
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_STOP_CHARS = 256  # characters of one stop sequence

Number = StrictInt | StrictFloat  # JSON numbers: 1 and 1.0 are both a temperature of one
TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False  # send one last chunk with the usage, as OpenAI


class SamplingFields(BaseModel):
    """What both completion endpoints take besides the prompt."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None  # None: the endpoint's default (see `api.max_new_tokens`)
    temperature: Number = 1.0  # OpenAI's default; 0 is greedy
    top_p: Number = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    n: StrictInt = 1
    user: StrictStr | None = None  # the client's label: it names the engine's request ids
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension
    cache_salt: StrictStr | None = None  # vLLM's extension: the tenant salt the cache namespaces by

    def stop_sequences(self) -> list[str]:
        """The stop sequences as a list (empty strings dropped: they would match everywhere)."""
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    echo: StrictBool = False  # refused when true: the API does not echo prompts

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

    def template_messages(self) -> list[dict[str, str]]:
        return [message.as_template_message() for message in self.messages]


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt or a message list, and the ids the engine would see."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
