"""A vLLM server's lifecycle as an operator meets it, with vLLM's own publisher: it restarts, it starts
after the collector, it idles, it is misconfigured (issue 31, bugs 1, 2, 3, 6 and 7; 4 and 5 are in
tests/test_cli_fleet.py).

Each server here is vLLM 0.33's `KVCacheManager` publishing through its `ZmqEventPublisher`
(`tests.fleet_support.VllmPod`), bound the way `--kv-events-config` binds it: `tcp://*:PORT`.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from fleet.collector import Collector
from fleet.config import CollectorConfig
from fleet.events import LinkState
from fleet.health import PodHealth
from fleet.index import FleetIndex
from fleet.source import PodSource
from tests.fleet_support import TOPIC, VllmPod, wait_port_free, wait_until
from tests.ports import free_port

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")

FAST = CollectorConfig(replay_idle_timeout_s=0.5, poll_interval_s=0.02, status_every_s=0.2)


def serve(port: int, replay_port: int, name: str = "vllm-0") -> VllmPod:
    """A vLLM publisher bound as `"endpoint": "tcp://*:PORT"` (all interfaces), its replay socket on loopback."""
    return VllmPod(name=name, pub_endpoint=f"tcp://*:{port}", replay_port=replay_port)


def watched(port: int, replay_port: int, name: str = "vllm-0") -> PodSource:
    return PodSource(name, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)


def publish_prompts(pod: VllmPod, num_batches: int, first_token: int = 0) -> None:
    """One prompt of two full blocks and a token per batch, freed after (its blocks stay cached)."""
    for i in range(num_batches):
        request = pod.request([first_token + 10 * i + k for k in range(9)])
        pod.allocate(request)
        pod.free(request)
        pod.publish()


def test_a_server_restarted_after_a_quiet_spell_is_detected_and_only_its_new_blocks_are_held():
    """Bug 1: the quiet-feed check used to mark every old number as seen, so the new server's batches
    0..N were dropped as duplicates of the dead server's and its ghosts stayed held."""
    port, replay_port = free_port(), free_port()
    config = replace(FAST, idle_replay_after_s=0.3)
    first = serve(port, replay_port)
    index = FleetIndex()
    with Collector([watched(port, replay_port)], [index], config) as collector:
        wait_until(lambda: collector.stats()["vllm-0"].link is LinkState.CONNECTED, "the SUB socket to connect")
        time.sleep(0.2)
        publish_prompts(first, 5)
        wait_until(lambda: "vllm-0" in index.pod_names() and index.pod("vllm-0").last_seq == 4, "the first server")
        time.sleep(1.0)  # quiet: the quiet-feed check runs
        assert collector.stats()["vllm-0"].num_replays >= 2
        first.close()
        wait_port_free(port)
        wait_port_free(replay_port)
        second = serve(port, replay_port)
        try:
            publish_prompts(second, 3, first_token=5000)
            wait_until(lambda: index.pod("vllm-0").last_seq == 2, "the new server's three batches")
            wait_until(lambda: index.copies("vllm-0") == second.cached(), "exactly the new server's blocks")
            assert collector.stats()["vllm-0"].num_restarts == 1
            assert index.pod("vllm-0").num_resets == 1
        finally:
            second.close()


def test_a_server_back_after_a_long_outage_is_seen_restarted_before_it_publishes_anything():
    """The replays that timed out while it was down must not delay the catch-up its new connection
    owes: found empty, it shows the restart, and the dead server's blocks go before any request."""
    port, replay_port = free_port(), free_port()
    config = replace(FAST, idle_replay_after_s=0.2, replay_idle_timeout_s=0.2, replay_backoff_s=30.0,
                     replay_backoff_max_s=60.0)  # fmt: skip
    first = serve(port, replay_port)
    index = FleetIndex()
    with Collector([watched(port, replay_port)], [index], config) as collector:
        wait_until(lambda: collector.stats()["vllm-0"].link is LinkState.CONNECTED, "the SUB socket to connect")
        time.sleep(0.2)
        publish_prompts(first, 3)
        wait_until(lambda: "vllm-0" in index.pod_names() and index.pod("vllm-0").last_seq == 2, "the first server")
        first.close()
        wait_until(lambda: collector.stats()["vllm-0"].num_replay_timeouts >= 1, "a catch-up to time out")
        wait_port_free(port)
        wait_port_free(replay_port)
        second = serve(port, replay_port)
        try:
            wait_until(lambda: collector.stats()["vllm-0"].num_restarts == 1, "the restart, seen on reconnection")
            wait_until(lambda: index.copies("vllm-0") == {}, "the dead server's blocks to go")
            assert second.num_published == 0
        finally:
            second.close()


