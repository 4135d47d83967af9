"""The disk KV tier in the history (issue 44): its moves and counts, each request's disk-served tokens, the
block-life timeline across the tiers, and `why` saying "served from disk" and "evicted from both tiers".

The engine tests run a seeded random tiny-llama on the CPU with a 12-block pool (a 30-token prompt takes 8,
so the next prompt evicts most of the last one's blocks) and a tier in tmp_path, recorded through the
history writer into SQLite, as the console records its engine. The writer tests run on both backends.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from sqlalchemy import JSON, func, insert, select
from sqlalchemy import column as sql_column
from sqlalchemy import table as sql_table

from cli.__main__ import main
from engine.core.config import EngineConfig
from engine.core.events import Event, EventKind
from engine.core.request import SamplingParams
from engine.engine import Engine
from storage import migrate
from storage.db import db_engine
from storage.read import queries
from storage.read.block_history import StoredEvent, replay
from storage.read.tier_history import key_moves, request_promotions, tier_counts, tier_fate
from storage.schema import REQUESTS, TIER_MOVES
from storage.write.recorder import record_engine
from storage.write.retention import RetentionPolicy, prune
from storage.write.writer import EventWriter
from storage.read.why import find_request
from tests.engine_support import tokens
from tests.test_app_support import console_env, host, open_page, wait_for  # noqa: F401
from tests.storage_support import BASE_TIME, RUN_INFO, request_view

BS = 4
SMALL_POOL = 12
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
TIER_GIB = 0.001  # hundreds of blocks: nothing leaves it in these tests


@dataclass
class Recorded:
    """An engine with a disk tier, recorded into a SQLite history; every event it published kept too."""

    engine: Engine
    url: str
    writer: EventWriter
    run_id: str
    events: list[Event]

    def run(self, prompt: list[int]) -> str:
        """Run one request to its end."""
        request_id = self.engine.submit(prompt, GREEDY)
        self.engine.run_until_idle()
        return request_id

    def settle(self) -> None:
        """Let the tier's writer finish (`Engine.stop`, which also copies the pool's cached blocks to disk),
        so the next step finds every store ready."""
        self.engine.stop()

    def db(self):
        assert self.writer.flush(timeout_s=30)
        return db_engine(self.url)

    def why(self, request_id: str, *extra: str) -> str:
        """`python -m cli why` for the request (text, or JSON with "--json")."""
        assert self.writer.flush(timeout_s=30)
        out = io.StringIO()
        with redirect_stdout(out):
            status = main(["why", "--db", self.url, "--request", request_id, "--run", self.run_id, *extra])
        assert status == 0
        return out.getvalue()


@pytest.fixture
def recorded(tmp_path: Path):
    made: list[Recorded] = []

    def make(tier_slots: int | None = None) -> Recorded:
        gib = TIER_GIB
        if tier_slots is not None:
            probe = Engine(_config(tmp_path / "probe", TIER_GIB))
            gib = tier_slots * probe.kv.tier.slot_bytes / (1 << 30)
        engine = Engine(_config(tmp_path, gib))
        url = f"sqlite:///{tmp_path / 'history.sqlite'}"
        writer = EventWriter(url)
        events: list[Event] = []
        run_id = record_engine(engine, writer)
        engine.add_listener(lambda published, views: events.extend(published))
        made.append(Recorded(engine, url, writer, run_id, events))
        return made[-1]

    yield make
    for one in made:
        one.writer.close()


def _config(directory: Path, gib: float) -> EngineConfig:
    return EngineConfig(model="tiny-llama", device="cpu", block_size=BS, num_blocks=SMALL_POOL, data_dir=directory,
                        offload_dir=directory / "tier", offload_gib=gib)  # fmt: skip


def first_prompt_again(h: Recorded) -> str:
    """A, then B (which evicts A's blocks into the tier), then A again (promoted from disk); A's last id."""
    h.run(tokens(30, 1))
    h.run(tokens(30, 2))
    h.settle()
    return h.run(tokens(30, 1))


# ---------------------------------------------------------------------------------------------- engine runs
def test_the_historys_counts_by_tier_equal_the_engines_tier_counters(recorded) -> None:
    h = recorded()
    first_prompt_again(h)
    stats = h.engine.stats().tier
    counts = tier_counts(h.db(), h.run_id)
    assert stats.loads > 0 and stats.stores > 0, "the scenario must store and promote blocks"
    assert counts.promotions == stats.loads and counts.promoted_tokens == stats.hit_tokens
    assert counts.stores == stats.stores + stats.writing_blocks
    assert sum(counts.drops.values()) == stats.drops
    assert counts.evictions.get("lru", 0) == stats.evictions and counts.evictions.get("corrupt", 0) == stats.corrupt


def test_a_stopping_engine_publishes_the_demotions_of_its_write_back(recorded) -> None:
    """`stop()` copies the pool's cached blocks to disk: their DEMOTE events reach the listeners (the history,
    the KV-event feed) at once, not with a next step a stopped engine may never take."""
    h = recorded()
    h.run(tokens(30, 1))  # fits the pool: nothing evicted, nothing stored yet
    assert not [e for e in h.events if e.kind is EventKind.DEMOTE]
    h.engine.stop()
    stats = h.engine.stats().tier
    demoted = [e for e in h.events if e.kind is EventKind.DEMOTE]
    assert demoted and len(demoted) == stats.stores + stats.writing_blocks


def test_a_request_served_partly_from_disk_has_its_disk_tokens_in_its_row(recorded) -> None:
    h = recorded()
    again = first_prompt_again(h)
    view = h.engine.get(again)
    assert 0 < view.disk_cached_tokens <= view.cached_tokens
    with h.db().connect() as connection:
        row = connection.execute(
            select(REQUESTS.c.cached_tokens, REQUESTS.c.disk_cached_tokens)
            .where(REQUESTS.c.run_id == h.run_id, REQUESTS.c.request_id == again)
        ).one()
    assert tuple(row) == (view.cached_tokens, view.disk_cached_tokens)
    assert len(request_promotions(h.db(), h.run_id, again)) * BS == view.disk_cached_tokens


def test_why_says_served_from_disk_with_the_promoted_blocks_and_tokens(recorded) -> None:
    h = recorded()
    again = first_prompt_again(h)
    view = h.engine.get(again)
    answer = json.loads(h.why(again, "--json"))
    disk = answer["disk"]
    assert disk["tokens"] == view.disk_cached_tokens
    assert disk["memory_tokens"] == view.cached_tokens - view.disk_cached_tokens
    assert disk["end"] - disk["start"] == view.disk_cached_tokens and disk["end"] <= view.cached_tokens
    assert disk["blocks"] == [p.block for p in request_promotions(h.db(), h.run_id, again)]
    assert "served from disk: " in h.why(again)


def test_a_block_pushed_out_of_a_tiny_tier_is_evicted_from_both_tiers(recorded) -> None:
    h = recorded(tier_slots=2)
    first = h.run(tokens(30, 1))
    for seed in (2, 3, 4):  # each evicts about a prompt's worth of blocks into the 2-slot tier
        h.run(tokens(30, seed))
    h.settle()
    again = h.run(tokens(30, 1))
    assert h.engine.get(again).cached_tokens == 0  # every store done: a block the tier held would be promoted
    answer = json.loads(h.why(again, "--json"))
    assert answer["cause"] == "both_tiers" and answer["analyzer_reason"] == "capacity"
    assert answer["match"]["request_id"] == first
    tier = answer["tier"]
    assert tier["lost"] and tier["kind"] in ("tier_evict", "tier_drop")
    assert tier["pool_evicted_at"] == answer["eviction"]["at"] <= tier["at"]
    moves = key_moves(h.db(), h.run_id, [answer["eviction"]["key"]])
    assert tier["kind"] in moves["kind"].tolist()
    assert "evicted from both tiers: from the pool at " in h.why(again)
    summary = json.loads(_cli(["why", "--db", h.url, "--run", h.run_id, "--summary", "--json"]))
    assert summary["by_cause"]["both_tiers"]["requests"] >= 1


def test_a_pool_eviction_without_a_tier_keeps_its_wording(tmp_path: Path) -> None:
    engine = Engine(EngineConfig(model="tiny-llama", device="cpu", block_size=BS, num_blocks=SMALL_POOL,
                                 data_dir=tmp_path))  # fmt: skip
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = EventWriter(url)
    try:
        run_id = record_engine(engine, writer)
        for seed in (1, 2, 3, 1):
            rid = engine.submit(tokens(30, seed), GREEDY)
            engine.run_until_idle()
        assert writer.flush(timeout_s=30)
    finally:
        writer.close()
    answer = json.loads(_cli(["why", "--db", url, "--request", rid, "--run", run_id, "--json"]))
    assert answer["cause"] == "evicted" and answer["tier"] is None and answer["disk"] is None
    assert "both tiers" not in _cli(["why", "--db", url, "--request", rid, "--run", run_id])


def test_the_block_timeline_shows_demoted_to_disk_and_promoted_from_disk(recorded) -> None:
    h = recorded()
    again = first_prompt_again(h)
    db = h.db()
    promoted = request_promotions(db, h.run_id, again)[0]
    rows = queries.block_timelines(db, h.run_id, [promoted.block])[promoted.block].rows
    promote_rows = rows[rows["event"] == "promote"]
    assert len(promote_rows) == 1 and f"promoted from disk for {again}" in promote_rows["change"].iloc[0]
    assert promote_rows["ref_count"].iloc[0] == 1  # the allocation it names: a promotion adds no reference
    demoted = key_moves(db, h.run_id, [promoted.key_hex])
    first_demote = demoted[demoted["kind"] == "demote"].iloc[0]
    life = queries.block_timelines(db, h.run_id, [int(first_demote["block_id"])])[int(first_demote["block_id"])].rows
    ended = life[life["event"] == "demote"]
    assert any(change.startswith("evicted (") and "demoted to disk at step" in change for change in ended["change"])
    assert (ended["ref_count"] == 0).all()


def test_tier_events_do_not_change_the_replayed_reference_counts(recorded) -> None:
    h = recorded()
    first_prompt_again(h)
    stored = [
        StoredEvent(i, e.step, e.time, e.kind.value, e.request_id, e.block_id, orjson.loads(orjson.dumps(e.detail)))
        for i, e in enumerate(h.events)
    ]
    assert {e.kind for e in stored} >= {"demote", "promote"}
    pool = h.engine.kv.full.pool
    full = [e for e in stored if e.detail.get("group", "full") == "full"]
    lives = replay(full, range(pool.num_blocks))
    for block in pool.blocks:
        life = lives[block.block_id]
        assert life.complete
        assert (life.rows[-1].ref_count if life.rows else 0) == block.ref_count
        assert (life.rows[-1].state if life.rows else "free") == pool.state_of(block)


def console_with_tier(configure, directory: Path, monkeypatch, gib: float) -> Engine:
    """The console's embedded engine with a 12-block pool and a disk tier of `gib` GiB in `directory`."""
    configure(num_blocks=SMALL_POOL, block_size=BS)
    monkeypatch.setenv("PREFIX_CONSOLE_OFFLOAD_DIR", str(directory))
    monkeypatch.setenv("PREFIX_CONSOLE_OFFLOAD_GIB", str(gib))
    return host().console.engine


