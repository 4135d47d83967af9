"""The embedded engine publishes vLLM's KV-event feed: vLLM's own decoder reads it, the fleet collector
indexes it, and what it says equals the engine's pool and the history the engine's writer stored.

The engine is tiny-llama with random weights on the CPU (4-token blocks, a small pool so that requests
evict each other); the feed runs on loopback ports chosen by the operating system.
"""

from __future__ import annotations

import time
from collections import Counter

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from engine.core.config import EngineConfig
from engine.engine import Engine
from engine.core.events import EventKind
from engine.feeds.outbound import open_feeds, translator_for
from engine.feeds.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    GroupSpec,
    KVEventTranslator,
    external_hash,
)
from engine.core.request import SamplingParams
from fleet.collector import Collector, CollectorConfig
from fleet.index import FleetIndex
from fleet.metrics import scrape
from fleet.source import PodSource
from storage.write.recorder import record_engine
from storage.write.writer import EventWriter, WriterOptions
from tests.engine_support import tokens
from tests.fleet_support import wait_until
from tests.storage_support import FAST

GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)
COLLECTOR = CollectorConfig(replay_idle_timeout_s=1.0, poll_interval_s=0.02)
TOPIC = "kv-events"


def published_engine(tmp_path, **overrides) -> tuple[Engine, object]:
    fields = dict(
        model="tiny-llama",
        device="cpu",
        block_size=4,
        num_blocks=24,
        data_dir=tmp_path,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
        kv_events_topic=TOPIC,
    )
    engine = Engine(EngineConfig(**{**fields, **overrides}))
    return engine, open_feeds(engine)


def pool_hashes(engine: Engine) -> dict[tuple[str, int, int], int]:
    """What the engine's pools cache, in the index's shape: (medium, group index, published hash) -> 1."""
    index_of = {group.name: i for i, group in enumerate(engine.runner.groups)}
    return {
        ("CPU", index_of[view.group], external_hash(view.key)): 1
        for view in engine.snapshot().blocks
        if view.key is not None
    }


def workload(engine: Engine, after) -> None:
    """Shared prefixes, a fork, evictions (24 blocks), a partial reset, a full reset; `after(name)` between."""
    prefix = tokens(12, seed=1)
    a = engine.submit(prefix + [5, 6], GREEDY, retain=True)
    engine.run_until_idle()
    after("a cached")
    engine.submit(prefix + [7, 8, 9], GREEDY)  # hits a's three blocks
    engine.fork(a, [40, 41])
    engine.run_until_idle()
    engine.submit(prefix + [10, 11], GREEDY)  # hits them again: a reuse gap
    engine.run_until_idle()
    after("a hit twice and a fork")
    for seed in range(2, 6):  # 20-token prompts: the pool fills and evicts LRU-first
        engine.submit(tokens(20, seed), GREEDY)
    engine.run_until_idle()
    after("evictions")
    assert not engine.reset_cache().ok  # a is retained: its blocks stay cached
    after("partial reset")
    engine.release(a)
    assert engine.reset_cache().ok
    after("full reset")
    engine.submit(prefix + [5, 6], GREEDY)
    engine.run_until_idle()
    after("after the reset")


# ---------------------------------------------------------------- the wire format


