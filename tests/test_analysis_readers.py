"""Trace readers: both formats, detection, and every bad input as a TraceError naming its line."""

from __future__ import annotations

import io

import pytest

from analysis.errors import TraceError
from analysis.readers import MAX_LINE_BYTES, detect_format, load_trace, parse_format, read_requests
from analysis.trace import TraceFormat
from tests.analysis_support import BAILIAN_SAMPLE, CONVERSATION_SAMPLE, SYNTHETIC_SAMPLE


def lines(*rows: str) -> io.BytesIO:
    return io.BytesIO("\n".join(rows).encode() + b"\n")


MOONCAKE_LINE = '{"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}'


def row(timestamp="0", input_length="10", output_length="3", hash_ids="[1]") -> str:
    """A Mooncake line with the given JSON values."""
    return (
        f'{{"timestamp": {timestamp}, "input_length": {input_length}, '
        f'"output_length": {output_length}, "hash_ids": {hash_ids}}}'
    )


def test_mooncake_sample_reads_in_full_with_ms_timestamps_and_512_token_blocks():
    trace = load_trace(CONVERSATION_SAMPLE)
    assert trace.format is TraceFormat.MOONCAKE
    assert (len(trace), trace.num_references, trace.block_size) == (223, 4852, 512)
    first = next(read_requests(open(CONVERSATION_SAMPLE, "rb")))
    assert first.arrival_s == 9.0 and first.block_ids[:2] == (0, 800)  # {"timestamp": 9000, ...}
    assert trace.type_codes is None and trace.turns is None


def test_synthetic_sample_reads_in_full():
    trace = load_trace(SYNTHETIC_SAMPLE)
    assert (len(trace), trace.num_references) == (185, 5074)


def test_bailian_sample_keeps_chat_metadata_and_seconds():
    requests = list(read_requests(open(BAILIAN_SAMPLE, "rb")))
    assert len(requests) == 8
    third = requests[2]
    assert (third.arrival_s, third.block_size, third.request_type, third.turn) == (3.25, 16, "text", 2)
    assert (third.chat_id, third.parent_chat_id) == (2, 0)
    assert requests[0].parent_chat_id is None  # -1 in the file: a first turn
    trace = load_trace(BAILIAN_SAMPLE)
    assert trace.format is TraceFormat.BAILIAN
    assert trace.type_names == ("text", "image", "search", "file")
    assert trace.turns.tolist() == [1, 1, 2, 1, 1, 3, 2, 1]


def test_format_is_detected_from_the_first_line():
    assert detect_format(MOONCAKE_LINE.encode()) is TraceFormat.MOONCAKE
    assert detect_format(open(BAILIAN_SAMPLE, "rb").readline()) is TraceFormat.BAILIAN


def test_explicit_format_wins_over_detection():
    # A Bailian line read as Mooncake: its ms timestamp and 512-token blocks no longer fit its 16-token ids.
    with pytest.raises(TraceError) as error:
        load_trace(open(BAILIAN_SAMPLE, "rb"), TraceFormat.MOONCAKE)
    assert error.value.line == 1 and "ceil(50 / 512) = 1" in str(error.value)


def test_blank_lines_are_skipped_and_line_numbers_count_them():
    trace = load_trace(lines("", MOONCAKE_LINE, "   ", MOONCAKE_LINE))
    assert len(trace) == 2
    with pytest.raises(TraceError) as error:
        load_trace(lines("", MOONCAKE_LINE, "", "{not json"))
    assert error.value.line == 4


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"timestamp": 0, "output_length": 3, "hash_ids": [1]}', "missing field 'input_length'"),
        (row(input_length='"600"'), "'input_length' must be an integer"),
        (row(input_length="true"), "'input_length' must be an integer"),
        (row(timestamp="-5"), "'timestamp' must be a number >= 0"),
        (row(input_length="0", hash_ids="[]"), "input_length must be in [1, 2**40]"),
        (row(output_length="-1"), "output_length must be in [0, 2**40]"),
        (row(hash_ids="1"), "'hash_ids' must be a list"),
        (row(hash_ids="[-1]"), "integers in [0, 2**63)"),
        (row(hash_ids="[1.5]"), "integers in [0, 2**63)"),
        (row(input_length="1100", hash_ids="[1, 2]"), "ceil(1100 / 512) = 3"),
        (row(input_length="1000", hash_ids="[4, 4]"), "repeats a block id"),
    ],
)
def test_a_bad_line_is_a_trace_error_with_its_line_number(bad, reason):
    with pytest.raises(TraceError) as error:
        load_trace(lines(MOONCAKE_LINE, MOONCAKE_LINE, bad))
    assert error.value.line == 3
    assert reason in error.value.reason
    assert str(error.value).startswith("line 3: ")


def test_bailian_fields_are_checked_too():
    bailian = (
        '{"chat_id": 1, "parent_chat_id": -2, "timestamp": 1.0, "input_length": 20, "output_length": 1, '
        '"type": "text", "turn": 1, "hash_ids": [1, 2]}'
    )
    with pytest.raises(TraceError, match="line 1: field 'parent_chat_id' must be -1"):
        load_trace(lines(bailian))
    bailian = bailian.replace('"parent_chat_id": -2', '"parent_chat_id": -1').replace('"text"', "7")
    with pytest.raises(TraceError, match="line 1: field 'type' must be a string"):
        load_trace(lines(bailian))


def test_an_empty_trace_is_an_error():
    for empty in (b"", b"\n\n  \n"):
        with pytest.raises(TraceError, match="the trace is empty") as error:
            load_trace(io.BytesIO(empty))
        assert error.value.line is None


def test_an_undetectable_format_asks_for_format():
    with pytest.raises(TraceError, match="line 1: cannot tell the trace format"):
        load_trace(lines('{"timestamp": 0, "input_length": 5}'))


def test_an_unknown_format_name_lists_the_known_ones():
    assert parse_format("bailian") is TraceFormat.BAILIAN
    with pytest.raises(TraceError, match="unknown trace format 'csv' \\(known: mooncake, bailian, run-trace, history\\)"):
        parse_format("csv")


def test_a_line_over_the_bound_is_refused_before_it_is_parsed():
    huge = b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "pad": "' + b"x" * MAX_LINE_BYTES
    with pytest.raises(TraceError, match=f"line 2: line longer than {MAX_LINE_BYTES} bytes"):
        load_trace(io.BytesIO(MOONCAKE_LINE.encode() + b"\n" + huge + b'"}\n'))


def test_a_line_exactly_at_the_bound_is_read():
    head = b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "pad": "'
    line = head + b"x" * (MAX_LINE_BYTES - len(head) - 2) + b'"}'
    assert len(line) == MAX_LINE_BYTES
    assert len(load_trace(io.BytesIO(line + b"\n"))) == 1


def test_reading_is_lazy_so_an_error_comes_after_the_good_lines():
    requests = read_requests(lines(MOONCAKE_LINE, "oops"))
    assert next(requests).input_length == 600
    with pytest.raises(TraceError, match="line 2"):
        next(requests)
