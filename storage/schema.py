"""The history schema (the head revision; `storage/migrations/` builds it step by step).

Tables:
    runs       one row per engine start.
    requests   the engine's per-request record, one row per (run_id, request_id), upserted.
    events     every engine event, append-only, in insertion (id) order.
    evictions  the eviction log: one row per EVICT event, denormalised for the eviction pages.
    prunes     one row per retention deletion (which table, why, how many rows).
    eviction_rollups  per (run, minute, reason): eviction count and age / hit histograms, so the
               eviction charts read thousands of rows instead of millions.
    fleet_sources, fleet_events, fleet_blocks, fleet_evictions  what KV-event collectors saw of vLLM /
               SGLang servers (revision 0006; see "Fleet" below); fleet_metrics their /metrics scrapes,
               and fleet_sources' link state and heartbeat (revision 0007).
    runs also say who owns each run (host, pid) and its writer's heartbeat, so a later start can close a
               run whose owner died as interrupted, with its open requests (revision 0009).
    writer_progress  per writer process: the rows it has committed so far, updated in every one of its
               transactions, so a writer started after a crash knows exactly what its predecessor wrote
               (the fleet's rows too, revision 0008).
    tier_moves the disk KV tier's log (revision 0010): one row per block a DEMOTE, PROMOTE, TIER_EVICT or
               TIER_DROP event moved, denormalised for the tier's counts and a block key's moves; requests
               gain `disk_cached_tokens` (of `cached_tokens`, those promoted from the disk tier).

Invariants:
    * Times are float seconds since the epoch, so bucketing is plain arithmetic on every backend.
    * ``events.id`` and ``evictions.id`` grow with insertion; retention deletes the oldest ids first.
    * ``evictions.key_hex`` is lowercase hex; a key-prefix filter is a range scan on its index.
    * Strings are unbounded (VARCHAR without a length on PostgreSQL): an engine value that outgrew a
      length would otherwise fail its whole batch, or block a run row forever.
    * Every row but a run's belongs to a run (foreign key to ``runs.id``).
    * A run has ``stopped_at`` and ``end_reason`` both NULL (running, or its end not known yet) or both set;
      a request of an interrupted run is never ``waiting`` or ``running`` (they became ``interrupted``).
    * After every commit of a writer process, its ``writer_progress`` row counts exactly the event rows,
      request records and other producers' rows (the fleet's) it has committed (storage.write.progress).
    * ``requests.block_keys`` and ``content_keys`` are NULL or hold ``prompt_tokens // runs.block_size``
      keys of 16 bytes each, set together when the request finished.
    * ``tier_moves`` holds exactly one row per block named by each stored DEMOTE, TIER_EVICT and TIER_DROP
      event and per entry of each PROMOTE event's block lists, written in the transaction of that event's
      row (events stored before revision 0010 have none); ``key_hex`` is lowercase hex.
    * After every commit, each ``eviction_rollups`` row equals the aggregate of the ``evictions`` rows
      with its (run_id, minute = floor(time / 60), reason), and no rollup row has zero evictions.
"""

from __future__ import annotations

import enum
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Double, ForeignKey, Index, Integer, LargeBinary, String, Table
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only makes INTEGER PRIMARY KEY an alias of the rowid; other backends get a 64-bit key.
RowId = BigInteger().with_variant(Integer(), "sqlite")