def test_the_engines_batches_are_byte_for_byte_vllms() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is installed by requirements-interop.txt")
    ours = EventBatch(
        ts=1.5,
        events=[
            BlockStored([1, 2**64 - 1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU", None, group_idx=0,
                        kv_cache_spec_kind="full_attention"),
            BlockStored([3], 2, [9, 9, 9, 9], 4, None, "CPU", None, group_idx=1,
                        kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8),
            BlockRemoved([1], "CPU", 0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    theirs = kv_events.KVEventBatch(
        ts=1.5,
        events=[
            kv_events.BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                                  block_size=4, lora_id=None, medium="CPU", lora_name=None, group_idx=0,
                                  kv_cache_spec_kind="full_attention"),
            kv_events.BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[9, 9, 9, 9], block_size=4,
                                  lora_id=None, medium="CPU", lora_name=None, group_idx=1,
                                  kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8),
            kv_events.BlockRemoved(block_hashes=[1], medium="CPU", group_idx=0),
            kv_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    ours_bytes = msgspec.msgpack.encode(ours)
    assert ours_bytes == msgspec.msgpack.encode(theirs)
    assert msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(ours_bytes) == theirs


def test_a_cache_event_splits_where_a_block_hangs_from_a_twin() -> None:
    translator = KVEventTranslator([GroupSpec("full", None)], 2, "CPU")
    key = lambda n: f"{n:032x}"  # noqa: E731
    cache = {
        "keys": [key(1), key(2), key(4)],
        "parent_keys": [None, key(1), key(3)],  # block 3 was a twin's: 4 hangs from that twin
        "token_ids": [1, 1, 2, 2, 4, 4],
        "group": "full",
    }
    from engine.core.events import Event

    (first, second) = translator.translate([Event(EventKind.CACHE, 1, 0.0, "r", 0, 6, cache)])
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([1, 2], None, [1, 1, 2, 2])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == ([4], 3, [4, 4])


# ---------------------------------------------------------------- vLLM's decoder and the fleet collector


def test_vllms_decoder_and_the_fleet_index_see_exactly_the_engines_pool(tmp_path) -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is installed by requirements-interop.txt")
    engine, feeds = published_engine(tmp_path)
    publisher = feeds.publisher
    source = PodSource("engine", publisher.endpoint, publisher.replay_endpoint, topic=TOPIC)
    index = FleetIndex()
    context = zmq.Context()
    raw = context.socket(zmq.SUB)  # a consumer the way vLLM's subscriber example is written
    raw.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    raw.connect(publisher.endpoint)
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    vllm_view: Counter = Counter()
    kinds_seen: Counter = Counter()

    def read_raw() -> None:
        while raw.poll(0):
            _, _, payload = raw.recv_multipart()
            for event in decoder.decode(payload).events:
                kinds_seen[type(event).__name__] += 1
                if isinstance(event, kv_events.BlockStored):
                    for block_hash in event.block_hashes:
                        vllm_view[(event.medium, event.group_idx, block_hash)] += 1
                elif isinstance(event, kv_events.BlockRemoved):
                    for block_hash in event.block_hashes:
                        vllm_view[(event.medium, event.group_idx, block_hash)] -= 1
                else:
                    vllm_view.clear()
        for key in [key for key, copies in vllm_view.items() if copies == 0]:
            del vllm_view[key]

    try:
        with Collector([source], [index], COLLECTOR) as collector:
            wait_until(lambda: collector.stats()["engine"].num_connects == 1, "the collector to connect")
            time.sleep(0.3)  # both subscriptions reach the PUB socket

            def compare(step: str) -> None:
                published = publisher.stats().num_published
                wait_until(lambda: (index.pod("engine").last_seq or -1) >= published - 1, f"the index after {step}")
                wait_until(lambda: (read_raw(), dict(vllm_view) == pool_hashes(engine))[1], f"vLLM's view after {step}")
                assert index.copies("engine") == pool_hashes(engine), step
                index.check_invariants()

            workload(engine, compare)
            stats = collector.stats()["engine"]
    finally:
        feeds.close()
        raw.close(linger=0)
        context.term()
    assert stats.num_errors == 0 and stats.num_lost_batches == 0
    assert kinds_seen["AllBlocksCleared"] == 1, "only the reset that emptied the cache clears it"
    assert kinds_seen["BlockRemoved"] > 0 and index.pod("engine").num_unknown_removals == 0


def test_a_collector_that_joins_late_recovers_the_engines_cache_by_replay(tmp_path) -> None:
    engine, feeds = published_engine(tmp_path)
    try:
        workload(engine, lambda step: None)
        publisher = feeds.publisher
        index = FleetIndex()
        source = PodSource("engine", publisher.endpoint, publisher.replay_endpoint, topic=TOPIC)
        with Collector([source], [index], COLLECTOR) as collector:
            wait_until(lambda: collector.stats()["engine"].ready, "the start-up replay")
            wait_until(lambda: index.pod("engine").last_seq == publisher.stats().num_published - 1, "the replay")
            assert index.copies("engine") == pool_hashes(engine)
            assert collector.stats()["engine"].num_replayed_batches == publisher.stats().num_published
    finally:
        feeds.close()


def test_a_hybrid_models_groups_are_published_with_their_specs(tmp_path) -> None:
    engine, feeds = published_engine(tmp_path, attention_override="hybrid:8", num_blocks=40)
    translator = translator_for(engine)
    try:
        assert [(g.kind, g.sliding_window) for g in translator.groups] == [("full_attention", None), ("sliding_window", 8)]
        index = FleetIndex()
        publisher = feeds.publisher
        source = PodSource("engine", publisher.endpoint, publisher.replay_endpoint, topic=TOPIC)
        with Collector([source], [index], COLLECTOR) as collector:
            wait_until(lambda: collector.stats()["engine"].num_connects == 1, "the collector to connect")
            time.sleep(0.3)
            engine.submit(tokens(30, seed=3), GREEDY)
            engine.run_until_idle()
            wait_until(lambda: index.pod_names() and index.pod("engine").last_seq == publisher.stats().num_published - 1, "the index")
            assert index.copies("engine") == pool_hashes(engine)
            assert {group.group_idx for group in index.pod("engine").groups} == {0, 1}
    finally:
        feeds.close()


# ---------------------------------------------------------------- the feed equals the history


def test_the_feed_is_what_the_history_stores_translated(tmp_path) -> None:
    """The published events are a function of the engine events the history writer stored: translating
    the stored rows, in order, gives exactly the feed."""
    from sqlalchemy import select

    from storage.db import db_engine
    from storage.schema import EVENTS

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    engine, feeds = published_engine(tmp_path)
    writer = EventWriter(url, WriterOptions(**FAST))
    run_id = record_engine(engine, writer)
    context = zmq.Context()
    replay = context.socket(zmq.DEALER)  # REQ's envelope over a DEALER: a REQ socket keeps one reply only
    decoder = msgspec.msgpack.Decoder(EventBatch)
    published = []  # every published event, as plain msgpack values
    try:
        workload(engine, lambda step: None)
        assert writer.flush(20)
        replay.connect(feeds.publisher.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert replay.poll(5000), "the replay went silent"
            _, topic, seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            assert topic == TOPIC.encode()
            published.extend(msgspec.msgpack.decode(msgspec.msgpack.encode(decoder.decode(payload).events)))
    finally:
        replay.close(linger=0)
        context.term()
        feeds.close()
        writer.close(timeout_s=10)
    db = db_engine(url)
    with db.connect() as connection:
        rows = connection.execute(
            select(EVENTS.c.kind, EVENTS.c.step, EVENTS.c.time, EVENTS.c.request_id, EVENTS.c.block_id, EVENTS.c.tokens, EVENTS.c.detail)
            .where(EVENTS.c.run_id == run_id)
            .order_by(EVENTS.c.id)
        ).all()
    db.dispose()
    from engine.core.events import Event

    stored_events = [Event(EventKind(kind), *rest) for kind, *rest in rows]
    from_history = KVEventTranslator(translator_for(engine).groups, 4, "CPU").translate(stored_events)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(from_history)) == published
    assert len(published) > 10


# ---------------------------------------------------------------- replay requests and configuration


def test_a_malformed_replay_request_is_counted_and_ignored(tmp_path) -> None:
    engine, feeds = published_engine(tmp_path)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(feeds.publisher.replay_endpoint)
        dealer.send_multipart([b"", b"not eight bytes"])
        wait_until(lambda: feeds.publisher.stats().num_bad_requests == 1, "the request to be refused")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]  # nothing yet
    finally:
        dealer.close(linger=0)
        context.term()
        feeds.close()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"kv_events_endpoint": "http://127.0.0.1:5557"}, "kv_events_endpoint must be"),
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "needs kv_events_endpoint"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:0", "kv_events_topic": "t" * 300}, "at most 256 bytes"),
        ({"metrics_port": 70000}, "metrics_port must be in"),
    ],
)
def test_feed_settings_out_of_bounds_are_refused(fields, says) -> None:
    with pytest.raises(ValueError, match=says):
        EngineConfig(**fields)


