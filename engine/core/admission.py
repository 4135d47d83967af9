"""The admission step: every bound a request's input is held to, and the one check of each.

A request's input (its prompt or fork suffix, its sampling, its salt, its id, and what a client adds
around it: stop sequences, a number of choices) passes here before anything records it:

    RequestInput   ──admit(limits)──> the request's context (token ids) | AdmissionError(field, bound)
    SamplingParams(...) ──check_sampling──> built                       | AdmissionError(field, bound)
    context + max_new_tokens ──never_fits(pool)──> None                 | why not (recorded as rejected)

Invariants:
    * Each bound is defined once, here (MAX_NEW_TOKENS with the configuration's bounds in
      engine/core/config.py), and checked here: callers (the API, the console, the CLI) map an
      `AdmissionError` to their own message (the API: a 400 naming its parameter by its own name).
      tests/test_layering.py holds that no other module raises it.
    * A failed check changes nothing: admission is pure and torch-free, so the API runs it in its own
      process before it sends a request (its 400 names the parameter) and the engine runs it again on what
      arrives (the console and the CLI reach it there).
    * An admitted context is a non-empty list of ints in [0, vocab_size) that leaves room for
      `max_new_tokens` more within the model's positions; a `SamplingParams` holds only values within the
      sampling bounds below (it calls `check_sampling` when built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from engine.core.arith import ceil_div
from engine.core.config import MAX_NEW_TOKENS

MAX_REQUEST_ID_LEN = 128
MAX_SALT_LEN = 256  # characters of a tenant salt
MIN_TEMPERATURE = 1e-5  # below it (but above 0) logits / temperature can overflow to inf: refused
MAX_TEMPERATURE = 10.0
MAX_SEED = 2**63 - 1
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's bounds)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
MAX_LOGIT_BIAS_ENTRIES = 300  # tokens one request may bias (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # most likely alternatives reported per output token (OpenAI's bound)
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_STOP_CHARS = 256  # characters of one stop sequence
MAX_CHOICES = 8  # choices per API request (each is one engine request)


class AdmissionError(ValueError):
    """A request's input outside a bound: `field` names the input (the engine's name for it), `bound` says
    what it must be, `got` what it was. Its message is `describe(field)`; a caller with its own name for
    the field (the API's `max_tokens` for `max_new_tokens`) describes it under that name."""

    def __init__(self, field: str, bound: str, got: object) -> None:
        self.field = field
        self.bound = bound
        self.got = got
        super().__init__(self.describe(field))

    def describe(self, name: str) -> str:
        return f"{name} must be {self.bound}, got {self.got}"


class RequestRejected(ValueError):
    """The engine refused a request it can never serve (`never_fits`); it is recorded as "rejected"."""


class ModelLimits(NamedTuple):
    """What the model serving a request accepts."""

    vocab_size: int  # token ids lie in [0, vocab_size)
    max_model_len: int  # positions: a context plus the tokens it may generate


class Sampling(Protocol):
    """The sampling fields admission reads (engine/core/request.py's `SamplingParams`, which is frozen)."""

    @property
    def max_new_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def logprobs(self) -> int | None: ...


class RequestInput(NamedTuple):
    """One request as a client gives it (the API, the console, the CLI, a fork's child)."""

    token_ids: Sequence[int]  # the prompt; for a fork, the suffix after the parent's context
    sampling: Sampling
    salt: str | None = None  # tenant salt folded into the cache namespace
    stop: Sequence[str] = ()  # stop sequences, as given (the API applies them; the engine never sees them)
    num_choices: int = 1  # choices (the API starts one engine request per choice)


def admit(given: RequestInput, limits: ModelLimits, *, prefix: Sequence[int] = (), what: str = "prompt") -> list[int]:
    """The request's context, `prefix` (a fork parent's tokens, already admitted) then its token ids.

    Args:
        given: the request's input; its sampling was checked when it was built.
        limits: the model's.
        prefix: tokens the context starts with.
        what: the field its token ids are ("prompt", "fork suffix").

    Raises:
        AdmissionError: any input outside its bound; nothing changes.
    """
    check_salt(given.salt)
    _check_stop(given.stop)
    if type(given.num_choices) is not int or not 1 <= given.num_choices <= MAX_CHOICES:
        raise AdmissionError("num_choices", f"an integer in [1, {MAX_CHOICES}]", repr(given.num_choices))
    outside = [token for token, _ in given.sampling.logit_bias if token >= limits.vocab_size]
    if outside:
        bound = f"keyed by token ids in the vocabulary [0, {limits.vocab_size})"
        raise AdmissionError("logit_bias", bound, outside[:5])
    context = [*prefix, *_token_ids(given.token_ids, what, limits.vocab_size)]
    max_new = given.sampling.max_new_tokens
    if len(context) + max_new > limits.max_model_len:
        room, positions = limits.max_model_len - max_new, limits.max_model_len
        bound = f"at most {room} tokens long, so that max_new_tokens ({max_new}) more fit the model's {positions} "
        bound += "positions"
        raise AdmissionError(what, bound, f"{len(context)} tokens" + (" with its parent's context" if prefix else ""))
    return context


def room_for_output(num_context: int, limits: ModelLimits) -> int:
    """The most new tokens a context of `num_context` tokens may ask for: the model's positions left, within
    [1, MAX_NEW_TOKENS] (at least 1, so that `admit` refuses an over-long context naming it)."""
    return max(1, min(MAX_NEW_TOKENS, limits.max_model_len - num_context))


def check_sampling(sampling: Sampling) -> None:
    """The sampling bounds (the vocabulary's, which need the model, `admit` checks).

    Raises:
        AdmissionError: a value outside its bound.
    """
    s = sampling
    if type(s.max_new_tokens) is not int or not 1 <= s.max_new_tokens <= MAX_NEW_TOKENS:
        raise AdmissionError("max_new_tokens", f"an integer in [1, {MAX_NEW_TOKENS}]", repr(s.max_new_tokens))
    if not (s.temperature == 0.0 or MIN_TEMPERATURE <= s.temperature <= MAX_TEMPERATURE):
        bound = f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
        raise AdmissionError("temperature", bound, s.temperature)
    if not 0.0 < s.top_p <= 1.0:
        raise AdmissionError("top_p", "in (0, 1]", s.top_p)
    if s.seed is not None and (type(s.seed) is not int or not 0 <= s.seed <= MAX_SEED):
        raise AdmissionError("seed", "an integer in [0, 2**63 - 1] or None", repr(s.seed))
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if type(value) not in (int, float) or not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
            raise AdmissionError(name, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", value)
    _check_logit_bias(s.logit_bias)
    if s.logprobs is not None and (type(s.logprobs) is not int or not 0 <= s.logprobs <= MAX_TOP_LOGPROBS):
        raise AdmissionError("logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}] or None", repr(s.logprobs))


def check_salt(salt: object) -> None:
    """A tenant salt is None or a string of at most MAX_SALT_LEN characters."""
    if salt is not None and not (isinstance(salt, str) and len(salt) <= MAX_SALT_LEN):
        got = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__
        raise AdmissionError("salt", f"None or a string of at most {MAX_SALT_LEN} characters", got)


def check_request_id(request_id: object) -> str:
    """A request id is a non-empty string of at most MAX_REQUEST_ID_LEN characters."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        got = f"{len(request_id)} characters" if isinstance(request_id, str) else type(request_id).__name__
        raise AdmissionError("request_id", f"a non-empty string of at most {MAX_REQUEST_ID_LEN} characters", got)
    return request_id


def never_fits(num_context_tokens: int, max_new_tokens: int, block_size: int, num_blocks: int) -> str | None:
    """Why a request can never be served by pools of `num_blocks` blocks, or None when it can: its context
    and every token it may generate must fit in one whole pool at once. (Not an `AdmissionError`: the
    engine records such a request as rejected; the workload analyzer refuses by the same rule.)"""
    needed = ceil_div(num_context_tokens + max_new_tokens, block_size)
    if needed <= num_blocks:
        return None
    return f"needs {needed} blocks for its context and new tokens; the whole pool has {num_blocks}"


def _token_ids(token_ids: Sequence[int], what: str, vocab_size: int) -> list[int]:
    """`token_ids` as a new list: a non-empty list or tuple of ints in [0, vocab_size)."""
    if not isinstance(token_ids, (list, tuple)):
        raise AdmissionError(what, "a list of token ids", type(token_ids).__name__)
    tokens = list(token_ids)
    if not tokens:
        raise AdmissionError(what, "a non-empty list of token ids", "an empty one")
    outside = [t for t in tokens if not (type(t) is int and 0 <= t < vocab_size)]
    if outside:
        raise AdmissionError(what, f"token ids in the vocabulary [0, {vocab_size})", outside[:5])
    return tokens


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        got = f"{len(bias)} pairs" if isinstance(bias, tuple) else type(bias).__name__
        raise AdmissionError("logit_bias", f"a tuple of at most {MAX_LOGIT_BIAS_ENTRIES} (token id, bias) pairs", got)
    for pair in bias:
        if not (isinstance(pair, tuple) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0):
            raise AdmissionError("logit_bias", "(token id >= 0, bias) pairs", repr(pair))
        if type(pair[1]) not in (int, float) or not -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS:
            raise AdmissionError("logit_bias", f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", repr(pair[1]))
    if len({token for token, _ in bias}) != len(bias):
        raise AdmissionError("logit_bias", "pairs naming each token id once", "a token id twice")


def _check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise AdmissionError("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences", len(stop))
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise AdmissionError("stop", f"stop sequences of at most {MAX_STOP_CHARS} characters", f"one of {longest}")