ROLLUP_SECONDS = 60  # width of an eviction_rollups bucket
# Histogram bins of eviction_rollups, as upper edges: bin i holds values in [edge[i-1], edge[i]),
# the last bin everything from the last edge up. Changing them needs a migration that rebuilds.
AGE_EDGES_S = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0)  # seconds since filled
HIT_EDGES = (1, 2, 3, 5, 10, 20, 50, 100)  # prefix hits while cached: 0, 1, 2, 3-4, ..., 100+
AGE_BIN_COLUMNS = tuple(f"age_bin_{index}" for index in range(len(AGE_EDGES_S) + 1))
HIT_BIN_COLUMNS = tuple(f"hit_bin_{index}" for index in range(len(HIT_EDGES) + 1))


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One engine start and the settings that shape its cache."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String, primary_key=True)  # see writer.new_run_id
    model: Mapped[str] = mapped_column(String)  # preset name or model directory
    weights_revision: Mapped[str | None] = mapped_column(String)  # hash/revision of the weights
    namespace: Mapped[str | None] = mapped_column(String)  # cache namespace (hex)
    num_blocks: Mapped[int] = mapped_column(Integer)
    block_size: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String)
    device: Mapped[str] = mapped_column(String)
    started_at: Mapped[float] = mapped_column(Double, index=True)
    stopped_at: Mapped[float | None] = mapped_column(Double)  # None while running; interrupted: its last sign of life
    # Revision 0009 (None in older rows): who owns the run and how it ended (storage.write.run_liveness).
    host: Mapped[str | None] = mapped_column(String)  # host name of the owning process
    pid: Mapped[int | None] = mapped_column(Integer)  # its process id there
    heartbeat_at: Mapped[float | None] = mapped_column(Double)  # wall clock of its writer's last sign of life
    end_reason: Mapped[str | None] = mapped_column(String)  # RunEnd value; None while running


class RunEnd(enum.StrEnum):
    """How a run ended (`runs.end_reason`)."""

    STOPPED = "stopped"  # its writer stopped it: a new run of the same writer, or close
    INTERRUPTED = "interrupted"  # its owner died; a later start closed it (storage.write.run_liveness)


# The status a request of an interrupted run gets if it was still open: the engine never gives it.
INTERRUPTED_STATUS = "interrupted"
OPEN_STATUSES = ("waiting", "running")  # engine.core.request.RequestStatus values an interruption closes


class RequestRecord(Base):
    """What the engine recorded about one request (the last write wins)."""

    __tablename__ = "requests"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(String)  # set for forks
    status: Mapped[str] = mapped_column(String)  # RequestStatus value, or INTERRUPTED_STATUS
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_token_ids: Mapped[list[int]] = mapped_column(JSON)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    computed_tokens: Mapped[int] = mapped_column(Integer)
    hit_source: Mapped[str] = mapped_column(String)  # HitSource value
    cow_copies: Mapped[int] = mapped_column(Integer)
    preemptions: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String)
    arrival_time: Mapped[float] = mapped_column(Double)
    first_scheduled_time: Mapped[float | None] = mapped_column(Double)
    first_token_time: Mapped[float | None] = mapped_column(Double)
    finish_time: Mapped[float | None] = mapped_column(Double)
    # Sliding-window replay (revision 0002), named as in the REPLAY event's detail.
    h: Mapped[int | None] = mapped_column(Integer)
    s: Mapped[int | None] = mapped_column(Integer)
    e: Mapped[int | None] = mapped_column(Integer)
    r: Mapped[int | None] = mapped_column(Integer)
    replay_mode: Mapped[str | None] = mapped_column(String)
    replayed_tokens: Mapped[int | None] = mapped_column(Integer)
    # The prompt's full-block keys, 16 bytes each, concatenated, once it finished (revision 0004): the
    # chain keys the engine used, and the namespace-free content keys (engine/core/request.py's PromptKeys).
    block_keys: Mapped[bytes | None] = mapped_column(LargeBinary)
    content_keys: Mapped[bytes | None] = mapped_column(LargeBinary)
    # Of cached_tokens, those promoted from the disk tier (revision 0010; 0 in older rows): the rest came
    # from the pool's memory.
    disk_cached_tokens: Mapped[int] = mapped_column(Integer, server_default="0")

    __table_args__ = (
        Index("ix_requests_arrival_time", "arrival_time"),  # recent requests, retention
        Index("ix_requests_first_scheduled_time", "first_scheduled_time"),  # hit rate over time
    )


