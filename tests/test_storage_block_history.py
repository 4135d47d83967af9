"""The block-history queries on SQLite and PostgreSQL: a block's life read back from persisted events.

The events come from a real KV cache manager playing issue 15's exercise (a parent of one full and one
half-full block, two forks appending different tokens, the parent's release, then the children's),
written through the writers as the engine's listener writes them, and read back in a fresh connection,
as after a console restart.
"""

from __future__ import annotations

from engine.core.block_pool import BlockPool
from engine.core.events import EventLog
from engine.core.full_attention_manager import FullAttentionManager
from engine.core.namespace import CacheNamespace
from storage import migrate
from storage.read import queries
from storage.read.block_history import EVICTABLE_FROM_HERE, SAFE_TO_REUSE
from storage.write.writer import RunInfo
from tests.storage_support import BASE_TIME, RUN_INFO, request_view
from tests.manager_support import root_key


def exercise_events(group: str = "full"):
    """The exercise's engine events (block 0 full and shared, block 1 the half-full tail, 2 and 3 the copies)."""
    log = EventLog(clock=iter(BASE_TIME + i for i in range(1000)).__next__)
    m = FullAttentionManager(BlockPool(8, 4, log, group=group), CacheNamespace("m", "r", "float32", 4, ("full",)), log)
    m.allocate("p", [1, 2, 3, 4, 5, 6], root_key=root_key(m))
    m.cache_full_blocks("p")
    log.step = 1
    m.fork("p", "a")
    m.fork("p", "b")
    log.step = 2
    m.append("a", [7])
    m.append("b", [8])
    log.step = 3
    m.free("p")
    log.step = 4
    m.free("a")
    m.free("b")
    return log.take()


def write_exercise(db_url: str, make_writer) -> tuple[str, str]:
    """The exercise in one run, and a second run that reuses the same block ids for something else."""
    writer = make_writer(db_url)
    run = writer.start_run(RUN_INFO)
    writer.submit(exercise_events())
    writer.record_requests(
        [
            request_view("p", arrival_time=BASE_TIME, first_scheduled_time=BASE_TIME),
            request_view("a", parent_id="p", arrival_time=BASE_TIME + 1),
            request_view("b", parent_id="p", arrival_time=BASE_TIME + 2),
            request_view("a.1", parent_id="a", arrival_time=BASE_TIME + 3),
            request_view("x", arrival_time=BASE_TIME + 4),
        ]
    )
    other = writer.start_run(RunInfo(**{**vars(RUN_INFO), "started_at": BASE_TIME + 100}))
    log = EventLog()
    m = FullAttentionManager(BlockPool(8, 4, log), CacheNamespace("m", "r", "float32", 4, ("full",)), log)
    m.allocate("other", [1, 2, 3, 4, 5], root_key=root_key(m))
    writer.submit(log.take())
    assert writer.flush(timeout_s=20)
    return run, other


def test_a_blocks_life_reads_back_from_the_history_with_counts_holders_and_the_safe_to_reuse_mark(
    db_url: str, make_writer, engine_for
) -> None:
    run, other = write_exercise(db_url, make_writer)
    db = engine_for(db_url)  # a fresh connection pool: what a restarted console reads
    timelines = queries.block_timelines(db, run, [1, 0])
    tail = timelines[1].rows
    assert tail["ref_count"].tolist() == [1, 2, 3, 2, 1, 0]
    assert tail["event"].tolist() == ["allocate", "fork", "fork", "cow", "cow", "release"]
    assert [tuple(h) for h in tail["holders"]] == [("p",), ("p", "a"), ("p", "a", "b"), ("p", "b"), ("p",), ()]
    assert tail["marker"].tolist()[-1] == SAFE_TO_REUSE and tail["step"].tolist() == [0, 1, 1, 2, 2, 3]
    assert tail["change"].tolist()[3] == "copy-on-write: a moved to its copy, block 2 (2 slots copied)"
    assert timelines[1].complete
    full = timelines[0].rows
    assert full["ref_count"].tolist() == [1, 1, 2, 3, 2, 1, 0] and full["marker"].tolist()[-1] == EVICTABLE_FROM_HERE
    # The newest run reuses block 1 for a request of its own: nothing of the exercise leaks into it.
    newest = queries.block_timeline(db, 1)
    assert newest.run_id == other and newest.rows["request_id"].tolist() == ["other"]
    assert queries.block_timelines(db, run, [1], group="sliding")[1].rows.empty


def test_a_request_and_its_fork_family_find_their_blocks(db_url: str, make_writer, engine_for) -> None:
    run, _ = write_exercise(db_url, make_writer)
    db = engine_for(db_url)
    assert queries.fork_family(db, run, "b") == ["p", "a", "b", "a.1"]
    assert queries.fork_family(db, run, "x") == ["x"]
    assert queries.request_blocks(db, run, ["p"]) == [0, 1]
    assert queries.request_blocks(db, run, ["p", "a", "b"]) == [0, 1, 2, 3]
    copy = queries.block_timelines(db, run, [2], request_ids=["a"])[2].rows
    assert copy["ref_count"].tolist() == [1, 0] and copy["marker"].tolist() == ["", SAFE_TO_REUSE]


def test_timeline_queries_are_bounded(db_url: str, engine_for) -> None:
    db = engine_for(db_url)
    migrate.upgrade(db)
    try:
        queries.block_timelines(db, "run", range(queries.MAX_TIMELINE_BLOCKS + 1))
    except ValueError as exc:
        assert "at most" in str(exc)
    else:
        raise AssertionError("an unbounded timeline query was accepted")
    assert queries.latest_run_id(db) is None and queries.block_timeline(db, 0) is None