def explained_on_the_page(engine: Engine, seeds: tuple[int, ...]):
    """Run a 30-token prompt per seed, let the tier's writer finish, run the first one again and open the Why
    page on it; returns the page and the request's view."""

    def run(seed: int) -> str:
        rid = engine.submit(tokens(30, seed), GREEDY)
        wait_for(lambda: engine.get(rid).status == "finished", f"request {rid}")
        return rid

    for seed in seeds:
        run(seed)
    engine.stop()  # waits for the tier's writer, so the next lookup finds every store; then steps go on
    engine.start()
    rid = run(seeds[0])
    host().writer.flush(timeout_s=30)
    wait_for(lambda: find_request(host().db, rid) is not None, f"{rid} in the history")
    at = open_page("why")
    at.text_input(key="why_typed").set_value(rid).run()
    assert not at.exception
    return at, engine.get(rid)


def test_the_why_page_says_served_from_disk(console_env, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    engine = console_with_tier(console_env, tmp_path / "tier", monkeypatch, TIER_GIB)
    at, view = explained_on_the_page(engine, (1, 2))  # B evicts A's blocks into the tier
    assert view.disk_cached_tokens > 0, "the page test's premise: A's second run reads from disk"
    assert any(f"Served from disk: {view.disk_cached_tokens} tokens" in md.value for md in at.markdown)


def test_the_why_page_says_evicted_from_both_tiers(console_env, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    slot_bytes = console_with_tier(console_env, tmp_path / "probe", monkeypatch, TIER_GIB).kv.tier.slot_bytes
    engine = console_with_tier(console_env, tmp_path / "tier", monkeypatch, 2 * slot_bytes / (1 << 30))
    at, view = explained_on_the_page(engine, (1, 2, 3, 4))
    assert view.cached_tokens == 0 and at.metric[0].value == "both_tiers"
    assert any("Evicted from both tiers" in info.value for info in at.info)
    assert any("evicted from both tiers: from the pool at " in md.value for md in at.markdown)


def _cli(args: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(args) == 0
    return out.getvalue()


# ------------------------------------------------------------------------------------ the writer, both backends
def tier_events(t: float) -> list[Event]:
    """A block's trip through the tier: demoted from pool block 3, promoted into block 5 for req-1, demoted
    again, evicted from the tier (lru); and another block dropped because the tier was full."""
    return [
        Event(EventKind.DEMOTE, 1, t, None, 3, 16, {"key": "AA" * 16, "parent_key": "00" * 16, "slot": 0,
                                                     "token_ids": list(range(16))}),
        Event(EventKind.PROMOTE, 2, t + 1, "req-1", 5, 32, {"block_ids": [5, 6], "keys": ["aa" * 16, "bb" * 16],
                                                             "slots": [0, 1]}),
        Event(EventKind.TIER_EVICT, 3, t + 2, None, None, 16, {"key": "aa" * 16, "slot": 0, "reason": "lru"}),
        Event(EventKind.TIER_DROP, 3, t + 2, None, 7, 0, {"key": "cc" * 16, "reason": "full"}),
    ]  # fmt: skip


def test_the_writers_store_one_tier_move_per_block_moved(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    run = writer.start_run(RUN_INFO)
    writer.submit(tier_events(BASE_TIME))
    view = request_view("req-1", prompt_token_ids=range(40), cached_tokens=36, disk_cached_tokens=32, replay_from=36,
                        first_scheduled_time=BASE_TIME)  # fmt: skip
    writer.record_requests([view])
    assert writer.flush(timeout_s=20)
    db = engine_for(db_url)
    counts = tier_counts(db, run)
    assert (counts.demotions, counts.promotions, counts.promoted_tokens) == (1, 2, 32)
    assert counts.evictions == {"lru": 1} and counts.drops == {"full": 1}
    moves = key_moves(db, run, ["AA" * 16])
    assert moves["kind"].tolist() == ["demote", "promote", "tier_evict"]
    assert moves["move"].tolist() == [
        "demoted to disk at step 1 from pool block 3 (tier slot 0)",
        "promoted from disk at step 2 into pool block 5 for req-1 (tier slot 0)",
        "evicted from disk at step 3 (lru)",
    ]
    assert [tuple(p[:3]) for p in request_promotions(db, run, "req-1")] == [(5, "aa" * 16, 0), (6, "bb" * 16, 1)]
    with db.connect() as connection:
        assert connection.scalar(select(REQUESTS.c.disk_cached_tokens).where(REQUESTS.c.run_id == run)) == 32
    rate = queries.hit_rate_over_time(db, 60.0, run_id=run)
    assert rate["prefix_hit_tokens"].tolist() == [36] and rate["disk_hit_tokens"].tolist() == [32]


def test_a_tier_fate_says_lost_still_held_or_nothing(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    run = writer.start_run(RUN_INFO)
    writer.submit(tier_events(BASE_TIME))
    assert writer.flush(timeout_s=20)
    db = engine_for(db_url)
    lost = tier_fate(db, run, "aa" * 16, BASE_TIME, BASE_TIME + 10)
    assert lost is not None and lost.lost and (lost.demoted_step, lost.slot) == (1, 0)
    assert (lost.gone_kind, lost.gone_step, lost.gone_reason) == ("tier_evict", 3, "lru")
    held = tier_fate(db, run, "aa" * 16, BASE_TIME, BASE_TIME + 1.5)
    assert held is not None and not held.lost and held.demoted_step == 1
    dropped = tier_fate(db, run, "cc" * 16, BASE_TIME, BASE_TIME + 10)
    assert dropped is not None and dropped.lost and dropped.demoted_at is None and dropped.gone_reason == "full"
    assert tier_fate(db, run, "dd" * 16, BASE_TIME, BASE_TIME + 10) is None


def test_revision_0010_gives_older_requests_zero_disk_tokens(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine, "0009")
    runs = sql_table("runs", *map(sql_column, ("id", "model", "num_blocks", "block_size", "dtype", "device",
                                                "started_at")))  # fmt: skip
    names = ("run_id", "request_id", "status", "prompt_tokens", "cached_tokens", "computed_tokens", "hit_source",
             "cow_copies", "preemptions", "arrival_time")  # fmt: skip
    requests = sql_table("requests", *map(sql_column, names), sql_column("output_token_ids", JSON))
    with engine.begin() as connection:
        connection.execute(insert(runs).values(id="r", model="m", num_blocks=8, block_size=4, dtype="float32",
                                               device="cpu", started_at=BASE_TIME))  # fmt: skip
        connection.execute(insert(requests).values(run_id="r", request_id="a", status="finished", prompt_tokens=9,
                                                   cached_tokens=4, computed_tokens=5, hit_source="prefix",
                                                   cow_copies=0, preemptions=0, arrival_time=BASE_TIME,
                                                   output_token_ids=[]))  # fmt: skip
    migrate.upgrade(engine)
    with engine.connect() as connection:
        assert connection.scalar(select(REQUESTS.c.disk_cached_tokens)) == 0
        assert connection.scalar(select(TIER_MOVES.c.id)) is None


def test_block_timelines_read_the_tier_moves_back_on_both_backends(db_url: str, make_writer, engine_for) -> None:
    """Pool block 3's life ends demoted to disk (its DEMOTE comes after the block's next ALLOCATE, as the
    engine plans stores at the end of the step); block 5's begins promoted from disk."""
    full = {"group": "full"}
    t = BASE_TIME
    events = [
        Event(EventKind.ALLOCATE, 1, t, "req-0", 3, 4, {"block_ids": [3], **full}),
        Event(EventKind.CACHE, 1, t, "req-0", 3, 4, {"block_ids": [3], "keys": ["aa" * 16], **full}),
        Event(EventKind.RELEASE, 2, t + 1, "req-0", 3, 0, {"block_ids": [3], "freed": 1, **full}),
        Event(EventKind.EVICT, 3, t + 2, "req-1", 3, 4, {"reason": "lru", "key": "aa" * 16, **full}),
        Event(EventKind.ALLOCATE, 3, t + 2, "req-1", 3, 4, {"block_ids": [3, 5], **full}),
        Event(EventKind.PROMOTE, 3, t + 2, "req-1", 5, 4, {"block_ids": [5], "keys": ["bb" * 16], "slots": [1]}),
        Event(EventKind.DEMOTE, 3, t + 2, None, 3, 4, {"key": "aa" * 16, "parent_key": "00" * 16, "slot": 0,
                                                       "token_ids": [1, 2, 3, 4]}),
    ]  # fmt: skip
    writer = make_writer(db_url)
    run = writer.start_run(RUN_INFO)
    writer.submit(events)
    assert writer.flush(timeout_s=20)
    timelines = queries.block_timelines(engine_for(db_url), run, [3, 5])
    three, five = timelines[3].rows, timelines[5].rows
    assert three["event"].tolist() == ["allocate", "cache", "release", "demote", "allocate"]
    assert three["change"].iloc[3] == "evicted (lru): demoted to disk at step 3 (tier slot 0)"
    assert three["ref_count"].tolist() == [1, 1, 0, 0, 1]
    assert five["event"].tolist() == ["promote"] and five["ref_count"].tolist() == [1]
    assert five["change"].iloc[0] == "allocated to req-1: promoted from disk for req-1 (tier slot 1)"
    assert queries.block_timelines(engine_for(db_url), run, [3], group="sliding")[3].rows.empty


def test_a_tier_drop_names_its_eviction_and_a_write_back_is_a_row_of_its_own() -> None:
    """Block 7's eviction was not stored (the tier was full); block 2, still cached when an engine stopped,
    was copied to disk without leaving the pool."""
    full = {"group": "full"}
    events = [
        StoredEvent(1, 1, 1.0, "allocate", "a", 7, {"block_ids": [7, 2], **full}),
        StoredEvent(2, 1, 1.0, "cache", "a", 7, {"block_ids": [7, 2], "keys": ["77", "22"], **full}),
        StoredEvent(3, 2, 2.0, "release", "a", 7, {"block_ids": [2, 7], **full}),
        StoredEvent(4, 3, 3.0, "evict", "b", 7, {"reason": "lru", "key": "77", **full}),
        StoredEvent(5, 3, 3.0, "tier_drop", None, 7, {"key": "77", "reason": "full"}),
        StoredEvent(6, 4, 4.0, "demote", None, 2, {"key": "22", "slot": 0}),
    ]
    lives = replay(events, [7, 2])
    seven, two = lives[7].rows, lives[2].rows
    assert [row.event for row in seven] == ["allocate", "cache", "release", "tier_drop"]
    assert seven[-1].change == "evicted (lru): left the prefix index, not stored on disk (full)"
    assert [row.event for row in two] == ["allocate", "cache", "release", "demote"]
    assert two[-1].change == "copied to disk (tier slot 0): still cached in the pool"
    assert (two[-1].ref_count, two[-1].state, seven[-1].state) == (0, "evictable", "free")


def test_retention_keeps_the_newest_tier_moves_only(db_url: str, make_writer, engine_for) -> None:
    """`tier_moves` grows with every block a tier moves: retention bounds it like the eviction log."""
    writer = make_writer(db_url)
    writer.start_run(RUN_INFO)
    for trip in range(5):
        writer.submit(tier_events(BASE_TIME + 10 * trip))
    assert writer.flush(timeout_s=20)
    db = engine_for(db_url)
    with db.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(TIER_MOVES)) > 4
    prune(db, RetentionPolicy(max_age_days=None, max_events=None, max_evictions=None, max_tier_moves=4),
          now=BASE_TIME + 100)  # fmt: skip
    with db.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(TIER_MOVES)) == 4
        assert connection.scalar(select(func.min(TIER_MOVES.c.time))) >= BASE_TIME + 40
