"""This project's own workloads as traces: `run-trace` files and the history of a run.

Both key blocks exactly as the engine does, so a trace's block ids are the engine's chain keys (and
hits in the analysis are hits the engine's prefix index could have had):

  * a run-trace file (cli/trace.py's format) is tokenized as `run-trace` tokenizes it (tokens, or text or
    chat through the model's tokenizer, serving/prompts.py) and keyed with `chain_key` under the
    engine's namespace root and each request's salt (engine/core/namespace.py);
  * the history keeps each finished request's prompt keys (engine/core/request.py's `PromptKeys`, revision
    0004 of storage), read back with `storage.read.queries.prompt_chains`.

Only full blocks have keys (`PartialBlocks.DROPPED`): a prompt's tokens past its last full block are
`partial` misses. Each block also gets a content id, the same chain from `CONTENT_ROOT_KEY` (no
namespace, no salt), so the breakdown can count `namespace` misses: tokens that were cached, but under
another salt (run-trace files) or another model revision or dtype (history of several runs).

A 16-byte key becomes a block id by its first 8 bytes, little-endian, shifted right by one (ids are
63-bit; a collision among a million blocks has odds of about 1 in 10^7).

What the readers leave out: a run-trace `fork` depends on its parent's generated tokens, which the file
does not hold (analyse the run's history instead: a fork's prompt keys are stored like any other);
`release`, `run` and `reset` lines do not change what a request could hit in the sequential model and
are skipped (a `reset` would empty the cache: the analysis does not). Every request of a run-trace file
arrives at time 0 (the file has no times); history requests keep their arrival times.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from analysis.errors import TraceError
from analysis.readers import numbered_lines, parse_object
from analysis.trace import PartialBlocks, Trace, TraceFormat, TraceRequest
from engine.core.kv_groups import chain_keys_of
from engine.core.namespace import CONTENT_ROOT_KEY, CacheNamespace
from serving.prompts import submit_prompt
from engine.core.request import SamplingParams

KEY_BYTES = 16  # bytes per chain key (xxh3-128)
MAX_TOKEN_ID = 2**32 - 1  # chain keys pack token ids as 32-bit unsigned integers
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "ignore_eos")  # as run-trace reads them
SKIPPED_OPS = ("release", "run", "reset")


def key_ids(keys: bytes) -> tuple[int, ...]:
    """The block ids of concatenated 16-byte keys (see the module docstring)."""
    if len(keys) % KEY_BYTES:
        raise TraceError(f"{len(keys)} key bytes are not whole {KEY_BYTES}-byte keys")
    words = np.frombuffer(keys, dtype="<u8")[::2] >> np.uint64(1)
    return tuple(words.astype(np.int64).tolist())


@dataclass(frozen=True)
class Keying:
    """How a run-trace file's prompts become keys: the engine's namespace and the model's tokenizer."""

    namespace: CacheNamespace  # the engine's (model, weights revision, dtype, block size, attention)
    tokenizer: Any  # the model's tokenizer (None: token-id prompts only)


def read_run_trace(file: BinaryIO, keying: Keying) -> Trace:
    """A run-trace file (opened in binary mode) as a trace, keyed as the engine keys it.

    Raises:
        TraceError: a line is too long, not a JSON object, not a valid run-trace op, a fork (see the
            module docstring), or the file has no submit line.
    """
    requests = list(_run_trace_requests(file, keying))
    if not requests:
        raise TraceError("the run-trace file has no submit lines (no requests)")
    return Trace.from_requests(requests, TraceFormat.RUN_TRACE, PartialBlocks.DROPPED)


def _run_trace_requests(file: BinaryIO, keying: Keying) -> Iterator[TraceRequest]:
    namespace = keying.namespace
    size = namespace.block_size
    for number, line in numbered_lines(file):
        op = parse_object(line, number)
        kind = op.get("op")
        if kind in SKIPPED_OPS:
            continue
        if kind == "fork":
            raise TraceError("a fork's context includes its parent's generated tokens, which this file does not "
                             "hold: analyse the run's history (--format history) instead", number)  # fmt: skip
        if kind != "submit":
            raise TraceError(f"unknown op {kind!r}; expected submit, fork, {', '.join(SKIPPED_OPS)}", number)
        try:
            yield _submitted(op, keying.tokenizer, namespace, size)
        except (ValueError, TypeError) as error:
            raise TraceError(str(error), number) from None


def _submitted(op: Mapping[str, Any], tokenizer: Any, namespace: CacheNamespace, size: int) -> TraceRequest:
    rid = op.get("id")
    if not isinstance(rid, str) or not rid:
        raise ValueError("submit needs a non-empty string 'id'")
    tokens = submit_prompt(tokenizer, op)
    if not tokens:
        raise ValueError("the prompt is empty")
    if not all(0 <= token <= MAX_TOKEN_ID for token in tokens):
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
    sampling = SamplingParams(**{name: op[name] for name in SAMPLING_FIELDS if name in op})
    salt = op.get("salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError("'salt' must be a string")
    full = len(tokens) // size
    chain = chain_keys_of(tokens, namespace.root_key(salt), size, full)
    content = chain_keys_of(tokens, CONTENT_ROOT_KEY, size, full)
    return TraceRequest(
        arrival_s=0.0,
        input_length=len(tokens),
        output_length=sampling.max_new_tokens,
        block_ids=key_ids(b"".join(chain)),
        block_size=size,
        request_type=salt,  # the tenant: hits per tenant in the breakdown
        content_ids=key_ids(b"".join(content)),
    )


def history_trace(rows: Iterable[Mapping[str, Any]], block_size: int | None = None) -> Trace:
    """The history's finished requests (`storage.read.queries.prompt_chains` rows) as a trace.

    Args:
        rows: one mapping per request with `run_id`, `request_id`, `arrival_time`, `prompt_tokens`,
            `output_tokens`, `block_keys`, `content_keys` and its run's `block_size`.
        block_size: keep the runs of this block size; None: the history must hold one block size only.

    Raises:
        TraceError: no request to analyse, runs of several block sizes and none chosen, or a row whose
            keys do not cover its prompt's full blocks.
    """
    rows = list(rows)
    sizes = sorted({int(row["block_size"]) for row in rows})
    if block_size is None and len(sizes) > 1:
        raise TraceError(f"the history holds runs at block sizes {sizes}: choose one (--block-size)")
    if block_size is not None:
        rows = [row for row in rows if int(row["block_size"]) == block_size]
    if not rows:
        where = "" if block_size is None else f" at block size {block_size}"
        raise TraceError(f"the history has no finished requests with stored prompt keys{where} (revision 0004)")
    start = min(float(row["arrival_time"]) for row in rows)
    requests = []
    for row in rows:
        size, prompt = int(row["block_size"]), int(row["prompt_tokens"])
        chain, content = bytes(row["block_keys"]), bytes(row["content_keys"])
        if len(chain) != KEY_BYTES * (prompt // size) or len(content) != len(chain):
            raise TraceError(
                f"request {row['request_id']!r} of run {row['run_id']!r}: {len(chain) // KEY_BYTES} keys for "
                f"{prompt} prompt tokens at {size} per block"
            )
        requests.append(
            TraceRequest(
                arrival_s=float(row["arrival_time"]) - start,
                input_length=prompt,
                output_length=int(row["output_tokens"]),
                block_ids=key_ids(chain),
                block_size=size,
                content_ids=key_ids(content),
            )
        )
    return Trace.from_requests(requests, TraceFormat.HISTORY, PartialBlocks.DROPPED)
