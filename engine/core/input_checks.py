"""The checks a request's input passes before the engine records it: each raises ValueError with the reason
and changes nothing. Torch-free; the engine calls them under its lock."""

from __future__ import annotations

from collections.abc import Sequence

MAX_REQUEST_ID_LEN = 128
MAX_SALT_LEN = 256  # characters of a tenant salt


def check_salt(salt: object) -> None:
    """A tenant salt is None or a string of at most MAX_SALT_LEN characters."""
    if salt is not None and not (isinstance(salt, str) and len(salt) <= MAX_SALT_LEN):
        raise ValueError(f"a salt is a string of at most {MAX_SALT_LEN} characters, or None")


def check_request_id(request_id: object) -> str:
    """A request id is a non-empty string of at most MAX_REQUEST_ID_LEN characters."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise ValueError(f"request ids are non-empty strings of at most {MAX_REQUEST_ID_LEN} characters")
    return request_id


def check_tokens(token_ids: Sequence[int], what: str, vocab_size: int) -> list[int]:
    """`token_ids` as a new list: a non-empty list or tuple of ints in [0, vocab_size)."""
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"the {what} must be a list of token ids, got {type(token_ids).__name__}")
    tokens = list(token_ids)
    if not tokens:
        raise ValueError(f"the {what} is empty")
    if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise ValueError(f"the {what} has token ids outside [0, {vocab_size})")
    return tokens


def check_length(num_context: int, max_new_tokens: int, max_model_len: int) -> None:
    """The context plus the tokens to generate fit the model's positions."""
    if num_context + max_new_tokens > max_model_len:
        raise ValueError(
            f"context of {num_context} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"maximum of {max_model_len} positions"
        )


def check_logit_bias(logit_bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
    """Every token a sampling's logit bias names is in [0, vocab_size) (the rest SamplingParams checks)."""
    outside = [token for token, _ in logit_bias if not 0 <= token < vocab_size]
    if outside:
        raise ValueError(f"logit_bias names token ids outside [0, {vocab_size}): {outside[:5]}")
