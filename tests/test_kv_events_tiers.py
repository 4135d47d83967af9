"""The KV-event feed follows both tiers (issue 44): the pool's blocks under its medium ("CPU" here), the disk
tier's under "DISK", so a consumer that applies the feed per medium holds exactly what each tier holds.

The engine is a seeded random tiny-llama on the CPU with a 12-block pool (a 30-token prompt takes 8, so
the next prompt evicts most of the last one's) and a disk tier of TIER_SLOTS slots (so it evicts too).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import msgspec
import pytest

from engine.core.config import EngineConfig
from engine.core.events import Event, EventKind
from engine.core.request import SamplingParams
from engine.engine import Engine
from engine.feeds.kv_events import (
    MEDIUM_DISK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    GroupSpec,
    KVEventTranslator,
    external_hash,
)
from engine.feeds.outbound import open_feeds, translator_for
from fleet.collector import Collector, CollectorConfig
from fleet.decode import BatchDecoder
from fleet.events import BatchOrigin, PodBatch
from fleet.index import FleetIndex
from fleet.source import PodSource
from tests.engine_support import tokens
from tests.fleet_support import wait_until

BS = 4
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
COLLECTOR = CollectorConfig(replay_idle_timeout_s=1.0, poll_interval_s=0.02)
TIER_SLOTS = 24  # the five prompts below store about 40 blocks: the tier evicts


def tiered_engine(tmp_path, slots: int | None = None) -> Engine:
    """The engine, its tier 0.001 GiB or `slots` blocks."""
    fields = dict(model="tiny-llama", device="cpu", block_size=BS, num_blocks=12, data_dir=tmp_path)
    gib = 0.001
    if slots is not None:
        probe = Engine(EngineConfig(**fields, offload_dir=tmp_path / "probe", offload_gib=gib))
        gib = (slots + 0.5) * probe.kv.tier.slot_bytes / (1 << 30)
    return Engine(EngineConfig(**fields, offload_dir=tmp_path / "tier", offload_gib=gib))


class Feed:
    """The engine's events translated as the publisher does, then applied the way a consumer does: per
    (medium, group, hash) copies, through msgspec bytes into the fleet's index too."""

    def __init__(self, engine: Engine) -> None:
        self.translator = translator_for(engine)
        self.held: Counter = Counter()  # (medium, group_idx, hash) -> copies
        self.published: list = []  # every KV event, in order
        self.index = FleetIndex()
        self._decoder = BatchDecoder()
        engine.add_listener(lambda events, views: self.take(events))

    def take(self, events: list[Event]) -> None:
        kv_events = self.translator.translate(events)
        if not kv_events:
            return
        self.published.extend(kv_events)
        for event in kv_events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self.held[(event.medium, event.group_idx, block_hash)] += 1
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.held[(event.medium, event.group_idx, block_hash)] -= 1
                    assert self.held[(event.medium, event.group_idx, block_hash)] >= 0, "removed what was not held"
            else:
                self.held.clear()
        self.held = +self.held  # drop the zeros
        payload = msgspec.msgpack.encode(EventBatch(ts=1.0, events=kv_events, data_parallel_rank=0))
        seq = (self.index.pod("engine").last_seq + 1) if self.index.pod_names() else 0
        self.index.apply_batch(PodBatch("engine", seq, self._decoder.decode(payload), 1.0, BatchOrigin.LIVE))


def truth(engine: Engine) -> dict[tuple[str, int, int], int]:
    """What the engine's two tiers hold, in the consumer's shape: the pool's cached blocks under "CPU", the
    disk tier's ready blocks under "DISK" (full-attention group 0)."""
    index_of = {group.name: i for i, group in enumerate(engine.runner.groups)}
    held = {("CPU", index_of[v.group], external_hash(v.key)): 1 for v in engine.snapshot().blocks if v.key is not None}
    stats = engine.stats().tier
    assert stats.writing_blocks == 0, "compare once every store is confirmed"
    held.update({(MEDIUM_DISK, 0, external_hash(key.hex())): 1 for key in engine.kv.tier._lru})
    return held


