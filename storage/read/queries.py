"""Every read function the console's pages, the CLI and the tools call, under one name: `queries.X`.

Plain functions returning DataFrames or small values. Each takes `db`, an Engine, Connection or Session
(storage.read.access), and builds its SQL from SQLAlchemy expressions only. Times are epoch seconds in
and out; buckets are `floor(time / bucket_seconds)`, computed per backend so results match on SQLite and
PostgreSQL. The functions live in one module per job; this module only gathers them:
    evictions        the eviction log, its counts, charts, histograms and CSV export
    runs             runs, interrupted runs, recent requests, a request's event timeline, retention's log,
                     prompt keys, the next run's first request number
    hit_rates        prefix-cache reuse over time
    block_timelines  blocks' reference-count timelines, the blocks requests held, fork families
    tier_history     the disk KV tier: a run's tier counts, a block key's moves, a request's promotions
"""

from storage.read.access import Readable
from storage.read.block_timelines import (
    MAX_FAMILY,
    MAX_TIMELINE_BLOCKS,
    BlockTimeline,
    block_timeline,
    block_timelines,
    fork_family,
    request_blocks,
)
from storage.read.evictions import (
    Cursor,
    EvictionFilters,
    EvictionPage,
    age_at_eviction_histogram,
    eviction_count,
    eviction_log,
    evictions_over_time,
    export_evictions_csv,
    hits_before_eviction_histogram,
)
from storage.read.hit_rates import hit_rate_over_time
from storage.read.runs import (
    has_run,
    interrupted_runs,
    latest_run_id,
    next_request_number,
    prompt_chains,
    prune_log,
    recent_requests,
    request_timeline,
    runs,
)
from storage.read.tier_history import TierCounts, key_moves, request_promotions, tier_counts
from storage.schema import EVICTION_COLUMNS  # the eviction log's columns, as its pages and its CSV show them

__all__ = [
    "EVICTION_COLUMNS", "MAX_FAMILY", "MAX_TIMELINE_BLOCKS", "BlockTimeline", "Cursor", "EvictionFilters",
    "EvictionPage", "Readable", "age_at_eviction_histogram", "block_timeline", "block_timelines", "eviction_count",
    "eviction_log", "evictions_over_time", "export_evictions_csv", "fork_family", "has_run", "hit_rate_over_time",
    "interrupted_runs",
    "hits_before_eviction_histogram", "latest_run_id", "next_request_number", "prompt_chains", "prune_log",
    "recent_requests", "request_blocks", "request_timeline", "runs", "TierCounts", "key_moves", "request_promotions",
    "tier_counts",
]  # fmt: skip
