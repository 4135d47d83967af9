"""Turning operator input into the exact token ids the model sees.

Reuse is keyed on token ids after chat templating and special tokens, so the console shows these ids,
not the text. The engine itself knows nothing about text.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")


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


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first position where two token sequences differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
