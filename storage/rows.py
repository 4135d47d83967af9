"""Turn engine values (events, request views) into rows of the history tables.

Event and eviction rows are tuples of driver-ready values (JSON already encoded) for the writer's bulk
insert; request rows are dicts for SQLAlchemy's upsert.

The storage layer depends on the engine only through `engine.events` (the Event type and the detail
field names per kind), the field names of `engine.request.Request` and `engine.snapshot.RequestView`
(whose attributes `view_values` reads, and whose records `checked_request_records` trusts). A request
may be given as any object with those attributes (a `RequestView`, a `Request`) or as a mapping with
those keys.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Mapping
from typing import Any

from engine.events import Event, EventKind
from engine.snapshot import RequestView
from storage.db import encode_json

# Column order of `event_values` and `eviction_values`.
EVENT_COLUMNS = ("run_id", "step", "time", "kind", "request_id", "block_id", "tokens", "detail")
EVICTION_COLUMNS = (
    "run_id", "time", "block_id", "key_hex", "start_pos", "end_pos", "reason",
    "age_s", "hit_count", "last_used", "group", "request_id",
)  # fmt: skip
# Request fields copied as they are (the columns of `requests` that mirror engine.request.Request).
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
)
# Sliding-window replay fields; absent until the engine records them.
WINDOW_FIELDS = ("h", "s", "e", "r", "replay_mode", "replayed_tokens")
REQUIRED_REQUEST_FIELDS = ("request_id", "status", "arrival_time")
_ROW_FIELDS = REQUEST_FIELDS + WINDOW_FIELDS
_READ_ROW_FIELDS = operator.attrgetter(*_ROW_FIELDS)
# What a request row holds where its record has no value (None or empty), here and in the writer's SQLite path.
REQUEST_DEFAULTS = {
    "output_token_ids": [],
    "cached_tokens": 0,
    "computed_tokens": 0,
    "cow_copies": 0,
    "preemptions": 0,
    "hit_source": "none",
}
# The `requests` columns an engine RequestView fills, in `view_values` order (the writer's SQLite path
# takes them positionally).
VIEW_COLUMNS = (*REQUEST_FIELDS, "prompt_tokens", *WINDOW_FIELDS)
_VIEW_ATTRIBUTES = {"prompt_tokens": "num_prompt_tokens"}
# RequestView -> its VIEW_COLUMNS values, in one C call (its strings are plain already, not enums).
view_values = operator.attrgetter(*(_VIEW_ATTRIBUTES.get(column, column) for column in VIEW_COLUMNS))
_PROMPT_FIELD = RequestView._fields.index("prompt_token_ids")
# Enum `.value` is a slow descriptor; event rows are the hot path of the writer.
_KIND_VALUES = {kind: kind.value for kind in EventKind}


def event_values(run_id: str, event: Event) -> tuple[Any, ...]:
    """The `events` row for one event, as driver-ready values in EVENT_COLUMNS order."""
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
    """The `evictions` row for an EVICT event, in EVICTION_COLUMNS order (detail names: engine.events)."""
    if event.kind is not EventKind.EVICT:
        raise ValueError(f"not an eviction: {event.kind}")
    detail = event.detail
    key = detail.get("key")
    group = detail.get("group")
    return (
        run_id,
        event.time,
        event.block_id,
        key.lower() if isinstance(key, str) else None,
        detail.get("start_pos"),
        detail.get("end_pos"),
        _plain(detail.get("reason")),
        detail.get("age_s"),
        detail.get("hit_count"),
        detail.get("last_used"),
        None if group is None else str(_plain(group)),
        event.request_id,
    )


def request_row(run_id: str, request: Mapping[str, Any] | object) -> dict[str, Any]:
    """The `requests` row for one request view or mapping.

    The prompt length is taken from `prompt_tokens`, else `num_prompt_tokens`, else the length of
    `prompt_token_ids`; enum values are stored as their string values.

    Raises:
        ValueError: a required field (request_id, status, arrival_time) is missing.
    """
    read = _reader(request)
    values = None
    if not isinstance(request, Mapping):
        try:
            values = _READ_ROW_FIELDS(request)  # one C call for the engine's views
        except AttributeError:
            pass  # an object without the window fields: read them one by one
    if values is None:
        values = tuple(read(name) for name in _ROW_FIELDS)
    row = dict(zip(_ROW_FIELDS, map(_plain, values)))
    missing = [name for name in REQUIRED_REQUEST_FIELDS if row[name] is None]
    if missing:
        raise ValueError(f"request record lacks {missing}")
    row["run_id"] = run_id
    row["prompt_tokens"] = _prompt_tokens(read)
    for name, default in REQUEST_DEFAULTS.items():
        row[name] = row[name] or default
    row["output_token_ids"] = list(row["output_token_ids"])  # a copy: never the shared default
    return row


def checked_request_records(requests: Iterable[Mapping[str, Any] | object]) -> list[Mapping[str, Any] | object]:
    """Request records as a writer queues them: mappings copied, objects as given (nobody may change them
    afterwards). Engine RequestViews pass unchecked: they are immutable and always carry the fields.

    Raises:
        ValueError: a record lacks request_id, status or arrival_time.
    """
    records = []
    for record in requests:
        if type(record) is not RequestView:
            if isinstance(record, Mapping):
                record = dict(record)
            read = _reader(record)
            missing = [name for name in REQUIRED_REQUEST_FIELDS if read(name) is None]
            if missing:
                raise ValueError(f"request record lacks {missing}")
        records.append(record)
    return records


def view_without_prompt(view: RequestView) -> tuple[Any, ...]:
    """A view's fields as a plain tuple (pickled in C, unlike a NamedTuple), its prompt tokens left out:
    the history stores only their count (`num_prompt_tokens`). `RequestView._make` rebuilds the view."""
    return (*view[:_PROMPT_FIELD], (), *view[_PROMPT_FIELD + 1 :])


def request_id_of(request: Mapping[str, Any] | object) -> Any:
    if type(request) is RequestView:  # the engine's records: the common case, and the Mapping check is slow
        return request.request_id
    return request.get("request_id") if isinstance(request, Mapping) else getattr(request, "request_id", None)


def _reader(request: Mapping[str, Any] | object):
    return request.get if isinstance(request, Mapping) else lambda name: getattr(request, name, None)


def _prompt_tokens(read) -> int:
    for name in ("prompt_tokens", "num_prompt_tokens"):
        value = read(name)
        if value is not None:
            return int(value)
    return len(read("prompt_token_ids") or ())


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value
