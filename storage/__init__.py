"""The history store: what the engine did, kept across restarts, for the console to query.

Imports no Streamlit and no torch, and from the engine only the types it persists (`engine.core.events`,
`engine.core.snapshot`, `engine.core.errors`; tests/test_layering.py checks it). Modules, one job each:
    db          `db_engine(url)`: the one engine factory (SQLite pragmas, PostgreSQL lock timeout),
                `default_db_url(data_dir)`, `open_session(engine)`, `encode_json`.
    schema      the schema at head (runs, requests, events, evictions, tier_moves, prunes, eviction_rollups,
                the fleet tables), its Core tables (EVENTS, EVICTIONS, ...) and the column orders of the
                writer's rows.
    migrate     `upgrade(url_or_engine, revision="head")`, `current_revision(...)` (Alembic, in code).
    buckets     `bucket_index`: floor(time / seconds) on every backend.
    write/      the history writer and what it writes:
        writer_process  `WriterProcess`: the history writer (the console's engine and fleet, the CLI):
                    checks and encodes on the caller's thread, sends each call through a multiprocessing
                    connection to its writer process, and counts exactly what was written, queued, dropped.
        writer_child    that process (`python -m storage.write.writer_child`): an EventWriter fed from the
                    connection, reporting which calls are done.
        writer      `EventWriter`: the database side, a thread that batches (the only batching layer),
                    retries, counts and prunes; in-process in tests and tools.
        writer_types    `HistoryWriter` (the contract both writers keep), RunInfo, WriterOptions,
                    WriterStats, new_run_id: what both sides share.
        handover    the ledger both writers keep of what was handed over: numbering, the bound, exact counts.
        pending_runs    run rows and stop times a writer has not committed yet (never dropped).
        batch       one batch's items and the transaction they become.
        progress    a writer process's committed totals, saved in its own transactions (exact counts after
                    a crash).
        rows        engine Events and RequestViews -> table rows (the only code that knows engine field
                    names); the writers' input checks.
        bulk        a batch's inserts and upserts, per dialect: bulk_sqlite (one statement over a JSON
                    array), bulk_postgres (COPY, ON CONFLICT), executemany elsewhere.
        rollups     per-minute eviction aggregates kept equal to the log.
        retention   `prune(engine, RetentionPolicy, now)`: age and row-count bounds, logged in `prunes`.
        recorder    `record_engine(engine, writer)`, `persistence_listener(writer)`: an engine's listener.
        fleet_sink, fleet_rows, fleet_bulk  the fleet collector's batches -> the fleet tables, through the
                    same writer.
    read/       what the pages, the CLI and the tools read:
        queries     every read function under one name (`queries.X`), gathered from:
        evictions   the eviction log: filtered pages, counts, counts over time, histograms, CSV export.
        runs        runs, recent requests, a request's event timeline, retention's log, prompt keys.
        hit_rates   prefix-cache reuse over time.
        block_timelines  blocks' reference-count timelines, the blocks requests held, fork families.
        block_history    a block's reference-count history replayed from its stored events (pure).
        tier_history     the disk KV tier: a run's tier counts, a block key's moves, a request's promotions,
                    a missed block's fate in the tier.
        why         what the miss diagnosis (analysis/why.py) reads.
        access      `Readable` (Engine, Connection or Session), `connect`, `frame`.
        fleet_queries    the fleet tables, for the Fleet pages and `cli fleet state`.

Writer side (never blocks on the database; nothing is lost without being counted):

    writer = WriterProcess(url)                     # a default url is default_db_url(data_dir):
                                                    #   $PREFIX_CONSOLE_DB_URL or <data_dir>/history.sqlite
    run_id = writer.start_run(RunInfo(model=..., num_blocks=..., block_size=..., dtype=..., device=...,
                                      weights_revision=..., namespace=..., started_at=...))
    writer.submit(events)                           # list[engine.core.events.Event]; one call <= 512 events is atomic
    writer.record_requests(views)                   # engine.core.snapshot.RequestViews; one upsert per request per
                                                    #   batch (latest wins). Anything else: TypeError at the call
    writer.submit_rows(rows, num_rows, write, wait=False)  # another producer's rows (the fleet sink's)
    writer.stats()                                  # WriterStats: queued, written_*, dropped, failed_batches,
                                                    #   retries, retrying, last_error, schema_ready, pruned_rows,
                                                    #   lag_s (oldest unwritten row's age), done_mark, restarts
    mark = writer.mark()                            # names every row handed over so far (read-your-writes)
    writer.wait(mark, timeout_s=None) -> bool       # hurry those rows, wait until written or dropped
    writer.flush(timeout_s=None) -> bool            # wait(mark()): everything queued so far (a batch otherwise
                                                    #   gathers rows for up to 0.5 s)
    writer.close(timeout_s=30.0) -> bool            # stop the run, drain, stop the writer process; a failing
                                                    #   batch is given up at the timeout, and counted

Faults (storage.write.writer, storage.write.writer_process): a locked, full, read-only or unreachable database is
retried for `WriterOptions.retry_for_s` (120 s) while rows wait in a bounded queue (`queue_items` calls), then
counted as dropped; a killed writer process is replaced and its uncommitted rows counted exactly; the engine
never waits.

Console side (`db` is an Engine, Connection or Session; times are epoch seconds):

    queries.eviction_log(db, EvictionFilters(...), page_size=50, after=None) -> EvictionPage(rows, next_cursor)
    queries.eviction_count(db, filters) -> int
    queries.evictions_over_time(db, bucket_seconds=60.0, filters) -> DataFrame[bucket_start, reason, evictions]
    queries.age_at_eviction_histogram(db, filters) -> DataFrame[bin_start, bin_end, evictions]
    queries.hits_before_eviction_histogram(db, filters) -> DataFrame[bin_start, bin_end, evictions]
    queries.request_timeline(db, request_id, run_id=None) -> DataFrame of that request's events, in order
    queries.hit_rate_over_time(db, bucket_seconds=60.0, run_id=None, since=None, until=None) -> DataFrame
                                                    #   prefix-cache hits and fork sharing per bucket, apart
    queries.block_timelines(db, run_id, block_ids, group="full", request_ids=None) -> {block: BlockTimeline}
    queries.block_timeline(db, block_id, run_id=None, group="full") -> BlockTimeline | None  (newest run)
    queries.request_blocks(db, run_id, request_ids, group) -> [block ids], queries.fork_family(db, run_id, rid)
    queries.latest_run_id(db), queries.has_run(db, run_id)
    queries.runs(db, limit=100), queries.recent_requests(db, run_id=None, limit=100), queries.prune_log(db)
    queries.prompt_chains(db, run_ids=(), limit=1_000_000) -> DataFrame of finished requests' prompt keys
    queries.export_evictions_csv(db, filters) -> str

EvictionFilters(since, until, reasons, request_id, run_id, key_prefix); the aggregates also take
`use_rollups=False` to scan the log instead of the per-minute rollups (same numbers, slower).
"""