def run(engine: Engine, prompt: list[int]):
    rid = engine.submit(prompt, GREEDY)
    engine.run_until_idle()
    return engine.get(rid)


def settle(engine: Engine, feed: Feed) -> None:
    """Every store written and confirmed. `Engine.stop` writes the pool's cached blocks back to the tier;
    their DEMOTE events reach listeners only with the next step's, so they are handed over here."""
    engine.stop()
    engine.kv.settle_tier()
    feed.take(engine.log.take())


def test_a_consumer_of_the_feed_holds_exactly_what_each_tier_holds(tmp_path) -> None:
    engine = tiered_engine(tmp_path, TIER_SLOTS)
    feed = Feed(engine)
    a = tokens(30, 1)
    run(engine, a)
    run(engine, tokens(30, 2))  # evicts most of a's blocks from the pool: demoted
    settle(engine, feed)
    assert feed.held == truth(engine)
    assert any(key[0] == MEDIUM_DISK for key in feed.held), "a's blocks went to disk"

    served = feed.index.route_tiers(a).matches[0].served  # what the feed says would serve a now
    again = run(engine, a)
    assert again.disk_cached_tokens > 0, "a's second run is served from disk"
    predicted = {serve.medium: serve.tokens for serve in served}
    assert {"memory": predicted.get("CPU", 0), "disk": predicted.get(MEDIUM_DISK, 0)} == again.cached_tokens_by_tier

    for seed in (3, 4, 5):  # the tier fills and gives blocks up, least recently used first
        run(engine, tokens(30, seed))
        settle(engine, feed)
        assert feed.held == truth(engine), seed
    stats = engine.stats().tier
    assert stats.loads > 0 and stats.evictions > 0 and stats.stores > TIER_SLOTS

    assert engine.reset_cache().ok  # the pool is emptied, the disk tier keeps its blocks
    assert feed.held == truth(engine) and {key[0] for key in feed.held} == {MEDIUM_DISK}
    assert not any(isinstance(event, AllBlocksCleared) for event in feed.published)
    assert feed.index.copies("engine") == truth(engine)
    feed.index.check_invariants()

    first_blocks = {tuple(tokens(30, seed)[:BS]) for seed in range(1, 6)}
    for event in feed.published:
        if isinstance(event, BlockStored) and event.medium == MEDIUM_DISK:
            assert (event.parent_block_hash is None) == (tuple(event.token_ids) in first_blocks), event


def test_the_tiers_events_decode_with_vllms_own_types(tmp_path) -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is installed by requirements-interop.txt")
    engine = tiered_engine(tmp_path)
    feed = Feed(engine)
    run(engine, tokens(30, 1))
    run(engine, tokens(30, 2))
    settle(engine, feed)
    run(engine, tokens(30, 1))
    ours = msgspec.msgpack.encode(EventBatch(ts=2.0, events=feed.published, data_parallel_rank=0))
    theirs = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(ours)
    assert msgspec.msgpack.encode(theirs) == ours
    disk = [event for event in theirs.events if isinstance(event, kv_events.BlockStored) and event.medium == "DISK"]
    assert disk and all(event.group_idx == 0 and event.kv_cache_spec_kind == "full_attention" for event in disk)
    assert {event.medium for event in theirs.events} == {"CPU", "DISK"}


