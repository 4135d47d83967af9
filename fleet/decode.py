"""Decoding the KV-event wire format of vLLM and SGLang, with every size bounded.

Frames (ZeroMQ multipart messages):

    live (PUB -> SUB)          [topic, seq, payload]
    replay reply (ROUTER)      [topic, seq, payload]   vLLM >= 0.26, SGLang >= 0.5.x
                               [seq, payload]          older vLLM and SGLang
    replay end marker          [(topic,) seq = -1, b""]

`seq` is 8 bytes big-endian (the end marker is -1 as a signed integer). The payload is MessagePack:

    EventBatch    array  [ts (float), events (array), data_parallel_rank (int, may be absent)]
                         (SGLang calls the third field attn_dp_rank; same place, same meaning)
    event, recent map    {"type": "BlockStored", "block_hashes": [...], ...}   (vLLM, SGLang 0.5)
    event, older  array  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                          lora_id, medium]

Fields with defaults may be absent from a map (vLLM encodes with `omit_defaults`); fields this
decoder does not know are ignored, so a newer server's extra fields pass. An event whose type is
unknown is skipped and named in `EventBatch.unknown_event_types`; an event of a known type whose
fields are wrong fails the whole batch (`FeedError`), so a batch is applied entirely or not at all.

Types are checked by msgspec while decoding: hashes are 64-bit ints (signed or unsigned) or at most
64 bytes, token ids are unsigned 32-bit ints, block sizes are positive. Counts are checked against
`DecodeLimits` after decoding; the payload size bound comes first, so nothing larger is ever parsed.

A batch of known map-encoded events (what vLLM and SGLang send today) decodes in one msgspec call; any
other batch is decoded again event by event, which finds the unknown types, reads the array encoding
and names the bad event.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from fleet.events import (
    DEFAULT_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

SEQ_BYTES = 8
END_SEQ = -1
MAX_NAME_CHARS = 256  # medium, LoRA name, spec kind, locality
MAX_HASH_BYTES = 64  # sha256 is 32


class FeedErrorKind(enum.Enum):
    """What was wrong with a message; the collector counts each kind per pod."""

    BAD_FRAMES = "bad_frames"  # wrong number of frames, or a sequence number that is not 8 bytes
    TOO_LARGE = "too_large"  # a payload over DecodeLimits.max_payload_bytes
    MALFORMED = "malformed"  # not MessagePack, truncated, or not an EventBatch
    BAD_EVENT = "bad_event"  # an event of a known type with missing or mistyped fields
    OVER_LIMIT = "over_limit"  # more events, blocks or tokens than DecodeLimits allows


class FeedError(ValueError):
    """A message that cannot be applied. Nothing of it reaches a sink."""

    def __init__(self, kind: FeedErrorKind, detail: str) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind  # the counter it goes to
        self.detail = detail  # a human-readable reason


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds on one message; anything above is refused with a counted error."""

    max_payload_bytes: int = 16 * 1024 * 1024  # one batch's MessagePack
    max_events_per_batch: int = 65_536  # events in one batch
    max_blocks_per_event: int = 65_536  # hashes in one BlockStored / BlockRemoved
    max_block_size: int = 65_536  # tokens per block
    max_token_ids_per_event: int = 4 * 1024 * 1024  # token ids in one BlockStored

    def __post_init__(self) -> None:
        for name in (
            "max_payload_bytes",
            "max_events_per_batch",
            "max_blocks_per_event",
            "max_block_size",
            "max_token_ids_per_event",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Frame:
    """One message split into its parts."""

    topic: bytes | None  # None for replay replies of servers that send no topic frame
    seq: int  # the sequence number (END_SEQ for the replay end marker)
    payload: bytes  # the MessagePack EventBatch (empty for the end marker)

    @property
    def is_end_marker(self) -> bool:
        """Whether this is the replay socket's end-of-replay marker."""
        return self.seq == END_SEQ and not self.payload


def _seq(raw: bytes) -> int:
    if len(raw) != SEQ_BYTES:
        raise FeedError(FeedErrorKind.BAD_FRAMES, f"sequence number of {len(raw)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(raw, "big", signed=True)


def split_live(frames: list[bytes]) -> Frame:
    """Split a live message `[topic, seq, payload]`.

    Raises:
        FeedError: BAD_FRAMES if it has another shape or a negative sequence number.
    """
    if len(frames) != 3:
        raise FeedError(FeedErrorKind.BAD_FRAMES, f"live message of {len(frames)} frames, not 3")
    topic, raw_seq, payload = frames
    seq = _seq(raw_seq)
    if seq < 0:
        raise FeedError(FeedErrorKind.BAD_FRAMES, f"live message with sequence number {seq}")
    return Frame(topic, seq, payload)


def split_replay(frames: list[bytes]) -> Frame:
    """Split a replay reply, `[topic, seq, payload]` or `[seq, payload]`, or the end marker.

    Raises:
        FeedError: BAD_FRAMES if it has another shape, or a negative sequence number that is not
            the end marker.
    """
    if len(frames) == 3:
        topic, raw_seq, payload = frames
    elif len(frames) == 2:
        topic = None
        raw_seq, payload = frames
    else:
        raise FeedError(FeedErrorKind.BAD_FRAMES, f"replay reply of {len(frames)} frames, not 2 or 3")
    frame = Frame(topic, _seq(raw_seq), payload)
    if frame.seq < 0 and not frame.is_end_marker:
        raise FeedError(FeedErrorKind.BAD_FRAMES, f"replay reply with sequence number {frame.seq}")
    return frame


# --- wire schemas (private: msgspec checks the types while it decodes) --------------------------

_Hash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
_BlockSize = Annotated[int, msgspec.Meta(ge=1)]
_GroupIdx = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _StoredMap(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True, gc=False):
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: tuple[_TokenId, ...]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: _Name | None = None
    lora_name: _Name | None = None
    extra_keys: list[Any] | None = None
    group_idx: _GroupIdx | None = None
    kv_cache_spec_kind: _Name | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: _Name | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True, gc=False):
    block_hashes: tuple[_Hash, ...]
    medium: _Name | None = None
    group_idx: _GroupIdx | None = None
    locality: _Name | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    """The common case in one C call: a batch whose events are all known map-encoded types."""

    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: int | None = None


class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: tuple[_TokenId, ...]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: _Name | None = None


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: tuple[_Hash, ...]
    medium: _Name | None = None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


KNOWN_EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_MAX_TYPE_NAME_CHARS = 64

_MAP_MARKERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_ARRAY_MARKERS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


class BatchDecoder:
    """Decodes EventBatch payloads into `fleet.events` objects. Reusable; not thread-safe."""

    def __init__(self, limits: DecodeLimits | None = None) -> None:
        """Args:
        limits: the bounds to enforce (DecodeLimits() if None).
        """
        self.limits = limits or DecodeLimits()  # the bounds every payload is held to
        self._map_batch = msgspec.msgpack.Decoder(_MapBatch)
        self._batch = msgspec.msgpack.Decoder(_Batch)
        self._map_event = msgspec.msgpack.Decoder(_StoredMap | _RemovedMap | _ClearedMap)
        self._array_event = msgspec.msgpack.Decoder(_StoredArray | _RemovedArray | _ClearedArray)
        self._any = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> EventBatch:
        """Decode one payload.

        Returns:
            The batch; events of unknown types are left out and named in `unknown_event_types`.

        Raises:
            FeedError: the payload is too large, malformed, holds a bad event or exceeds a limit.
        """
        if len(payload) > self.limits.max_payload_bytes:
            raise FeedError(
                FeedErrorKind.TOO_LARGE, f"payload of {len(payload)} bytes > {self.limits.max_payload_bytes}"
            )
        try:
            wire = self._map_batch.decode(payload)
        except msgspec.ValidationError:
            return self._decode_event_by_event(payload)
        except msgspec.DecodeError as error:
            raise FeedError(FeedErrorKind.MALFORMED, str(error)) from None
        self._check_batch(wire.ts, len(wire.events))
        events = tuple(self._convert(event) for event in wire.events)
        return EventBatch(wire.ts, events, wire.data_parallel_rank)

    def _decode_event_by_event(self, payload: bytes) -> EventBatch:
        """The general case: array-encoded events (older releases), unknown types, or a bad event."""
        try:
            wire = self._batch.decode(payload)
        except msgspec.ValidationError as error:
            raise FeedError(FeedErrorKind.MALFORMED, f"not an EventBatch: {error}") from None
        except msgspec.DecodeError as error:
            raise FeedError(FeedErrorKind.MALFORMED, str(error)) from None
        self._check_batch(wire.ts, len(wire.events))
        events: list[KVEvent] = []
        unknown: list[str] = []
        for raw in wire.events:
            event = self._event(raw)
            if isinstance(event, str):
                unknown.append(event)
            else:
                events.append(event)
        return EventBatch(wire.ts, tuple(events), wire.data_parallel_rank, tuple(unknown))

    def _check_batch(self, ts: float, num_events: int) -> None:
        if not math.isfinite(ts):
            raise FeedError(FeedErrorKind.MALFORMED, f"batch timestamp {ts}")
        if num_events > self.limits.max_events_per_batch:
            raise FeedError(FeedErrorKind.OVER_LIMIT, f"{num_events} events > {self.limits.max_events_per_batch}")

    def _event(self, raw: msgspec.Raw) -> KVEvent | str:
        """One event, or the name of its type when that type is unknown."""
        view = memoryview(raw)
        marker = view[0] if len(view) else -1
        if marker in _MAP_MARKERS:
            decoder = self._map_event
        elif marker in _ARRAY_MARKERS:
            decoder = self._array_event
        else:
            raise FeedError(FeedErrorKind.BAD_EVENT, "an event that is neither a map nor an array")
        try:
            wire = decoder.decode(raw)
        except msgspec.ValidationError as error:
            type_name = self._type_name(raw)
            if type_name is not None and type_name not in KNOWN_EVENT_TYPES:
                return type_name
            raise FeedError(FeedErrorKind.BAD_EVENT, str(error)) from None
        return self._convert(wire)

    def _type_name(self, raw: msgspec.Raw) -> str | None:
        """The tag of an event that failed to decode: its "type" key or its first element."""
        value = self._any.decode(raw)
        if isinstance(value, dict):
            tag = value.get("type")
        elif isinstance(value, list) and value:
            tag = value[0]
        else:
            return None
        return tag[:_MAX_TYPE_NAME_CHARS] if isinstance(tag, str) else None

    def _convert(self, wire: Any) -> KVEvent:
        limits = self.limits
        if isinstance(wire, (_ClearedMap, _ClearedArray)):
            return AllBlocksCleared()
        if len(wire.block_hashes) > limits.max_blocks_per_event:
            raise FeedError(
                FeedErrorKind.OVER_LIMIT, f"{len(wire.block_hashes)} blocks > {limits.max_blocks_per_event}"
            )
        if isinstance(wire, _RemovedMap):
            return BlockRemoved(
                block_hashes=wire.block_hashes,
                medium=wire.medium or DEFAULT_MEDIUM,
                group_idx=wire.group_idx or 0,
                locality=wire.locality,
            )
        if isinstance(wire, _RemovedArray):
            return BlockRemoved(block_hashes=wire.block_hashes, medium=wire.medium or DEFAULT_MEDIUM, group_idx=0)
        if wire.block_size > limits.max_block_size:
            raise FeedError(FeedErrorKind.OVER_LIMIT, f"block size {wire.block_size} > {limits.max_block_size}")
        if len(wire.token_ids) > limits.max_token_ids_per_event:
            raise FeedError(
                FeedErrorKind.OVER_LIMIT, f"{len(wire.token_ids)} token ids > {limits.max_token_ids_per_event}"
            )
        if isinstance(wire, _StoredArray):
            return BlockStored(
                block_hashes=wire.block_hashes,
                parent_block_hash=wire.parent_block_hash,
                token_ids=wire.token_ids,
                block_size=wire.block_size,
                medium=wire.medium or DEFAULT_MEDIUM,
                group_idx=0,
                lora_id=wire.lora_id,
            )
        extra_keys = _frozen(wire.extra_keys) if wire.extra_keys is not None else None
        return BlockStored(
            block_hashes=wire.block_hashes,
            parent_block_hash=wire.parent_block_hash,
            token_ids=wire.token_ids,
            block_size=wire.block_size,
            medium=wire.medium or DEFAULT_MEDIUM,
            group_idx=wire.group_idx or 0,
            lora_id=wire.lora_id,
            lora_name=wire.lora_name,
            extra_keys=extra_keys,
            kv_cache_spec_kind=wire.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=wire.kv_cache_spec_sliding_window,
            locality=wire.locality,
        )


def _frozen(value: Any) -> Any:
    """Lists (MessagePack arrays) as tuples, all the way down, so a decoded event is immutable."""
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value
