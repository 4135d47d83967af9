"""Prompts for the Route page, as a server would see them: pasted token ids, text through a tokenizer, or
chat messages rendered with a model directory's chat template. No Streamlit here.

Every path ends in token ids bounded as the KV-event wire bounds them (`MAX_TOKEN_ID`), at most
`MAX_PROMPT_TOKEN_IDS` of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app.prompting import parse_token_ids
from serving.prompts import encode_text

MAX_PROMPT_TOKEN_IDS = 65_536  # token ids a pasted prompt may hold
MAX_TOKEN_ID = 2**32 - 1  # the wire's bound on a token id
MAX_TOKENIZER_BYTES = 64 * 2**20  # a local tokenizer.json


def prompt_token_ids(text: str) -> list[int]:
    """Token ids pasted as text (app.prompting's syntax), bounded as the KV-event wire bounds them.

    Raises:
        ValueError: malformed, out of [0, 2**32), or more than MAX_PROMPT_TOKEN_IDS.
    """
    ids = parse_token_ids(text)
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS:,} token ids, got {len(ids):,}")
    bad = [token for token in ids if not 0 <= token <= MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside [0, 2**32)")
    return ids


def local_tokenizer(directory: str):
    """The `tokenizers` tokenizer in a local model directory's tokenizer.json (the pods' model, say).

    Raises:
        ValueError: no such directory, no tokenizer.json in it, a file over MAX_TOKENIZER_BYTES, or one
            that does not load.
    """
    from tokenizers import Tokenizer

    if len(directory) > 4096:
        raise ValueError("the path is too long")
    path = Path(directory).expanduser() / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {directory!r}")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{path} is larger than {MAX_TOKENIZER_BYTES // 2**20} MiB")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own exception type for a malformed file
        raise ValueError(f"{path} does not load: {exc}") from None


def encode_with(tokenizer, text: str) -> list[int]:
    """`text` as token ids, with the tokenizer's default special tokens: the console's own (transformers)
    tokenizer, or one `local_tokenizer` loaded.

    Raises:
        ValueError: an empty text, or too many tokens.
    """
    if not text.strip():
        raise ValueError("the prompt is empty")
    if hasattr(tokenizer, "encode_batch"):  # a `tokenizers.Tokenizer`
        ids = list(tokenizer.encode(text).ids)
    else:
        ids = encode_text(tokenizer, text)
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"the prompt is {len(ids):,} tokens; at most {MAX_PROMPT_TOKEN_IDS:,}")
    return ids


CHAT_ROLES = ("system", "user", "assistant", "tool")


def parse_chat_messages(text: str) -> list[dict[str, str]]:
    """Chat messages pasted as a JSON array of {"role", "content"} (an OpenAI request's `messages`), or as
    lines "ROLE: content" (a line without a role continues the message before it).

    Raises:
        ValueError: no message, a role other than CHAT_ROLES, or malformed JSON.
    """
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            loaded = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON array of messages: {exc}") from None
        if not isinstance(loaded, list) or not all(isinstance(item, dict) for item in loaded):
            raise ValueError('a JSON array of {"role": ..., "content": ...} objects')
        messages = [{"role": str(item.get("role")), "content": str(item.get("content", ""))} for item in loaded]
    else:
        messages = []
        for line in text.splitlines():
            role, colon, content = line.partition(":")
            if colon and role.strip().lower() in CHAT_ROLES:
                messages.append({"role": role.strip().lower(), "content": content.strip()})
            elif messages:
                messages[-1]["content"] += "\n" + line
            elif line.strip():
                raise ValueError(f"the first line names no role ({', '.join(CHAT_ROLES)}): {line[:40]!r}")
    if not messages:
        raise ValueError("no message")
    bad = sorted({message["role"] for message in messages} - set(CHAT_ROLES))
    if bad:
        raise ValueError(f"unknown roles {bad}: {', '.join(CHAT_ROLES)}")
    return messages


@dataclass(frozen=True)
class ChatTemplate:
    """A model directory's chat template with what it renders with: its tokenizer and special tokens."""

    tokenizer: object  # a `tokenizers.Tokenizer` (tokenizer.json)
    template: str  # the Jinja source (chat_template.jinja, or tokenizer_config.json's chat_template)
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as tokenizer_config.json names them


def local_chat_template(directory: str) -> ChatTemplate:
    """The chat template of a local model directory (the pods' model), without loading the model.

    Raises:
        ValueError: no tokenizer.json, no chat template, or a tokenizer_config.json that is not JSON.
    """
    tokenizer = local_tokenizer(directory)
    path = Path(directory).expanduser()
    config: dict = {}
    config_path = path / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config_path} is not JSON: {exc}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((item.get("template") for item in template if item.get("name") == "default"), None)
    jinja_path = path / "chat_template.jinja"
    if jinja_path.is_file():
        template = jinja_path.read_text(encoding="utf-8")
    if not isinstance(template, str) or not template:
        raise ValueError(f"no chat template in {directory!r} (chat_template.jinja or tokenizer_config.json)")
    special = {}
    for key, value in config.items():
        if key.endswith("_token"):
            text = value.get("content") if isinstance(value, dict) else value
            if isinstance(text, str):
                special[key] = text
    return ChatTemplate(tokenizer, template, special)


def chat_token_ids(chat: ChatTemplate, messages: list[dict[str, str]]) -> list[int]:
    """The prompt a server builds from chat messages: the template rendered with the generation prompt
    (in Jinja's sandbox, as transformers renders it: trim_blocks, lstrip_blocks), then tokenized without
    adding special tokens (as vLLM's chat endpoint does).

    Raises:
        ValueError: the template fails to render, or the prompt is too long.
    """
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the messages: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = raise_exception
    try:
        text = environment.from_string(chat.template).render(
            messages=messages, add_generation_prompt=True, **chat.special_tokens
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template does not render: {exc}") from None
    ids = list(chat.tokenizer.encode(text, add_special_tokens=False).ids)
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"the prompt is {len(ids):,} tokens; at most {MAX_PROMPT_TOKEN_IDS:,}")
    return ids
