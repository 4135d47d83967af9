"""What the analyzer works on: requests in arrival order, each a chain of prefix-block ids.

A reader yields one `TraceRequest` per line; `Trace.from_requests` packs them into columns (numpy
arrays), so a block reference costs 8 bytes instead of a Python int, and the simulations read one
request's ids as a slice:

    block_ids     [ 0  1  2 | 0  1  3  4 | 5 ]       every request's block ids, back to back
    block_starts  [ 0         3            7   8 ]   request r: block_ids[block_starts[r]:block_starts[r + 1]]

An id stands for a whole prefix: equal ids at the same position in two requests are the same KV block,
and a request can reuse its leading blocks only (a block is useful only with every block before it).

Invariants (checked when a trace is built; the arrays are read-only afterwards):
  * there is at least one request, and requests are in arrival order (`arrival_s` non-decreasing);
  * `1 <= input_length <= MAX_TOKENS`, `0 <= output_length <= MAX_TOKENS`, `0 <= turn <= MAX_TOKENS`
    where known, `0 <= id < 2**63`;
  * at most `MAX_REQUESTS` requests and `MAX_REFERENCES` block references (what a trace may cost in
    memory: the analyses hold a few Python objects per reference);
  * request r has `expected_blocks(input_length)` ids: `ceil(input_length / block_size)` when the last,
    possibly partial block is cached like the others (`PartialBlocks.CACHED`: hash-id traces, whose last
    id is one block), `input_length // block_size` when only full blocks are (`PartialBlocks.DROPPED`:
    token workloads, as in the engine, where the tokens past the last full block have no key);
  * no id repeats within a request (a prefix cannot contain itself);
  * `content_ids`, where known (own workloads), has one id per block id: the block's namespace-free
    identity (equal tokens at equal positions), so the analyzer can tell a block that misses only
    because it was cached under another model, dtype or salt.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import numpy as np

from analysis.errors import TraceError
from engine.core.arith import ceil_div

MAX_BLOCK_ID = 2**63 - 1  # ids live in int64 columns
MAX_TOKENS = 2**40  # a request's input or output length, and its turn number: far beyond any context
# Size bounds of one trace: twice the Mooncake conversation trace split into 16-token blocks (about 9 M
# references), the largest workload the benchmarks analyse. Memory grows with references: analysing that
# one under LRU and reuse-LRU peaks at 1.7 GB.
MAX_REFERENCES = 20_000_000
MAX_REQUESTS = 5_000_000


class TraceFormat(Enum):
    """A trace format (one reader each: `analysis.readers` for hash-id files, `analysis.own_workloads`
    for this project's own workloads)."""

    MOONCAKE = "mooncake"  # FAST'25 Mooncake traces: `timestamp` in ms, 512-token blocks
    BAILIAN = "bailian"  # ATC'25 Qwen-Bailian traces: `timestamp` in s, 16-token blocks, chat metadata
    RUN_TRACE = "run-trace"  # a `python -m cli run-trace` workload file: tokens, text or chat
    HISTORY = "history"  # the requests a console or run-trace recorded in a history database

    @property
    def block_size(self) -> int:
        """Tokens per hash id in this format (hash-id formats only: own workloads take the engine's).

        Raises:
            ValueError: an own-workload format, whose block size is the engine's.
        """
        if self not in _FORMAT_BLOCK_SIZES:
            raise ValueError(f"{self.value} workloads have the engine's block size, not a format's")
        return _FORMAT_BLOCK_SIZES[self]


_FORMAT_BLOCK_SIZES = {TraceFormat.MOONCAKE: 512, TraceFormat.BAILIAN: 16}


class PartialBlocks(Enum):
    """Whether a request's last, partial block is cached."""

    CACHED = "cached"  # hash-id traces: the last id is one block (possibly partial), cached like the rest
    DROPPED = "dropped"  # token workloads: only full blocks are keyed; the tail is never cacheable


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, as a reader yields it."""

    arrival_s: float  # arrival time, seconds from the trace's start
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    block_ids: tuple[int, ...]  # the prompt's prefix-block ids, first block first
    block_size: int  # tokens per block
    request_type: str | None = None  # workload tag (Bailian `type`); None where the format has none
    turn: int | None = None  # the request's turn in its conversation (Bailian); None where unknown
    chat_id: int | None = None  # the request's own id (Bailian); None where the format has none
    parent_chat_id: int | None = None  # the previous turn's chat_id (Bailian); None for a first turn
    content_ids: tuple[int, ...] | None = None  # namespace-free ids of the same blocks (own workloads)


def expected_blocks(input_length: int, block_size: int, partial: PartialBlocks) -> int:
    """How many block ids a prompt of `input_length` tokens has."""
    if partial is PartialBlocks.CACHED:
        return ceil_div(input_length, block_size)
    return input_length // block_size


def check_request(request: TraceRequest, partial: PartialBlocks) -> None:
    """Raise `TraceError` (without a line number) unless `request` meets the module's invariants."""
    if request.block_size < 1:
        raise TraceError(f"block size must be positive, got {request.block_size}")
    if not 1 <= request.input_length <= MAX_TOKENS:
        raise TraceError(f"input_length must be in [1, 2**40], got {request.input_length}")
    if not 0 <= request.output_length <= MAX_TOKENS:
        raise TraceError(f"output_length must be in [0, 2**40], got {request.output_length}")
    if request.turn is not None and not 0 <= request.turn <= MAX_TOKENS:
        raise TraceError(f"turn must be in [0, 2**40], got {request.turn}")
    if not request.arrival_s >= 0:  # also refuses NaN
        raise TraceError(f"the arrival time must be a number >= 0, got {request.arrival_s}")
    expected = expected_blocks(request.input_length, request.block_size, partial)
    if len(request.block_ids) != expected:
        rule = "ceil" if partial is PartialBlocks.CACHED else "floor"
        raise TraceError(
            f"hash_ids has {len(request.block_ids)} ids, but input_length {request.input_length} at "
            f"{request.block_size} tokens per block needs {rule}({request.input_length} / {request.block_size})"
            f" = {expected}"
        )
    for block_id in request.block_ids:
        if type(block_id) is not int or not 0 <= block_id <= MAX_BLOCK_ID:
            raise TraceError(f"block ids must be integers in [0, 2**63), got {block_id!r}")
    if len(set(request.block_ids)) != len(request.block_ids):
        raise TraceError("hash_ids repeats a block id (a prefix block occurs once in a request)")
    if request.content_ids is not None:
        if len(request.content_ids) != len(request.block_ids):
            raise TraceError(f"{len(request.content_ids)} content ids for {len(request.block_ids)} blocks")
        if not all(type(i) is int and 0 <= i <= MAX_BLOCK_ID for i in request.content_ids):
            raise TraceError("content ids must be integers in [0, 2**63)")


_TOO_LARGE = f"a trace holds at most {MAX_REFERENCES:,} block references and {MAX_REQUESTS:,} requests"


@dataclass(frozen=True, slots=True)
class DenseBlocks:
    """The trace's block ids renamed 0..unique-1 (simulations index arrays with them)."""

    ids: np.ndarray  # int64 per reference: the dense id of block_ids[i]
    unique: np.ndarray  # int64, sorted: unique[dense id] is the original block id


@dataclass(frozen=True, eq=False)
class Trace:
    """A whole trace in columns (see the module docstring). Build it with `from_requests`."""

    format: TraceFormat  # where it came from
    block_size: int  # tokens per block
    partial_blocks: PartialBlocks  # whether a request's last, partial block is cached
    arrival_s: np.ndarray  # float64 per request, non-decreasing
    input_lengths: np.ndarray  # int64 per request
    output_lengths: np.ndarray  # int64 per request
    block_starts: np.ndarray  # int64, one more than requests: request r owns block_ids[starts[r]:starts[r+1]]
    block_ids: np.ndarray  # int64 per block reference
    type_names: tuple[str, ...]  # the distinct request types, in first-seen order (empty if none)
    type_codes: np.ndarray | None  # int32 per request: index into type_names, -1 untyped; None if none typed
    turns: np.ndarray | None  # int64 per request: conversation turn, -1 unknown; None if no turns known
    content_ids: np.ndarray | None = None  # int64 per reference: namespace-free block ids; None if unknown

    @classmethod
    def from_requests(
        cls,
        requests: Iterable[TraceRequest],
        trace_format: TraceFormat,
        partial_blocks: PartialBlocks = PartialBlocks.CACHED,
    ) -> Trace:
        """Pack requests into a trace, in arrival order (a stable sort: equal times keep their order).

        Raises:
            TraceError: a request breaks the module's invariants ("request N: ..."), requests disagree on
                the block size or on whether content ids are known, there are none, or too many.
        """
        arrival, inputs, outputs, starts, ids = array("d"), array("q"), array("q"), array("q", [0]), array("q")
        type_codes, turns, content = array("i"), array("q"), array("q")
        with_content = None  # whether the requests carry content ids (all of them or none)
        type_index: dict[str, int] = {}
        any_turn = False
        block_size = None
        for number, request in enumerate(requests, start=1):
            try:
                check_request(request, partial_blocks)
            except TraceError as error:
                raise TraceError(f"request {number}: {error.reason}") from None
            if block_size is None:
                block_size = request.block_size
            elif request.block_size != block_size:
                raise TraceError(f"request {number}: block size {request.block_size}, earlier ones {block_size}")
            if with_content is None:
                with_content = request.content_ids is not None
            elif with_content != (request.content_ids is not None):
                raise TraceError(f"request {number}: content ids are known for some requests only")
            if request.content_ids is not None:
                content.extend(request.content_ids)
            arrival.append(request.arrival_s)
            inputs.append(request.input_length)
            outputs.append(request.output_length)
            ids.extend(request.block_ids)
            starts.append(len(ids))
            if len(ids) > MAX_REFERENCES or len(starts) > MAX_REQUESTS + 1:
                raise TraceError(f"request {number}: {_TOO_LARGE}")
            if request.request_type is None:
                type_codes.append(-1)
            else:
                type_codes.append(type_index.setdefault(request.request_type, len(type_index)))
            turns.append(-1 if request.turn is None else request.turn)
            any_turn = any_turn or request.turn is not None
        if block_size is None:
            raise TraceError("the trace has no requests")
        columns = _Columns(
            np.frombuffer(arrival, np.float64),
            np.frombuffer(inputs, np.int64),
            np.frombuffer(outputs, np.int64),
            np.frombuffer(starts, np.int64),
            np.frombuffer(ids, np.int64),
            np.frombuffer(type_codes, np.int32) if type_index else None,
            np.frombuffer(turns, np.int64) if any_turn else None,
            np.frombuffer(content, np.int64) if with_content else None,
        )
        ordered = columns.in_arrival_order()
        return cls._from_columns(trace_format, block_size, partial_blocks, ordered, tuple(type_index))

    @classmethod
    def _from_columns(
        cls, trace_format: TraceFormat, block_size: int, partial: PartialBlocks, columns: _Columns, type_names: tuple
    ) -> Trace:
        for column in (columns.arrival, columns.inputs, columns.outputs, columns.starts, columns.ids):
            column.flags.writeable = False
        for column in (columns.type_codes, columns.turns, columns.content_ids):
            if column is not None:
                column.flags.writeable = False
        return cls(
            trace_format,
            block_size,
            partial,
            columns.arrival,
            columns.inputs,
            columns.outputs,
            columns.starts,
            columns.ids,
            type_names,
            columns.type_codes,
            columns.turns,
            columns.content_ids,
        )

    def __len__(self) -> int:
        return len(self.input_lengths)

    @property
    def num_references(self) -> int:
        """Block references over all requests."""
        return len(self.block_ids)

    @cached_property
    def input_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return int(self.input_lengths.sum())

    @cached_property
    def blocks_per_request(self) -> np.ndarray:
        """int64 per request: how many block ids it has."""
        return np.diff(self.block_starts)

    @cached_property
    def request_of_reference(self) -> np.ndarray:
        """int64 per block reference: the request it belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.blocks_per_request)

    @cached_property
    def dense(self) -> DenseBlocks:
        """The block ids renamed 0..unique_blocks-1 (same equalities, so the same simulation results)."""
        unique, inverse = np.unique(self.block_ids, return_inverse=True)
        return DenseBlocks(inverse.astype(np.int64, copy=False), unique)

    @property
    def unique_blocks(self) -> int:
        """Distinct block ids in the trace."""
        return len(self.dense.unique)

    def hit_tokens(self, hit_blocks: np.ndarray) -> np.ndarray:
        """int64 per request: the prompt tokens covered by its first `hit_blocks[r]` blocks."""
        return np.minimum(np.asarray(hit_blocks, np.int64) * self.block_size, self.input_lengths)

    def full_blocks_only(self) -> Trace:
        """The same requests with ids for their full blocks only (`PartialBlocks.DROPPED`), as the engine
        keys them: a hash-id trace's partial last id is left out; a trace that drops them is itself."""
        if self.partial_blocks is PartialBlocks.DROPPED:
            return self
        keep = self.input_lengths // self.block_size
        position = np.arange(self.num_references, dtype=np.int64) - self.block_starts[self.request_of_reference]
        kept = position < keep[self.request_of_reference]
        columns = _Columns(
            self.arrival_s.copy(),
            self.input_lengths.copy(),
            self.output_lengths.copy(),
            np.concatenate(([0], np.cumsum(keep))).astype(np.int64),
            self.block_ids[kept],
            None if self.type_codes is None else self.type_codes.copy(),
            None if self.turns is None else self.turns.copy(),
            None,  # hash-id traces have no content ids
        )
        return Trace._from_columns(self.format, self.block_size, PartialBlocks.DROPPED, columns, self.type_names)

    def split(self, block_size: int) -> Trace:
        """The same trace at a smaller block size: each block becomes `self.block_size // block_size` blocks.

        Child `i` of block `b` gets the id `b * factor + i` (deterministic, and distinct for distinct
        `(b, i)`). A request's last, partial block of `r` tokens becomes `ceil(r / block_size)` children,
        so the new ids still number `ceil(input_length / block_size)`. Its children are ids of the partial
        block's own: the trace does not say which full block, if any, holds the same leading tokens.

        Raises:
            ValueError: `block_size` does not divide this trace's block size, the trace drops partial
                blocks (its uncached tails would hold cacheable smaller blocks no id describes), the
                child ids would not fit in 63 bits, or there would be more than `MAX_REFERENCES` of them.
        """
        if block_size < 1 or self.block_size % block_size:
            raise ValueError(f"block size {block_size} does not divide {self.block_size}")
        if self.partial_blocks is not PartialBlocks.CACHED:
            raise ValueError("only traces whose partial blocks are cached (hash-id traces) can be split")
        factor = self.block_size // block_size
        if int(self.block_ids.max()) > (MAX_BLOCK_ID - factor + 1) // factor:
            raise ValueError(f"block ids too large to split {factor} ways in 63 bits")
        children = np.full(self.num_references, factor, dtype=np.int64)
        last = self.block_starts[1:] - 1
        tail_tokens = self.input_lengths - (self.blocks_per_request - 1) * self.block_size
        children[last] = -(-tail_tokens // block_size)  # ceil_div, elementwise
        references = int(children.sum())
        if references > MAX_REFERENCES:
            raise ValueError(f"at block size {block_size} the trace has {references:,} references; {_TOO_LARGE}")
        parent = np.repeat(self.block_ids, children)
        first_child = np.repeat(np.cumsum(children) - children, children)
        child_ids = parent * factor + (np.arange(len(parent), dtype=np.int64) - first_child)
        starts = np.concatenate(([0], np.cumsum(children)))[self.block_starts]
        columns = _Columns(
            self.arrival_s.copy(),
            self.input_lengths.copy(),
            self.output_lengths.copy(),
            starts,
            child_ids,
            None if self.type_codes is None else self.type_codes.copy(),
            None if self.turns is None else self.turns.copy(),
            None,  # a splittable trace is a hash-id trace: no content ids
        )
        return Trace._from_columns(self.format, block_size, self.partial_blocks, columns, self.type_names)


@dataclass(frozen=True, slots=True)
class _Columns:
    """A trace's arrays while it is being built."""

    arrival: np.ndarray  # float64 per request
    inputs: np.ndarray  # int64 per request
    outputs: np.ndarray  # int64 per request
    starts: np.ndarray  # int64, requests + 1
    ids: np.ndarray  # int64 per reference
    type_codes: np.ndarray | None  # int32 per request, or None
    turns: np.ndarray | None  # int64 per request, or None
    content_ids: np.ndarray | None  # int64 per reference, or None

    def in_arrival_order(self) -> _Columns:
        """These columns with requests stably sorted by arrival time (a copy only when out of order)."""
        if len(self.arrival) < 2 or bool(np.all(self.arrival[1:] >= self.arrival[:-1])):
            return self
        order = np.argsort(self.arrival, kind="stable")
        counts = np.diff(self.starts)[order]
        first = self.starts[:-1][order]
        offsets = np.repeat(first - (np.cumsum(counts) - counts), counts)
        positions = np.arange(int(counts.sum()), dtype=np.int64) + offsets
        ids = self.ids[positions]
        return _Columns(
            self.arrival[order],
            self.inputs[order],
            self.outputs[order],
            np.concatenate(([0], np.cumsum(counts))),
            ids,
            None if self.type_codes is None else self.type_codes[order],
            None if self.turns is None else self.turns[order],
            None if self.content_ids is None else self.content_ids[positions],
        )
