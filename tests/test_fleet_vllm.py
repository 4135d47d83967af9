"""Interop with vLLM's own code: its KVCacheManager's events, published by its ZmqEventPublisher.

Each test drives vLLM 0.33's real `KVCacheManager` (prefix caching and KV events on) and checks that
the collector's index holds exactly the hashes vLLM's block pool caches, with the same number of
physical copies, after every published batch. SGLang's publisher is tested the same way at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from fleet.collector import Collector
from fleet.config import CollectorConfig
from fleet.index import FleetIndex
from fleet.source import PodSource
from tests.fleet_support import TOPIC, StallingSink, VllmPod, wait_port_free, wait_until
from tests.ports import free_port

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")

FAST = CollectorConfig(replay_idle_timeout_s=1.0, poll_interval_s=0.02)


@pytest.fixture
def vllm_pod():
    pod = VllmPod()
    yield pod
    pod.close()


def caught_up(index: FleetIndex, pod: VllmPod) -> Callable[[], bool]:
    """Whether the index has applied everything `pod` published."""

    def done() -> bool:
        return pod.name in index.pod_names() and index.pod(pod.name).last_seq == pod.num_published - 1

    return done


def run_scenario(pod: VllmPod, after_step: Callable[[str], None]) -> dict[str, dict]:
    """Allocate, share a prefix, duplicate blocks, decode, free, evict, reset; `after_step` after each.

    Returns:
        vLLM's cached hashes after each step, by step name.
    """
    seen: dict[str, dict] = {}

    def step(name: str) -> None:
        pod.publish()
        seen[name] = pod.cached()
        after_step(name)

    prompt_a = list(range(14))  # 3 full blocks and 2 tokens
    a = pod.request(prompt_a)
    pod.allocate(a)
    step("allocate a")

    b = pod.request(prompt_a[:12] + [90, 91, 92, 93, 94])  # hits a's 3 blocks, caches 1 more
    lookup = pod.lookup(b)
    assert lookup[1] == 12, "vLLM should hit a's three blocks"
    pod.allocate(b, lookup)
    step("prefix hit b")

    prompt_c = list(range(200, 209))  # 2 full blocks, computed twice at once: vLLM does not de-duplicate
    c, d = pod.request(prompt_c), pod.request(prompt_c)
    lookup_c, lookup_d = pod.lookup(c), pod.lookup(d)
    pod.allocate(c, lookup_c)
    pod.allocate(d, lookup_d)
    step("duplicates c d")
    assert sorted(seen["duplicates c d"].values()).count(2) == 2, "both of c's blocks have two copies"

    pod.decode(a, [14, 15])  # fills a's fourth block
    step("decode a")

    for request in (a, b, c, d):
        pod.free(request)
    assert pod.publish() == 0, "freeing sends nothing"
    seen["free all"] = pod.cached()
    after_step("free all")

    e = pod.request(list(range(1000, 1046)))  # 11 full blocks: evicts cached blocks, LRU first
    pod.allocate(e)
    step("evict for e")

    pod.free(e)
    assert pod.reset(), "vLLM resets a cache with no blocks in use"
    step("reset")

    f = pod.request(prompt_a)
    pod.allocate(f)
    step("after reset")
    return seen


def test_the_index_equals_vllms_block_pool_after_every_batch(vllm_pod):
    index = FleetIndex()
    with Collector([vllm_pod.source()], [index], FAST) as collector:
        wait_until(lambda: collector.stats()[vllm_pod.name].num_connects == 1, "the SUB socket to connect")
        time.sleep(0.2)  # a PUB socket drops what it sends before the subscription reaches it

        def compare(step: str) -> None:
            wait_until(caught_up(index, vllm_pod), f"the index to apply {step!r}")
            assert index.copies(vllm_pod.name) == vllm_pod.cached(), step
            index.check_invariants()

        seen = run_scenario(vllm_pod, compare)
        stats = collector.stats()[vllm_pod.name]
    before, after = seen["free all"], seen["evict for e"]
    assert any(before[key] == 2 and after.get(key) == 1 for key in before), (
        "the eviction took one of two copies of a hash, and the index still holds it"
    )
    assert seen["reset"] == {}
    assert stats.num_lost_batches == 0 and stats.num_errors == 0
    assert index.pod(vllm_pod.name).num_unknown_removals == 0
    assert index.pod(vllm_pod.name).num_clears == 1


def test_a_hybrid_models_two_kv_groups_are_indexed_apart():
    """Full attention (group 0) and a 2-block sliding window (group 1) share vLLM's pool; a prefix hit
    in the window group brings null blocks; evictions hit both groups."""
    pod = VllmPod(num_blocks=40, sliding_window_blocks=2)
    index = FleetIndex()
    try:
        with Collector([pod.source()], [index], FAST) as collector:
            wait_until(lambda: collector.stats()[pod.name].num_connects == 1, "the SUB socket to connect")
            time.sleep(0.2)

            def step(name: str) -> None:
                pod.publish()
                wait_until(caught_up(index, pod), f"the index to apply {name!r}")
                assert index.copies(pod.name) == pod.cached(), name
                index.check_invariants()

            a = pod.request(list(range(30)))
            pod.allocate(a)
            pod.decode(a, [30, 31])
            step("prefill and decode a")
            pod.free(a)
            b = pod.request(list(range(24)) + [500] * 9)
            pod.allocate(b)
            step("prefix hit b")
            pod.free(b)
            c = pod.request(list(range(1000, 1070)))
            pod.allocate(c)
            step("evict for c")
        summary = index.pod(pod.name)
        assert {group.group_idx for group in summary.groups} == {0, 1}
        assert summary.num_blocks_removed > 0 and summary.num_unknown_removals == 0
    finally:
        pod.close()


def test_a_subscriber_that_joins_late_recovers_everything_through_the_replay_socket(vllm_pod):
    seen = run_scenario(vllm_pod, lambda step: None)
    assert vllm_pod.num_published == 7
    vllm_pod.wait_sent()  # late: after everything is out
    index = FleetIndex()
    with Collector([vllm_pod.source()], [index], FAST) as collector:
        wait_until(caught_up(index, vllm_pod), "the start-up replay")
        assert index.copies(vllm_pod.name) == vllm_pod.cached() == seen["after reset"]
        stats = collector.stats()[vllm_pod.name]
        assert stats.num_replayed_batches == 7 and stats.num_lost_batches == 0

        time.sleep(0.2)  # the SUB subscription reaches the publisher
        g = vllm_pod.request(list(range(500, 517)))
        vllm_pod.allocate(g)
        vllm_pod.publish()
        wait_until(caught_up(index, vllm_pod), "the live batch after the replay")
        assert index.copies(vllm_pod.name) == vllm_pod.cached()
    assert index.pod(vllm_pod.name).num_unknown_removals == 0


def test_batches_dropped_by_a_slow_collector_come_back_through_the_replay_socket():
    """The sink stalls; vLLM's PUB socket (high-water mark 10) drops; the replay socket fills the gap.

    The drop is at the end of the feed, so no later batch reveals it: the collector's check of a
    quiet feed (idle_replay_after_s) does.
    """
    pod = VllmPod(num_blocks=1100, hwm=10)
    index = FleetIndex()
    stall = StallingSink()
    config = CollectorConfig(
        receive_hwm=2, queue_size=1, replay_idle_timeout_s=1.0, poll_interval_s=0.02, idle_replay_after_s=0.5
    )
    try:
        with Collector([pod.source()], [stall, index], config) as collector:
            wait_until(lambda: collector.stats()[pod.name].num_connects == 1, "the SUB socket to connect")
            time.sleep(0.2)
            for i in range(100):  # batches of ~16 kB, more than the loopback socket buffers hold
                request = pod.request([100_000 * i + k for k in range(4096)])
                pod.allocate(request)
                pod.free(request)
                pod.publish()
            time.sleep(0.5)
            stall.release.set()
            wait_until(caught_up(index, pod), "the index to catch up", timeout_s=60)
            stats = collector.stats()[pod.name]
        assert stats.num_replayed_batches >= 1, "some batches were dropped and came back by replay"
        assert stats.num_lost_batches == 0
        assert index.copies(pod.name) == pod.cached()
    finally:
        pod.close()


def test_a_restarted_vllm_server_is_detected_and_its_new_cache_replaces_the_old(tmp_path):
    """A new publisher on the same endpoints numbers its batches from 0 again."""
    endpoint = f"ipc://{tmp_path}/kv-events"  # the same address twice (vLLM binds a PUB only with a wildcard)
    first = VllmPod(pub_endpoint=endpoint)
    source = first.source()
    index = FleetIndex()
    with Collector([source], [index], FAST) as collector:
        wait_until(lambda: collector.stats()[first.name].num_connects == 1, "the SUB socket to connect")
        time.sleep(0.2)
        for i in range(5):
            first.allocate(first.request([10 * i + k for k in range(9)]))
            first.publish()
        wait_until(caught_up(index, first), "the first server's batches")
        first.close()
        wait_port_free(first.replay_port)
        second = VllmPod(pub_endpoint=endpoint, replay_port=first.replay_port)
        try:
            wait_until(lambda: collector.stats()[first.name].num_connects == 2, "the SUB socket to reconnect")
            time.sleep(0.2)
            second.allocate(second.request(list(range(700, 713))))
            second.publish()
            wait_until(lambda: collector.stats()[first.name].num_restarts == 1, "the restart to be seen")
            wait_until(lambda: index.pod(first.name).last_seq == 0, "the new server's first batch")
            assert index.copies(first.name) == second.cached()
            assert index.pod(first.name).num_resets == 1
        finally:
            second.close()


def test_sglangs_publisher_feeds_the_same_index():
    """SGLang 0.5.23's ZmqEventPublisher and event types: signed 64-bit hashes, pages chained by parent,
    one BlockRemoved per radix node, its own medium name, a late subscriber replaying."""
    kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events", reason="SGLang interop")
    port, replay_port = free_port(), free_port()
    publisher = kv_events.ZmqEventPublisher(
        attn_dp_rank=0,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=TOPIC,
        bind=True,
    )
    pages = [-(2**63), 2**63 - 1, -5, 7]  # what SGLang's hash_str_to_int64 gives: signed

    def stored(hashes, parent, tokens, medium="GPU"):
        return kv_events.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=4,
            lora_id=None,
            medium=medium,
        )

    batches = [
        [stored(pages[:2], None, list(range(8)))],
        [stored(pages[2:], pages[1], list(range(8, 16))), stored([11], None, [1, 1, 1, 1], medium="CPU_PINNED")],
        [kv_events.BlockRemoved(block_hashes=pages[2:], medium="GPU")],
    ]
    try:
        for events in batches:
            publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=events))
        source = PodSource("sglang-0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
        index = FleetIndex()
        with Collector([source], [index], FAST) as collector:
            wait_until(
                lambda: "sglang-0" in index.pod_names() and index.pod("sglang-0").last_seq == 2, "the replay"
            )
            assert index.copies("sglang-0") == {
                ("GPU", 0, pages[0]): 1,
                ("GPU", 0, pages[1]): 1,
                ("CPU_PINNED", 0, 11): 1,
            }
            time.sleep(0.2)
            publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[kv_events.AllBlocksCleared()]))
            wait_until(lambda: index.pod("sglang-0").last_seq == 3, "the live clear")
            assert index.copies("sglang-0") == {}
            assert collector.stats()["sglang-0"].num_replayed_batches == 3
            assert index.route(list(range(8))).best_pods == ()
    finally:
        publisher.shutdown()
