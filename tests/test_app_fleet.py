"""The Fleet pages (AppTest) against two vLLM pods: vLLM's KVCacheManager published by vLLM's publisher.

The console runs the collector ($PREFIX_CONSOLE_FLEET_PODS, stale after 1 s so a test can see a pod go
stale); the pages show each pod's blocks from the live index and from the history database, the
cross-pod prefix tree, the evictions, and where a prompt would be routed.
"""

from __future__ import annotations

import pytest

from tests.fleet_support import MetricsServer, VllmPod, vllm_metrics_text, wait_until
from tests.test_app_support import console_env, errors, no_exceptions, open_page, texts  # noqa: F401

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")

SHARED = list(range(100, 112))  # three 4-token blocks both pods cache


@pytest.fixture
def two_pods(console_env, monkeypatch):
    """Pods "vllm-a" and "vllm-b", watched by the console's collector; both cached SHARED, and a
    cached a longer prompt of its own."""
    pods = [VllmPod(name="vllm-a"), VllmPod(name="vllm-b")]
    metrics = MetricsServer(vllm_metrics_text(queries=400, hits=300, scheduler=True))  # vllm-a's /metrics
    spec = " ".join(
        f"{pod.name}={pod.endpoint},replay=tcp://127.0.0.1:{pod.replay_port},topic=kv-events" for pod in pods
    ) + f",metrics={metrics.url}"
    monkeypatch.setenv("PREFIX_CONSOLE_FLEET_PODS", spec)
    monkeypatch.setenv("PREFIX_CONSOLE_FLEET_STALE_AFTER_S", "1")
    yield pods
    for pod in pods:
        pod.close()
    metrics.close()


def publish_prompts(pods) -> list:
    """Pod a caches 5 blocks (SHARED and two of its own), pod b SHARED's 3; returns the two requests."""
    a, b = pods
    requests = [a.request(SHARED + list(range(500, 509))), b.request(SHARED + [7])]
    for pod, request in zip(pods, requests):
        pod.allocate(request)
        pod.publish()
    return requests


def fleet_host():
    from app.fleet_hosting import get_fleet_host

    return get_fleet_host()


def wait_for_pods(pods) -> None:
    """Until the console's live index holds what each vLLM pool caches, and the history has it too."""
    watch = fleet_host().watch
    for pod in pods:
        wait_until(lambda pod=pod: watch.index.copies(pod.name) == pod.cached(), f"{pod.name} in the index", 30)
    assert watch.writer.flush(30)


def test_the_pods_page_shows_each_pods_blocks_live_and_from_the_history(two_pods) -> None:
    at = open_page("fleet_pods")  # starts the console and its collector
    wait_until(lambda: all(s.ready for s in fleet_host().watch.collector.stats().values()), "the start-up replays", 30)
    publish_prompts(two_pods)
    wait_for_pods(two_pods)

    at.run()
    no_exceptions(at)
    live = at.dataframe[0].value.set_index("pod")
    assert live.loc["vllm-a", "blocks"] == 5 and live.loc["vllm-b", "blocks"] == 3
    assert set(live["status"]) <= {"live", "idle"} and not live["stale"].any()  # idle once quiet for 1 s
    wait_until(lambda: fleet_host().watch.index.metrics("vllm-b"), "a scrape of vllm-b's /metrics", 15)
    at.run()
    live = at.dataframe[0].value.set_index("pod")
    assert live.loc["vllm-b", "capacity"] == 2000 and live.loc["vllm-b", "kv_usage"] == 0.5
    assert live.loc["vllm-b", "lifetime_hit_rate"] == 0.75, "300 of 400 tokens, since the server started"
    at.radio(key="fleet_view").set_value("History database (every collector)").run()
    stored = at.dataframe[0].value.set_index("pod")
    assert stored.loc["vllm-a", "blocks"] == 5 and stored.loc["vllm-b", "blocks"] == 3
    assert stored.loc["vllm-a", "GPU blocks"] == 5


def test_a_pod_that_stops_sending_is_marked_stale_not_dropped(two_pods) -> None:
    """Its server went away (bug 6 of issue 31: a connected pod that is merely quiet is idle, not stale)."""
    at = open_page("fleet_pods")
    publish_prompts(two_pods)
    wait_for_pods(two_pods)
    wait_until(lambda: all(p.health.value == "idle" for p in fleet_host().watch.index.pods()), "both pods idle", 10)
    at.run()
    assert set(at.dataframe[0].value["status"]) == {"idle"} and not at.warning
    for pod in two_pods:
        pod.close()
    wait_until(lambda: all(p.stale for p in fleet_host().watch.index.pods()), "both pods to go down", 10)

    at.run()
    live = at.dataframe[0].value.set_index("pod")
    assert live["stale"].all() and live.loc["vllm-a", "blocks"] == 5
    assert set(live["status"]) <= {"down", "unreachable"}
    assert any("Stale" in text and "vllm-a" in text for text in (w.value for w in at.warning))