def test_a_pub_endpoint_that_connects_instead_of_binding_is_reported_unreachable():
    """Bug 2: `"endpoint": "tcp://127.0.0.1:5557"` makes vLLM connect its PUB socket, the collector connects
    too, and no live batch ever arrives; the start-up replay alone used to read as a ready pod."""
    port, replay_port = free_port(), free_port()
    pod = VllmPod(pub_endpoint=f"tcp://127.0.0.1:{port}", replay_port=replay_port)
    try:
        publish_prompts(pod, 2)
        pod.wait_sent()
        index = FleetIndex(stale_after_s=60.0)
        with Collector([watched(port, replay_port)], [index], FAST) as collector:
            wait_until(lambda: collector.stats()["vllm-0"].link is LinkState.REFUSED, "the refused link")
            wait_until(lambda: index.pod("vllm-0").link is LinkState.REFUSED, "the status to reach the index")
            wait_until(lambda: index.pod("vllm-0").last_seq == 1, "the start-up replay: the replay socket answers")
            summary = index.pod("vllm-0")
            assert summary.health is PodHealth.UNREACHABLE and summary.stale
    finally:
        pod.close()


def test_a_prompt_of_whole_blocks_is_routed_to_the_tokens_vllm_reports_cached():
    """Bug 3: vLLM recomputes a prompt's last token, so a fully cached 8-token prompt reuses 4 tokens."""
    pod = VllmPod()
    index = FleetIndex()
    try:
        with Collector([pod.source()], [index], FAST) as collector:
            wait_until(lambda: collector.stats()[pod.name].link is LinkState.CONNECTED, "the SUB socket to connect")
            time.sleep(0.2)
            first = pod.request(list(range(100, 108)))
            pod.allocate(first)
            pod.free(first)
            pod.publish()
            wait_until(lambda: pod.name in index.pod_names() and index.pod(pod.name).last_seq == 0, "the batch")
            for prompt in (list(range(100, 108)), list(range(100, 109)), list(range(100, 105))):
                _, vllm_cached = pod.lookup(pod.request(prompt))
                assert index.route(prompt).matches[0].matched_tokens == vllm_cached, prompt
    finally:
        pod.close()


def test_a_connected_idle_pod_is_idle_not_stale_and_a_dead_one_is_stale():
    """Bug 6: silence used to mean stale; a pod whose link is up is idle, its cache as last seen."""
    pod = VllmPod()
    index = FleetIndex(stale_after_s=0.3)
    try:
        with Collector([pod.source()], [index], FAST) as collector:
            wait_until(lambda: collector.stats()[pod.name].link is LinkState.CONNECTED, "the SUB socket to connect")
            time.sleep(0.2)
            publish_prompts(pod, 1)
            wait_until(lambda: pod.name in index.pod_names() and index.pod(pod.name).last_seq == 0, "the batch")
            time.sleep(0.6)
            idle = index.pod(pod.name)
            assert (idle.health, idle.stale) == (PodHealth.IDLE, False)
            assert not index.route(list(range(9))).matches[0].stale
            pod.close()
            wait_until(lambda: index.pod(pod.name).stale, "the dead pod to be stale")
            assert index.pod(pod.name).health in (PodHealth.DOWN, PodHealth.UNREACHABLE)
    finally:
        pod.close()


def test_a_server_that_starts_after_the_collector_is_heard_and_what_it_published_first_is_replayed():
    """Bug 7: vLLM takes minutes to load. Its first batches go out before the collector's SUB socket
    (backing off its reconnects) is connected; the new connection must trigger a catch-up."""
    port, replay_port = free_port(), free_port()
    config = replace(FAST, idle_replay_after_s=0.3, replay_idle_timeout_s=0.3)
    index = FleetIndex()
    with Collector([watched(port, replay_port)], [index], config) as collector:
        wait_until(lambda: collector.stats()["vllm-0"].link is LinkState.REFUSED, "the refused link")
        time.sleep(2.0)  # the start-up replay and the quiet-feed check have both run and found no one
        pod = serve(port, replay_port)
        try:
            publish_prompts(pod, 5)
            wait_until(lambda: "vllm-0" in index.pod_names() and index.pod("vllm-0").last_seq == 4, "the five batches")
            assert index.copies("vllm-0") == pod.cached()
            wait_until(lambda: index.pod("vllm-0").link is LinkState.CONNECTED, "the live link")
            publish_prompts(pod, 1, first_token=9000)
            wait_until(lambda: index.pod("vllm-0").last_seq == 5, "a live batch after the catch-up")
            stats = collector.stats()["vllm-0"]
            assert stats.num_lost_batches == 0 and stats.num_restarts == 0
        finally:
            pod.close()
