"""Decoding the KV-event wire format: vLLM 0.33's own encoder, older releases' arrays, SGLang, and bad input."""

from __future__ import annotations

import msgspec
import pytest

from fleet.decode import (
    BatchDecoder,
    DecodeLimits,
    FeedError,
    FeedErrorKind,
    split_live,
    split_replay,
)
from fleet.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.fleet_support import (
    LegacyAllBlocksCleared,
    LegacyBlockRemoved,
    LegacyBlockStored,
    LegacyEventBatch,
    encode_batch,
    stored_map,
)


def refused(payload: bytes, limits: DecodeLimits | None = None) -> FeedErrorKind:
    with pytest.raises(FeedError) as error:
        BatchDecoder(limits).decode(payload)
    return error.value.kind


def test_vllm_0_33s_own_encoding_decodes_field_for_field():
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM interop")
    stored = kv_events.BlockStored(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=5,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=3,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[("adapter", ("img", 0)), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        session_id="s-1",  # a field this decoder does not know: ignored
    )
    removed = kv_events.BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU", group_idx=1)
    batch = kv_events.KVEventBatch(
        ts=12.5, events=[stored, removed, kv_events.AllBlocksCleared()], data_parallel_rank=2
    )
    decoded = BatchDecoder().decode(msgspec.msgpack.Encoder().encode(batch))
    assert decoded.ts == 12.5 and decoded.data_parallel_rank == 2
    assert decoded.events == (
        BlockStored(
            block_hashes=(2**64 - 1, 7),
            parent_block_hash=5,
            token_ids=tuple(range(8)),
            block_size=4,
            medium="GPU",
            group_idx=1,
            lora_id=3,
            lora_name="adapter",
            extra_keys=(("adapter", ("img", 0)), None),
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
            locality="LOCAL",
        ),
        BlockRemoved(block_hashes=(b"\x01" * 32,), medium="CPU", group_idx=1),
        AllBlocksCleared(),
    )
    assert decoded.num_block_events == 3


def test_vllm_omits_defaults_so_absent_fields_take_theirs():
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM interop")
    stored = kv_events.BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.0, events=[stored]))
    (event,) = BatchDecoder().decode(payload).events
    assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == ("GPU", 0, None)
    assert BatchDecoder().decode(payload).data_parallel_rank is None


def test_the_array_encoding_of_older_releases_decodes():
    batch = LegacyEventBatch(
        ts=3.0,
        events=[
            LegacyBlockStored([1, 2], None, [5, 6, 7, 8], 2, None, "CPU"),
            LegacyBlockRemoved([1], None),
            LegacyAllBlocksCleared(),
        ],
    )
    decoded = BatchDecoder().decode(msgspec.msgpack.encode(batch))
    assert decoded.data_parallel_rank is None
    assert decoded.events == (
        BlockStored((1, 2), None, (5, 6, 7, 8), 2, "CPU", 0),
        BlockRemoved((1,), "GPU", 0),
        AllBlocksCleared(),
    )


def test_sglangs_encoding_decodes_with_its_signed_hashes_and_attn_dp_rank():
    kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events", reason="SGLang interop")
    stored = kv_events.BlockStored(
        block_hashes=[-(2**63), 2**63 - 1],
        parent_block_hash=-1,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="CPU_PINNED",
        cache_salt="tenant-a",
    )
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=2.0, events=[stored], attn_dp_rank=1))
    decoded = BatchDecoder().decode(payload)
    assert decoded.data_parallel_rank == 1
    assert decoded.events == (BlockStored((-(2**63), 2**63 - 1), -1, (1, 2, 3, 4), 2, "CPU_PINNED", 0),)


