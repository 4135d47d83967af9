"""Trace readers: one per format, streaming, with a bounded line length.

Both formats are JSON lines, one request per line; blank lines are skipped.

    mooncake  {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}       512-token blocks
    bailian   {"chat_id", "parent_chat_id" (-1: first turn), "timestamp": s, "input_length",
               "output_length", "type", "turn", "hash_ids": [...]}                           16-token blocks

Fields beyond these are ignored. A reader holds one line at a time, and refuses a line longer than
`MAX_LINE_BYTES` before parsing it, so a file without newlines cannot exhaust memory. Every problem is a
`TraceError` naming the line: the CLI prints it and exits with status 2.

The format is explicit (`TraceFormat`) or detected from the first non-blank line: a line with a `chat_id`
is Bailian, one with `hash_ids` but no `chat_id` is Mooncake. An explicit format always wins.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from analysis.errors import TraceError
from analysis.trace import PartialBlocks, Trace, TraceFormat, TraceRequest, check_request

MAX_LINE_BYTES = 4 * 1024 * 1024  # longest accepted line, without its newline (a 16-token-block trace
# line of a 1 M-token prompt is about 0.6 MiB)


def parse_format(name: str) -> TraceFormat:
    """The format called `name` (as typed after `--format`).

    Raises:
        TraceError: no format has that name.
    """
    try:
        return TraceFormat(name)
    except ValueError:
        known = ", ".join(f.value for f in TraceFormat)
        raise TraceError(f"unknown trace format {name!r} (known: {known})") from None


def detect_format(line: bytes, number: int = 1) -> TraceFormat:
    """The format of a trace whose first non-blank line is `line` (line `number` of the file).

    Raises:
        TraceError: the line is not a JSON object, or matches no format.
    """
    record = parse_object(line, number)
    if "chat_id" in record:
        return TraceFormat.BAILIAN
    if "hash_ids" in record:
        return TraceFormat.MOONCAKE
    raise TraceError("cannot tell the trace format (no hash_ids field); name it with --format", number)


def read_requests(file: BinaryIO, trace_format: TraceFormat | None = None) -> Iterator[TraceRequest]:
    """Yield the requests of a trace opened in binary mode, in file order.

    Args:
        file: the trace, opened for reading bytes.
        trace_format: its format; None detects it from the first non-blank line.

    Raises:
        TraceError: a line is too long, not a JSON object, or not a valid request of the format; or the
            format cannot be detected.
    """
    lines = numbered_lines(file)
    first = next(lines, None)
    if first is None:
        return
    yield from _parse_lines(itertools.chain([first], lines), trace_format or detect_format(first[1], first[0]))


def load_trace(source: str | Path | BinaryIO, trace_format: TraceFormat | None = None) -> Trace:
    """Read a whole trace file (a path, or a binary file object) into a `Trace`.

    Raises:
        TraceError: as `read_requests`, and when the file holds no request.
    """
    if isinstance(source, (str, Path)):
        with open(source, "rb") as file:
            return load_trace(file, trace_format)
    lines = numbered_lines(source)
    first = next(lines, None)
    if first is None:
        raise TraceError("the trace is empty (no requests)")
    resolved = trace_format or detect_format(first[1], first[0])
    return Trace.from_requests(_parse_lines(itertools.chain([first], lines), resolved), resolved)


def _parse_lines(lines: Iterable[tuple[int, bytes]], trace_format: TraceFormat) -> Iterator[TraceRequest]:
    parse = _PARSERS[trace_format]
    for number, line in lines:
        request = parse(parse_object(line, number), number)
        try:
            check_request(request, PartialBlocks.CACHED)
        except TraceError as error:
            raise TraceError(error.reason, number) from None
        yield request


def numbered_lines(file: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(1-based number, content without the newline) of every non-blank line."""
    number = 0
    while True:
        line = file.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise TraceError(f"line longer than {MAX_LINE_BYTES} bytes", number)
        line = line.rstrip(b"\r\n")
        if line.strip():
            yield number, line


def parse_object(line: bytes, number: int) -> dict[str, Any]:
    """Line `number` as a JSON object. Raises TraceError (naming the line) for anything else."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as error:
        raise TraceError(f"not valid JSON ({error})", number) from None
    if not isinstance(record, dict):
        raise TraceError(f"expected a JSON object, got {type(record).__name__}", number)
    return record


def _field(record: dict[str, Any], name: str, number: int) -> Any:
    try:
        return record[name]
    except KeyError:
        raise TraceError(f"missing field {name!r}", number) from None


def _integer(record: dict[str, Any], name: str, number: int) -> int:
    value = _field(record, name, number)
    if type(value) is not int:  # bool is not an int here
        raise TraceError(f"field {name!r} must be an integer, got {value!r}", number)
    return value


def _seconds(record: dict[str, Any], name: str, number: int, unit_s: float) -> float:
    value = _field(record, name, number)
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise TraceError(f"field {name!r} must be a number >= 0, got {value!r}", number)
    return value * unit_s


def _hash_ids(record: dict[str, Any], number: int) -> tuple[int, ...]:
    value = _field(record, "hash_ids", number)
    if not isinstance(value, list):
        raise TraceError(f"field 'hash_ids' must be a list of integers, got {type(value).__name__}", number)
    return tuple(value)  # each id is checked by check_request


def _mooncake(record: dict[str, Any], number: int) -> TraceRequest:
    return TraceRequest(
        arrival_s=_seconds(record, "timestamp", number, 1e-3),
        input_length=_integer(record, "input_length", number),
        output_length=_integer(record, "output_length", number),
        block_ids=_hash_ids(record, number),
        block_size=TraceFormat.MOONCAKE.block_size,
    )


def _bailian(record: dict[str, Any], number: int) -> TraceRequest:
    request_type = _field(record, "type", number)
    if not isinstance(request_type, str):
        raise TraceError(f"field 'type' must be a string, got {request_type!r}", number)
    parent = _integer(record, "parent_chat_id", number)
    if parent < -1:
        raise TraceError(f"field 'parent_chat_id' must be -1 (first turn) or a chat_id, got {parent}", number)
    return TraceRequest(
        arrival_s=_seconds(record, "timestamp", number, 1.0),
        input_length=_integer(record, "input_length", number),
        output_length=_integer(record, "output_length", number),
        block_ids=_hash_ids(record, number),
        block_size=TraceFormat.BAILIAN.block_size,
        request_type=request_type,
        turn=_integer(record, "turn", number),
        chat_id=_integer(record, "chat_id", number),
        parent_chat_id=None if parent == -1 else parent,
    )


_PARSERS: dict[TraceFormat, Callable[[dict[str, Any], int], TraceRequest]] = {
    TraceFormat.MOONCAKE: _mooncake,
    TraceFormat.BAILIAN: _bailian,
}
