"""Turn the engine's values (`Event`s, `RequestView`s) into rows of the history tables.

The writers accept these two types only, checked when they are handed over (`checked_events`,
`checked_views`), so bad input fails at the call and never inside the writer thread. Event and eviction
rows are tuples of driver-ready values (JSON already encoded) in the column orders of storage.schema;
request rows are dicts for SQLAlchemy's upsert. `encode_events` is the events' wire and SQLite form: one
JSON array, built in C; the events that also get rows of their own (EVICT: `evictions`; the disk tier's:
`tier_moves`) stay objects beside it.

The storage layer depends on the engine only through `engine.core.events` (the Event type and the detail
field names per kind) and `engine.core.snapshot.RequestView` (field names, plain-string values).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import orjson

from engine.core.events import Event, EventKind
from engine.core.snapshot import RequestView
from storage.db import encode_json

# Request fields copied as they are (the columns of `requests` that mirror the RequestView's fields).
REQUEST_FIELDS = (
    "request_id",
    "parent_id",
    "status",
    "output_token_ids",
    "cached_tokens",
    "computed_tokens",
    "hit_source",
    "cow_copies",
    "preemptions",
    "finish_reason",
    "arrival_time",
    "first_scheduled_time",
    "first_token_time",
    "finish_time",
    "disk_cached_tokens",
)
# Sliding-window replay fields (RequestView's h, s, e, r are properties named as in the REPLAY event).
WINDOW_FIELDS = ("h", "s", "e", "r", "replay_mode", "replayed_tokens")
# The prompt's keys (bytes, set once a request finished): the SQLite JSON path cannot carry them, so they
# are written by their own statement there (storage.write.bulk_sqlite); other paths take them with the row.
KEY_FIELDS = ("block_keys", "content_keys")
# The `requests` columns a RequestView fills through the JSON path, in `view_values` order (positional).
VIEW_COLUMNS = (*REQUEST_FIELDS, "prompt_tokens", *WINDOW_FIELDS)
_VIEW_ATTRIBUTES = {"prompt_tokens": "num_prompt_tokens"}
# RequestView -> its VIEW_COLUMNS values, in one C call.
view_values = operator.attrgetter(*(_VIEW_ATTRIBUTES.get(column, column) for column in VIEW_COLUMNS))
# The view fields behind NOT NULL columns of `requests`: a view lacking one is refused when handed over.
REQUIRED_VIEW_FIELDS = (
    "request_id", "status", "num_prompt_tokens", "output_token_ids", "cached_tokens", "computed_tokens",
    "hit_source", "cow_copies", "preemptions", "arrival_time",
)  # fmt: skip
_READ_REQUIRED = operator.itemgetter(*(RequestView._fields.index(name) for name in REQUIRED_VIEW_FIELDS))
_PROMPT_FIELD = RequestView._fields.index("prompt_token_ids")
# Enum `.value` is a slow descriptor; event rows are the hot path of the writer.
_KIND_VALUES = {kind: kind.value for kind in EventKind}
# The events with rows of their own besides `events`, found by the identity of their kind: a set of ids
# (ints, hashed in C) where a set of kinds would hash each through Enum.__hash__, in Python, and a tuple
# compares each event's kind with all five (on 512 events: +30 us over the EVICT-only pass, +80 us).
_TIER_KINDS = (EventKind.DEMOTE, EventKind.PROMOTE, EventKind.TIER_EVICT, EventKind.TIER_DROP)
_LOGGED_KIND_IDS = frozenset(map(id, (EventKind.EVICT, *_TIER_KINDS)))
_EVENT_TYPE = frozenset({Event})


def checked_events(events: Sequence[Event]) -> Sequence[Event]:
    """`events` as given, once every element is an `engine.core.events.Event`.

    Raises:
        TypeError: an element of another type (a dict, a plain tuple, ...).
    """
    types = set(map(type, events))  # in C: the check costs a fraction of encoding the events
    if not types <= _EVENT_TYPE:
        other = next(kind for kind in types if kind is not Event)
        raise TypeError(f"the writer stores engine.core.events.Event values, got a {other.__name__}")
    return events


def checked_views(views: Iterable[RequestView]) -> tuple[RequestView, ...]:
    """`views` as a tuple, once every element is an `engine.core.snapshot.RequestView` with its required fields.

    Raises:
        TypeError: an element of another type (a dict, an `engine.core.request.Request`, ...).
        ValueError: a view whose request_id, status, arrival_time or a count is None.
    """
    views = tuple(views)
    for view in views:
        if type(view) is not RequestView:
            raise TypeError(f"the writer stores engine.core.snapshot.RequestView values, got a {type(view).__name__}")
        if None in _READ_REQUIRED(view):
            missing = [name for name, value in zip(REQUIRED_VIEW_FIELDS, _READ_REQUIRED(view)) if value is None]
            raise ValueError(f"request view {view.request_id!r} lacks {missing}")
    return views


def event_values(run_id: str, event: Event) -> tuple[Any, ...]:
    """The `events` row for one event, as driver-ready values in EVENT_COLUMNS order.

    `event.kind` is an EventKind, or its value for events decoded from `encode_events`.
    """
    return (
        run_id,
        event.step,
        event.time,
        _KIND_VALUES.get(event.kind, event.kind),
        event.request_id,
        event.block_id,
        event.tokens,
        encode_json(event.detail),
    )


def eviction_values(run_id: str, event: Event) -> tuple[Any, ...]:
    """The `evictions` row for an EVICT event, in EVICTION_ROW_COLUMNS order (detail names: engine.core.events).

    Raises:
        ValueError: not an EVICT event.
    """
    if event.kind is not EventKind.EVICT:
        raise ValueError(f"not an eviction: {event.kind}")
    detail = event.detail
    key = detail.get("key")
    return (
        event.time,
        run_id,
        detail.get("reason"),
        event.block_id,
        key.lower() if isinstance(key, str) else None,
        detail.get("start_pos"),
        detail.get("end_pos"),
        detail.get("age_s"),
        detail.get("hit_count"),
        detail.get("last_used"),
        detail.get("group"),
        event.request_id,
    )


def tier_move_values(run_id: str, event: Event) -> list[tuple[Any, ...]]:
    """The `tier_moves` rows of a DEMOTE, PROMOTE, TIER_EVICT or TIER_DROP event, in TIER_MOVE_COLUMNS order:
    one per block it moved (a PROMOTE's `block_ids`, `keys` and `slots` side by side, its tokens shared out
    evenly). Detail names: engine.core.events.

    Raises:
        ValueError: another kind of event, or a PROMOTE whose lists differ in length.
    """
    kind = _KIND_VALUES.get(event.kind, event.kind)
    if kind not in _TIER_KINDS:
        raise ValueError(f"not a tier event: {event.kind}")
    detail = event.detail
    if kind != EventKind.PROMOTE:
        key = detail.get("key")
        key_hex = key.lower() if isinstance(key, str) else None
        row = (run_id, event.step, event.time, kind, key_hex, event.block_id, event.request_id, detail.get("slot"),
               detail.get("reason"), event.tokens)  # fmt: skip
        return [row]
    block_ids, keys, slots = detail.get("block_ids") or [], detail.get("keys") or [], detail.get("slots") or []
    if not len(block_ids) == len(keys) == len(slots):
        lists = f"{len(block_ids)} blocks, {len(keys)} keys, {len(slots)} slots"
        raise ValueError(f"a PROMOTE of {event.request_id} lists {lists}")
    each = event.tokens // len(block_ids) if block_ids else 0
    return [
        (run_id, event.step, event.time, kind, key.lower(), block_id, event.request_id, slot, None, each)
        for block_id, key, slot in zip(block_ids, keys, slots)
    ]


class EncodedEvents(NamedTuple):
    """Events in the form the writer stores them (`encode_events`)."""

    json: str  # a JSON array with one array per event, the Event fields in order (kind as its value)
    count: int  # events in it
    evictions: tuple[Event, ...]  # its EVICT events, for the eviction log and its rollups
    tier_moves: tuple[Event, ...] = ()  # its disk-tier events, for the tier's log


def encode_events(events: Sequence[Event]) -> EncodedEvents:
    """Encode events as the writer stores them (one orjson call, in C); only EVICT and the tier's events stay
    objects.

    A WriterProcess sends events this way: its child neither rebuilds nor re-encodes the others.
    """
    logged = [event for event in events if id(event.kind) in _LOGGED_KIND_IDS]
    evictions = tuple(event for event in logged if event.kind is EventKind.EVICT)
    tier_moves = tuple(event for event in logged if event.kind is not EventKind.EVICT)
    return EncodedEvents(encode_json(list(map(tuple, events))), len(events), evictions, tier_moves)


def join_encoded(parts: Sequence[EncodedEvents]) -> EncodedEvents:
    """Several `encode_events` results as one, in order (one JSON array, no re-encoding)."""
    if len(parts) == 1:
        return parts[0]
    evictions = tuple(event for part in parts for event in part.evictions)
    tier_moves = tuple(event for part in parts for event in part.tier_moves)
    json = "[" + ",".join(part.json[1:-1] for part in parts if part.count) + "]"
    return EncodedEvents(json, sum(part.count for part in parts), evictions, tier_moves)


def decode_events(encoded: EncodedEvents) -> list[Event]:
    """The events of `encode_events`, each kind as its value (which `event_values` takes as it is)."""
    return [Event._make(fields) for fields in orjson.loads(encoded.json)]


def request_row(run_id: str, view: RequestView) -> dict[str, Any]:
    """The `requests` row for one request view (the columns of VIEW_COLUMNS, KEY_FIELDS and its run).

    The keys are None until the request finishes, and set from then on in every view of it.
    """
    row = dict(zip(VIEW_COLUMNS, view_values(view)))
    row["run_id"] = run_id
    row["output_token_ids"] = list(row["output_token_ids"])
    row.update(zip(KEY_FIELDS, key_values(view)))
    return row


# RequestView -> its KEY_FIELDS values.
key_values = operator.attrgetter(*KEY_FIELDS)


def view_without_prompt(view: RequestView) -> tuple[Any, ...]:
    """A view's fields as a plain tuple (pickled in C, unlike a NamedTuple), its prompt tokens left out:
    the history stores only their count (`num_prompt_tokens`). `RequestView._make` rebuilds the view."""
    return (*view[:_PROMPT_FIELD], (), *view[_PROMPT_FIELD + 1 :])