def test_an_endpoint_in_use_is_a_clear_error_that_leaves_nothing_open(tmp_path) -> None:
    engine, feeds = published_engine(tmp_path)
    try:
        taken = feeds.publisher.endpoint
        other = Engine(EngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=8, data_dir=tmp_path,
                                    kv_events_endpoint=taken))  # fmt: skip
        with pytest.raises(zmq.ZMQError):
            open_feeds(other)
        assert other._listeners == []
    finally:
        feeds.close()


# ---------------------------------------------------------------- /metrics under vLLM's names


def test_metrics_under_vllms_names_scrape_like_a_vllm_server(tmp_path) -> None:
    engine, feeds = published_engine(tmp_path, metrics_port=0, kv_events_endpoint=None, kv_events_replay_endpoint=None)
    try:
        assert feeds.metrics.url.startswith("http://127.0.0.1:")
        evictions = []
        engine.add_listener(lambda events, views: evictions.extend(e for e in events if e.kind is EventKind.EVICT))
        workload(engine, lambda step: None)
        sample = scrape(feeds.metrics.url)
        stats = engine.stats()
        with __import__("urllib.request").request.urlopen(feeds.metrics.url) as response:
            text = response.read().decode()
    finally:
        feeds.close()
    assert sample.counters["vllm:prefix_cache_queries"] == stats.prefix_query_tokens > 0
    assert sample.counters["vllm:prefix_cache_hits"] == stats.prefix_hit_tokens > 0
    assert sample.counters["vllm:num_preemptions"] == stats.preemptions
    assert sample.gauges["vllm:kv_cache_usage_perc"] == pytest.approx(stats.kv_usage)
    lifetime = sample.histograms["vllm:kv_block_lifetime_seconds"]
    assert lifetime.count == len(evictions) > 0
    assert lifetime.sum == pytest.approx(sum(e.detail["age_s"] for e in evictions))
    assert sample.histograms["vllm:kv_block_idle_before_evict_seconds"].count == len(evictions)
    assert sample.histograms["vllm:kv_block_reuse_gap_seconds"].count > 0  # a's blocks were hit twice
    families = {family.name: family for family in text_string_to_metric_families(text)}
    labels = families["vllm:prefix_cache_queries"].samples[0].labels
    assert labels == {"model_name": engine.loaded.model_id, "engine": "0"}  # vLLM's label names
    assert "vllm:prefix_cache_queries_total" in text  # a counter, exposed as vLLM's are
    assert families["prefix_console:forward_threads"].samples[0].value == engine.forward_threads() >= 1