class EventRecord(Base):
    """One engine event as it left the engine."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    time: Mapped[float] = mapped_column(Double)
    kind: Mapped[str] = mapped_column(String)  # EventKind value
    request_id: Mapped[str | None] = mapped_column(String)
    block_id: Mapped[int | None] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(Integer)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)

    # Few indexes on purpose: every one costs the writer on each of many rows.
    __table_args__ = (
        Index("ix_events_time", "time"),  # retention, time ranges
        Index("ix_events_request", "request_id", "run_id"),  # request timelines
    )


class Eviction(Base):
    """One cached block losing its key: what it held, why, and its life before that."""

    __tablename__ = "evictions"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    time: Mapped[float] = mapped_column(Double)
    block_id: Mapped[int | None] = mapped_column(Integer)
    key_hex: Mapped[str | None] = mapped_column(String)
    start_pos: Mapped[int | None] = mapped_column(Integer)  # token positions [start_pos, end_pos)
    end_pos: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String)  # EvictReason value
    age_s: Mapped[float | None] = mapped_column(Double)  # seconds since the block was filled
    hit_count: Mapped[int | None] = mapped_column(Integer)  # prefix hits while cached
    last_used: Mapped[float | None] = mapped_column(Double)
    group: Mapped[str | None] = mapped_column(String)  # KV cache group (full / sliding layers)
    request_id: Mapped[str | None] = mapped_column(String)  # who needed the block

    __table_args__ = (
        Index("ix_evictions_time", "time"),
        Index("ix_evictions_reason_time", "reason", "time"),
        Index("ix_evictions_run_time", "run_id", "time"),
        Index("ix_evictions_key", "key_hex"),
        Index("ix_evictions_request", "request_id"),
    )


class TierMove(Base):
    """One block moved by the disk KV tier (revision 0010), from the engine's tier events
    (engine/core/events.py): demoted into the tier, promoted back into the pool, evicted from the tier, or
    dropped (an evicted block the tier did not take)."""

    __tablename__ = "tier_moves"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    time: Mapped[float] = mapped_column(Double)
    kind: Mapped[str] = mapped_column(String)  # EventKind value: demote, promote, tier_evict, tier_drop
    key_hex: Mapped[str | None] = mapped_column(String)  # the block's chain key
    block_id: Mapped[int | None] = mapped_column(Integer)  # the pool block: demote's source, promote's target, drop's
    request_id: Mapped[str | None] = mapped_column(String)  # promote: the request served; a corrupt eviction's
    slot: Mapped[int | None] = mapped_column(Integer)  # the tier slot (none for a drop)
    reason: Mapped[str | None] = mapped_column(String)  # TierReason value of a tier_evict or tier_drop
    tokens: Mapped[int] = mapped_column(Integer)  # the block's tokens

    __table_args__ = (
        Index("ix_tier_moves_time", "time"),  # retention
        Index("ix_tier_moves_run_kind", "run_id", "kind"),  # a run's counts
        Index("ix_tier_moves_key", "key_hex"),  # a block key's moves
    )


class Prune(Base):
    """One retention deletion (revision 0002)."""

    __tablename__ = "prunes"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    time: Mapped[float] = mapped_column(Double, index=True)
    table_name: Mapped[str] = mapped_column(String)
    rows_deleted: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String)  # "age" | "max_rows"


class EvictionRollup(Base):
    """Evictions of one run, minute and reason, counted and binned (revision 0003).

    Bins count only evictions whose age_s / hit_count is known, so a bin sum may be below `evictions`.
    """

    __table__ = Table(
        "eviction_rollups",
        Base.metadata,
        Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        Column("minute", BigInteger, primary_key=True),  # floor(time / ROLLUP_SECONDS)
        Column("reason", String, primary_key=True),
        Column("evictions", Integer, nullable=False),
        *(Column(name, Integer, nullable=False) for name in AGE_BIN_COLUMNS + HIT_BIN_COLUMNS),
        Index("ix_eviction_rollups_minute", "minute"),
    )


class WriterProgress(Base):
    """What one `WriterProcess` has committed so far, across the child processes it started (revision 0005)."""

    __tablename__ = "writer_progress"

    writer_id: Mapped[str] = mapped_column(String, primary_key=True)  # random, one per WriterProcess
    written_events: Mapped[int] = mapped_column(BigInteger)  # event rows committed
    written_requests: Mapped[int] = mapped_column(BigInteger)  # request records committed (coalesced ones too)
    # Other producers' rows committed (`submit_rows`, the fleet's; revision 0008: 0 in older rows).
    written_other: Mapped[int] = mapped_column(BigInteger, server_default="0")
    updated_at: Mapped[float] = mapped_column(Double, index=True)  # epoch seconds of the last commit; retention


# Core tables, for the writer's bulk statements, the queries, retention and rollups (one definition each).
RUNS = Run.__table__
REQUESTS = RequestRecord.__table__
EVENTS = EventRecord.__table__
EVICTIONS = Eviction.__table__
PRUNES = Prune.__table__
ROLLUPS = EvictionRollup.__table__
PROGRESS = WriterProgress.__table__
TIER_MOVES = TierMove.__table__

# The `runs` columns, in the order of the writer's row tuples (storage.write.writer._insert_runs).
RUN_COLUMNS = tuple(RUNS.c.keys())
# The `events` columns the writer fills, in the order of its row tuples (storage.write.rows.event_values).
EVENT_COLUMNS = ("run_id", "step", "time", "kind", "request_id", "block_id", "tokens", "detail")
# The eviction log as the pages and the CSV export show it; the writer fills every column but the id, in
# this order (storage.write.rows.eviction_values).
EVICTION_COLUMNS = (
    "id", "time", "run_id", "reason", "block_id", "key_hex", "start_pos", "end_pos",
    "age_s", "hit_count", "last_used", "group", "request_id",
)  # fmt: skip
EVICTION_ROW_COLUMNS = EVICTION_COLUMNS[1:]
# The tier log's columns the writer fills, in the order of its row tuples (storage.write.rows.tier_move_values).
TIER_MOVE_COLUMNS = ("run_id", "step", "time", "kind", "key_hex", "block_id", "request_id", "slot", "reason", "tokens")
# The primary key of `requests`: a request record is upserted by it.
REQUEST_KEY = ("run_id", "request_id")


# ---------------------------------------------------------------------------------------------- fleet
# What KV-event collectors (fleet/) saw of the servers they watch, written by storage.write.fleet_sink.
#
#   fleet_sources    one row per (collector, pod): a collector that starts watching a pod opens one.
#   fleet_events     every KV event as published (stored / removed / cleared), and every restart the
#                    collector detected (reset): one row per event, its hashes as a JSON array
#                    (consecutive removals of one batch share a row; see storage.write.fleet_rows).
#   fleet_blocks     what each source holds now: one row per hash held in a (medium, KV group), inserted
#                    by the store that made it held (copies 0 -> 1), deleted with its last copy, a clear
#                    or a reset. Bounded by the pods' caches; a closed source keeps its last state.
#   fleet_evictions  the eviction log: one row per physical copy a BlockRemoved took away (reason
#                    "removed", with the age of the hash's lifetime; unknown for a hash not held), and one
#                    per held hash a clear or a restart dropped (reason "cleared" / "reset"). A row with
#                    copies_left 0 ends a lifetime (stored -> last copy gone): age_s is its length.
#
# Invariants:
#   * Every fleet row belongs to a source (foreign key to fleet_sources.id); a collector writes only
#     rows of its own sources, so several consoles can share one PostgreSQL database.
#   * Hashes are stored as text (storage.write.fleet_rows.hash_text): an int hash in decimal, a bytes hash as
#     "0x" and its hex digits, so vLLM's unsigned 64-bit ints fit every backend.
#   * (source_id, n) numbers a source's lifetimes in the order they opened; a source holds at most one
#     fleet_blocks row per (medium, group_idx, block_hash), with copies >= 1.
#   * Times are publisher timestamps (`ts`, `stored_at`, `time`) or collector clocks (`received_at`,
#     `opened_at`, `closed_at`), float seconds since the epoch.


class FleetSource(Base):
    """One pod as one collector watched it (revision 0006).

    fleet_events, fleet_blocks and fleet_evictions name their source by `source_id` without a FOREIGN
    KEY: storage.write.fleet_bulk inserts a unit's sources first, in the transaction of its rows, and nothing
    deletes a source. On PostgreSQL the per-row check of a foreign key halved COPY's rows/s into
    fleet_evictions and cost a third on fleet_blocks (benchmarks/fleet.py's database path).
    """

    __tablename__ = "fleet_sources"

    id: Mapped[str] = mapped_column(String, primary_key=True)  # "<collector_id>/<pod>"
    collector_id: Mapped[str] = mapped_column(String, index=True)  # the watching process (see writer.new_run_id)
    pod: Mapped[str] = mapped_column(String)  # fleet.source.PodSource.name
    endpoint: Mapped[str] = mapped_column(String)  # the PUB socket watched
    replay_endpoint: Mapped[str | None] = mapped_column(String)  # its replay ROUTER, if any
    topic: Mapped[str] = mapped_column(String)  # "" accepts every topic
    metrics_url: Mapped[str | None] = mapped_column(String)  # its Prometheus endpoint, if any
    opened_at: Mapped[float] = mapped_column(Double)  # when the collector started watching it
    closed_at: Mapped[float | None] = mapped_column(Double)  # when it stopped; None while watching or after a crash
    # Revision 0007: the collector's latest PodStatus (None before its first, and in older rows).
    link: Mapped[str | None] = mapped_column(String)  # fleet.events.LinkState value
    status_at: Mapped[float | None] = mapped_column(Double)  # its time: the collector's heartbeat
    num_lost_batches: Mapped[int | None] = mapped_column(BigInteger)  # batches neither live nor replay delivered
    num_restarts: Mapped[int | None] = mapped_column(Integer)  # restarted servers detected

    __table_args__ = (Index("ix_fleet_sources_pod_opened", "pod", "opened_at"),)


class FleetEvent(Base):
    """One KV event of a pod, or a restart the collector detected (revision 0006)."""

    __tablename__ = "fleet_events"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    source_id: Mapped[str] = mapped_column(String)  # fleet_sources.id (no FOREIGN KEY: see FleetSource)
    seq: Mapped[int | None] = mapped_column(BigInteger)  # the batch's sequence number (reset: the one revealing it)
    ts: Mapped[float] = mapped_column(Double)  # the batch's publisher time (reset: collector time)
    received_at: Mapped[float] = mapped_column(Double)  # collector time the batch arrived
    origin: Mapped[str | None] = mapped_column(String)  # fleet.events.BatchOrigin value; None for a reset
    kind: Mapped[str] = mapped_column(String)  # storage.write.fleet_rows.FleetEventKind value
    medium: Mapped[str | None] = mapped_column(String)  # stored / removed: "GPU", "CPU", ...
    group_idx: Mapped[int | None] = mapped_column(Integer)  # stored / removed: the KV group
    num_blocks: Mapped[int] = mapped_column(Integer)  # hashes in the event (0 for cleared, reset)
    block_hashes: Mapped[list[str] | None] = mapped_column(JSON)  # hash texts, in event order
    parent_hash: Mapped[str | None] = mapped_column(String)  # stored: the parent of the first block
    block_size: Mapped[int | None] = mapped_column(Integer)  # stored: tokens per block

    __table_args__ = (Index("ix_fleet_events_source_ts", "source_id", "ts"),)  # per pod: rates, last heard, retention


class FleetBlock(Base):
    """One hash a source holds now in one (medium, KV group) (revision 0006). No secondary index on
    purpose: the held blocks of a source are a range of its primary key."""

    __tablename__ = "fleet_blocks"

    source_id: Mapped[str] = mapped_column(String, primary_key=True)  # fleet_sources.id (no FOREIGN KEY: see FleetSource)
    n: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # its lifetime's number in the source
    medium: Mapped[str] = mapped_column(String)
    group_idx: Mapped[int] = mapped_column(Integer)
    block_hash: Mapped[str] = mapped_column(String)  # hash text
    parent_hash: Mapped[str | None] = mapped_column(String)  # None at a prompt's start or when tokens are unknown
    block_size: Mapped[int] = mapped_column(Integer)
    token_ids: Mapped[list[int] | None] = mapped_column(JSON)  # None when the event's tokens did not split per block
    copies: Mapped[int] = mapped_column(Integer)  # physical blocks holding it (>= 1)
    stored_at: Mapped[float] = mapped_column(Double)  # publisher time of the store that made it held


class FleetEviction(Base):
    """One copy that left a pod's cache, and why (revision 0006)."""

    __tablename__ = "fleet_evictions"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    source_id: Mapped[str] = mapped_column(String)  # fleet_sources.id (no FOREIGN KEY: see FleetSource)
    time: Mapped[float] = mapped_column(Double)  # publisher time of the batch (reset: collector time)
    reason: Mapped[str] = mapped_column(String)  # storage.write.fleet_rows.RemovalReason value
    medium: Mapped[str] = mapped_column(String)
    group_idx: Mapped[int] = mapped_column(Integer)
    block_hash: Mapped[str] = mapped_column(String)  # hash text
    age_s: Mapped[float | None] = mapped_column(Double)  # time - the lifetime's stored_at; None if not held
    copies_left: Mapped[int | None] = mapped_column(Integer)  # copies held after it (0: the lifetime ended)

    __table_args__ = (Index("ix_fleet_evictions_source_time", "source_id", "time"),)


class FleetMetrics(Base):
    """One scrape of a pod's /metrics (revision 0007); None where the server exposes no such metric."""

    __tablename__ = "fleet_metrics"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    source_id: Mapped[str] = mapped_column(String)  # fleet_sources.id (no FOREIGN KEY: see FleetSource)
    at: Mapped[float] = mapped_column(Double)  # wall clock of the scrape
    prefix_cache_queries: Mapped[float | None] = mapped_column(Double)  # counter: tokens looked up
    prefix_cache_hits: Mapped[float | None] = mapped_column(Double)  # counter: of which cached
    num_preemptions: Mapped[float | None] = mapped_column(Double)  # counter: requests preempted
    kv_cache_usage: Mapped[float | None] = mapped_column(Double)  # gauge: fraction of KV blocks in use
    num_running: Mapped[float | None] = mapped_column(Double)  # gauge: requests running
    num_waiting: Mapped[float | None] = mapped_column(Double)  # gauge: requests waiting
    num_gpu_blocks: Mapped[int | None] = mapped_column(Integer)  # the pool's capacity in blocks
    error: Mapped[str | None] = mapped_column(String)  # why the scrape failed (then every value is None)

    __table_args__ = (Index("ix_fleet_metrics_source_at", "source_id", "at"),)


FLEET_SOURCES = FleetSource.__table__
FLEET_EVENTS = FleetEvent.__table__
FLEET_BLOCKS = FleetBlock.__table__
FLEET_EVICTIONS = FleetEviction.__table__
FLEET_METRICS = FleetMetrics.__table__

# The columns the fleet sink fills, in the order of its row tuples (storage.write.fleet_rows).
FLEET_SOURCE_COLUMNS = (
    "id", "collector_id", "pod", "endpoint", "replay_endpoint", "topic", "metrics_url", "opened_at", "closed_at",
)  # fmt: skip
FLEET_EVENT_COLUMNS = (
    "source_id", "seq", "ts", "received_at", "origin", "kind", "medium", "group_idx", "num_blocks",
    "block_hashes", "parent_hash", "block_size",
)  # fmt: skip
FLEET_BLOCK_COLUMNS = (
    "source_id", "n", "medium", "group_idx", "block_hash", "parent_hash", "block_size", "token_ids", "copies",
    "stored_at",
)  # fmt: skip
FLEET_SOURCE_STATUS_COLUMNS = ("link", "status_at", "num_lost_batches", "num_restarts")  # updated, not inserted
FLEET_METRICS_COLUMNS = (
    "source_id", "at", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_cache_usage",
    "num_running", "num_waiting", "num_gpu_blocks", "error",
)  # fmt: skip
FLEET_EVICTION_COLUMNS = (
    "source_id", "time", "reason", "medium", "group_idx", "block_hash", "age_s", "copies_left",
)  # fmt: skip