def test_routing_a_prompt_names_the_pod_with_the_longest_cached_prefix(two_pods) -> None:
    at = open_page("fleet_route")
    publish_prompts(two_pods)
    wait_for_pods(two_pods)
    at.run()
    at.radio(key="fleet_route_mode").set_value("Token ids").run()
    prompt = SHARED + list(range(500, 509)) + [42, 43]
    at.text_area(key="fleet_route_prompt").input(", ".join(map(str, prompt)))
    at.button(key="fleet_route_go").click().run()
    no_exceptions(at)

    assert [s.value for s in at.success] == ["Route to **vllm-a**: 20 of 23 prompt tokens cached (5 blocks)."]
    routed = at.dataframe[0].value
    assert routed[["pod", "cached tokens"]].values.tolist() == [["vllm-a", 20], ["vllm-b", 12]]
    at.radio(key="fleet_route_view").set_value("History database (every collector)").run()
    assert at.dataframe[0].value[["pod", "cached tokens"]].values.tolist() == [["vllm-a", 20], ["vllm-b", 12]]


def test_chat_messages_are_routed_after_rendering_with_the_model_directorys_chat_template(
    two_pods, test_data_dir
) -> None:
    from engine.runner.model_loading import SMOLLM2_TOKENIZER_CACHE_NAME, smollm2_tokenizer

    smollm2_tokenizer(test_data_dir)  # makes the tokenizer-only cache: tokenizer.json and its chat template
    directory = test_data_dir / "models" / SMOLLM2_TOKENIZER_CACHE_NAME
    at = open_page("fleet_route")
    at.radio(key="fleet_route_mode").set_value("Chat messages, a local model directory's chat template").run()
    at.text_input(key="fleet_route_chat_dir").input(str(directory))
    at.text_area(key="fleet_route_prompt").input("system: Be brief.\nuser: What is a KV cache?")
    at.button(key="fleet_route_go").click().run()
    no_exceptions(at)
    assert not errors(at)
    assert any("No pod holds the first block" in info.value for info in at.info)


def test_bad_token_ids_are_refused_with_the_reason(two_pods) -> None:
    at = open_page("fleet_route")
    at.radio(key="fleet_route_mode").set_value("Token ids").run()
    at.text_area(key="fleet_route_prompt").input("1, 2, banana")
    at.button(key="fleet_route_go").click().run()
    assert errors(at) == ["Not routed: token ids must be integers separated by commas or spaces"]


def test_the_prefix_tree_shows_the_shared_prefix_and_who_holds_it(two_pods) -> None:
    at = open_page("fleet_tree")
    publish_prompts(two_pods)
    wait_for_pods(two_pods)
    at.button(key="fleet_tree_refresh").click().run()
    no_exceptions(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Prefix blocks"] == "5" and metrics["Held by 2+ pods"] == "3"
    assert metrics["Deepest shared prefix"] == "12 tokens"
    deepest = at.dataframe[0].value
    assert deepest.iloc[0]["pods"] == "vllm-a" and deepest.iloc[0]["num_tokens"] == 20


def test_the_evictions_page_shows_evictions_with_their_ages(two_pods) -> None:
    a = two_pods[0]
    at = open_page("fleet_evictions")
    first, _ = publish_prompts(two_pods)
    a.free(first)
    a.allocate(a.request(list(range(1000, 1046))))  # 12 blocks of a 15-block pool: evicts a's cached ones
    a.publish()
    wait_for_pods(two_pods)
    at.button(key="fleet_evict_refresh").click().run()
    no_exceptions(at)

    metrics = {m.label: m.value for m in at.metric}
    assert int(metrics["Evictions"]) > 0 and metrics["Of unknown age"] == "0"
    log = at.dataframe[0].value
    assert set(log["pod"]) == {"vllm-a"} and log["age_s"].notna().all()


def test_a_bad_pod_list_is_shown_and_nothing_starts(console_env, monkeypatch) -> None:
    monkeypatch.setenv("PREFIX_CONSOLE_FLEET_PODS", "pod-a=http://nowhere")
    at = open_page("fleet_pods")
    assert any("PREFIX_CONSOLE_FLEET_PODS" in message for message in errors(at))
    assert fleet_host().watch is None
    assert "No pods yet" in texts(at)
