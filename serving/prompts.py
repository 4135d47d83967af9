"""Turning operator input into the exact token ids the model sees.

Reuse is keyed on token ids after chat templating and special tokens, so the console shows these ids,
not the text. The engine itself knows nothing about text.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # a model directory with a tokenizer
PROMPT_FIELDS = ("tokens", "text", "chat")  # a run-trace submit line gives its prompt as exactly one of these


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Plain text, tokenized with the tokenizer's default special tokens."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: submit token ids instead of text")
    if not text:
        raise ValueError("the prompt is empty")
    return list(tokenizer(text)["input_ids"])


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
    """Messages rendered through the model's chat template; the template supplies the special tokens."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: submit token ids instead of chat messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template")
    if not messages:
        raise ValueError("the chat has no messages")
    for message in messages:
        if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise ValueError(f"each message needs a role in {ROLES} and a string content, got {message!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def submit_prompt(tokenizer: Any, op: Mapping[str, Any]) -> list[int]:
    """The prompt of a run-trace `submit` line (cli/trace.py's format): its `tokens`, or its `text` or
    `chat` through the tokenizer.

    Raises:
        ValueError: not exactly one prompt field, a malformed one, or text without a tokenizer.
    """
    given = [name for name in PROMPT_FIELDS if name in op]
    if len(given) != 1:
        raise ValueError("submit needs exactly one of 'tokens', 'text' or 'chat'")
    if "tokens" in op:
        return token_list(op["tokens"], "tokens")
    if "text" in op:
        return encode_text(tokenizer, op["text"])
    return encode_chat(tokenizer, op["chat"])


def token_list(value: Any, name: str) -> list[int]:
    """`value` when it is a list of integers (booleans are not), else ValueError naming the field."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"'{name}' must be a list of integers")
    return value


def load_tokenizer(model: str, data_dir: Path) -> Any:
    """The tokenizer of a model the history names (a preset or a model directory), without its weights;
    None for a model that has none (the token-id-only presets, a directory without tokenizer files)."""
    from engine.runner.model_loading import SMOLLM2, TINY_PRESETS, smollm2_tokenizer

    if model in (SMOLLM2, "tiny-chat"):
        return smollm2_tokenizer(data_dir)
    if model in TINY_PRESETS or not Path(model).is_dir():
        return None
    if not any((Path(model) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, local_files_only=True)