def test_a_restarted_engines_feed_opens_with_its_warm_tier_and_routes_to_it(tmp_path) -> None:
    """Blocks found in the tier's files have no event: the feed's first batch announces them, and a later
    tier eviction of one is published (the feed follows them like demoted blocks). A restored entry does
    not say whether it starts a context, so the chain's first block names its root's hash: a route from
    the prompt's start reaches the warm tier once the first request has cached the chain's start again."""
    first = tiered_engine(tmp_path, TIER_SLOTS)
    a = tokens(30, 1)
    run(first, a)
    first.stop()  # the pool's cached blocks go to disk
    feed = dict(kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0")
    second = Engine(dataclasses.replace(first.config, **feed))
    feeds = open_feeds(second)
    publisher, index = feeds.publisher, FleetIndex()
    source = PodSource("engine", publisher.endpoint, publisher.replay_endpoint)
    try:
        with Collector([source], [index], COLLECTOR) as collector:
            wait_until(lambda: collector.stats()["engine"].ready, "the start-up replay")
            wait_until(lambda: index.pod_names() and index.pod("engine").last_seq == 0, "the warm tier's batch")
            assert index.copies("engine") == truth(second) != {}
            assert index.route_tiers(a).matches[0].served == ()
            again = run(second, a)
            assert again.disk_cached_tokens == 28, "the restarted engine serves a's prefix from disk"
            wait_until(lambda: index.pod("engine").last_seq == publisher.stats().num_published - 1, "a's batches")
            assert [(s.medium, s.tokens) for s in index.route_tiers(a).matches[0].served] == [("CPU", 28)]
            for seed in (2, 3, 4, 5):  # the restored blocks are given up in their turn
                run(second, tokens(30, seed))
            second.stop()
            second.kv.settle_tier()
            publisher.on_step(second.log.take(), [])  # the stop's write-back (see `settle`)
            assert second.stats().tier.evictions > 0
            published = publisher.stats().num_published
            wait_until(lambda: index.pod("engine").last_seq == published - 1, "every batch")
            assert index.copies("engine") == truth(second)
            assert index.pod("engine").num_unknown_removals == 0
    finally:
        feeds.close()


# ---------------------------------------------------------------- the translation, event by event


def event(kind: EventKind, **detail) -> Event:
    return Event(kind, 1, 0.0, None, 0, 0, detail)


def key(n: int) -> str:
    return f"{n:032x}"


def disk_translator() -> KVEventTranslator:
    return KVEventTranslator([GroupSpec("full", None), GroupSpec("sliding", 8)], 2, "CPU", disk_tier=True)


def demote(n: int, parent: int) -> Event:
    return event(EventKind.DEMOTE, key=key(n), parent_key=key(parent), slot=n, token_ids=[n, n])


def test_a_demoted_first_block_hangs_from_the_root_as_its_pool_copy_did() -> None:
    translator = disk_translator()
    cache = event(EventKind.CACHE, keys=[key(1), key(2)], parent_keys=[None, key(1)], token_ids=[1, 1, 2, 2],
                  group="full")  # fmt: skip
    translator.translate([cache])
    evict = [event(EventKind.EVICT, key=key(n), group="full") for n in (2, 1)]
    removed_2, removed_1, stored_1, stored_2 = translator.translate([*evict, demote(1, 99), demote(2, 1)])
    assert (removed_2.medium, removed_1.medium) == ("CPU", "CPU")
    assert (stored_1.block_hashes, stored_1.parent_block_hash, stored_1.medium) == ([1], None, "DISK")
    assert stored_1.group_idx == 0
    assert (stored_2.block_hashes, stored_2.parent_block_hash, stored_2.token_ids) == ([2], 1, [2, 2])


def test_a_tier_drop_removes_only_a_block_the_feed_announced() -> None:
    translator = disk_translator()
    translator.translate([demote(5, 4)])
    full = event(EventKind.TIER_DROP, key=key(6), reason="full")  # never demoted: nothing to take back
    writer = event(EventKind.TIER_DROP, key=key(5), reason="writer")  # demoted, then its write failed
    assert translator.translate([full]) == []
    assert translator.translate([writer]) == [BlockRemoved([5], "DISK", 0)]
    lru = event(EventKind.TIER_EVICT, key=key(5), slot=5, reason="lru")
    assert translator.translate([lru]) == [], "removed once only"


def test_a_reset_with_a_disk_tier_removes_the_pools_blocks_but_never_clears_all() -> None:
    reset = [event(EventKind.RESET, dropped_blocks=0, ok=True, kept_blocks=0)] * 2
    assert translator_without_tier().translate(reset) == [AllBlocksCleared()]
    assert disk_translator().translate(reset) == []


def translator_without_tier() -> KVEventTranslator:
    return KVEventTranslator([GroupSpec("full", None), GroupSpec("sliding", 8)], 2, "CPU")