def test_unknown_event_types_are_named_and_skipped():
    payload = encode_batch([{"type": "BlockPinned"}, ["Future"], stored_map([1], [1, 1, 1, 1])])
    decoded = BatchDecoder().decode(payload)
    assert decoded.unknown_event_types == ("BlockPinned", "Future")
    assert [type(event) for event in decoded.events] == [BlockStored]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        encode_batch([stored_map([1], [1, 2, 3, 4])])[:-3],
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode({"ts": 1.0, "events": []}),
        msgspec.msgpack.encode(["yesterday", []]),
        msgspec.msgpack.encode([float("nan"), []]),
    ],
    ids=["empty", "garbage", "truncated", "no events", "a map", "a string ts", "nan ts"],
)
def test_a_payload_that_is_not_an_event_batch_is_malformed(payload):
    assert refused(payload) is FeedErrorKind.MALFORMED


@pytest.mark.parametrize(
    "event",
    [
        stored_map([1], [1, 2, 3, -1]),
        stored_map([1], [1, 2, 3, 2**32]),
        stored_map([1.5], [1, 2, 3, 4]),
        stored_map([b"x" * 65], [1, 2, 3, 4]),
        stored_map([2**64 - 1], [1, 2, 3, 4], block_size=0),
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1},
        {"type": "BlockRemoved"},
        {**stored_map([1], [1, 2, 3, 4]), "medium": "x" * 300},
        {**stored_map([1], [1, 2, 3, 4]), "group_idx": -1},
        "BlockStored",
    ],
    ids=[
        "negative token",
        "token over 32 bits",
        "float hash",
        "65-byte hash",
        "zero block size",
        "no parent field",
        "no hashes",
        "long medium",
        "negative group",
        "not a map",
    ],
)
def test_a_known_event_with_bad_fields_refuses_the_batch(event):
    assert refused(encode_batch([stored_map([9], [0, 0, 0, 0]), event])) is FeedErrorKind.BAD_EVENT


def test_every_limit_is_enforced():
    limits = DecodeLimits(
        max_payload_bytes=1_000,
        max_events_per_batch=2,
        max_blocks_per_event=2,
        max_block_size=4,
        max_token_ids_per_event=8,
    )
    assert refused(encode_batch(["x" * 1_000]), limits) is FeedErrorKind.TOO_LARGE
    assert refused(encode_batch([stored_map([1], [0] * 4)] * 3), limits) is FeedErrorKind.OVER_LIMIT
    assert refused(encode_batch([stored_map([1, 2, 3], [0] * 12)]), limits) is FeedErrorKind.OVER_LIMIT
    assert refused(encode_batch([stored_map([1], [0] * 8, block_size=8)]), limits) is FeedErrorKind.OVER_LIMIT
    assert refused(encode_batch([stored_map([1, 2], [0] * 9)]), limits) is FeedErrorKind.OVER_LIMIT
    assert BatchDecoder(limits).decode(encode_batch([stored_map([1, 2], [0] * 8)] * 2)).num_block_events == 4


def test_limits_must_be_positive_ints():
    with pytest.raises(ValueError, match="max_events_per_batch"):
        DecodeLimits(max_events_per_batch=0)


def test_live_frames_are_topic_sequence_payload():
    frame = split_live([b"kv", (7).to_bytes(8, "big"), b"payload"])
    assert (frame.topic, frame.seq, frame.payload) == (b"kv", 7, b"payload")
    for frames in ([b"kv", b"x"], [b"kv", b"1234567", b"p"], [b"kv", (-1).to_bytes(8, "big", signed=True), b""]):
        with pytest.raises(FeedError) as error:
            split_live(frames)
        assert error.value.kind is FeedErrorKind.BAD_FRAMES


def test_replay_replies_come_with_or_without_the_topic_frame_and_end_with_seq_minus_one():
    end = (-1).to_bytes(8, "big", signed=True)
    assert split_replay([b"kv", (3).to_bytes(8, "big"), b"p"]).topic == b"kv"
    assert split_replay([(3).to_bytes(8, "big"), b"p"]).topic is None
    assert split_replay([b"", end, b""]).is_end_marker
    assert split_replay([end, b""]).is_end_marker
    with pytest.raises(FeedError):
        split_replay([end, b"not empty"])
