"""Prompts for the Route page, as a server would see them: pasted token ids, text through a tokenizer, or
chat messages rendered with a model directory's chat template. No Streamlit here.

Every path ends in token ids bounded as the KV-event wire bounds them (`MAX_TOKEN_ID`), at most
`MAX_PROMPT_TOKEN_IDS` of them.
"""

from __future__ import annotations

import json
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


def local_chat_tokenizer(directory: str):
    """The transformers tokenizer of a local model directory (its tokenizer files and chat template).

    Raises:
        ValueError: no such directory, or no tokenizer in it that loads.
    """
    from transformers import AutoTokenizer

    path = Path(directory).expanduser()
    if len(directory) > 4096 or not path.is_dir():
        raise ValueError(f"no directory {directory!r}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} holds no tokenizer that loads: {exc}") from None


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt a server builds from chat messages: the tokenizer's chat template rendered with the
    generation prompt, then tokenized without adding special tokens (as vLLM's chat endpoint does).

    Raises:
        ValueError: the tokenizer has no chat template, or the prompt is too long.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model directory has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"the prompt is {len(ids):,} tokens; at most {MAX_PROMPT_TOKEN_IDS:,}")
    return ids
