"""The Fleet pages with a pod that holds blocks in two tiers (AppTest): the Pods page's held blocks per tier
and the route page's "which tier would serve it", live and from the history database.

The pod is a KV-event publisher of this project's (engine/feeds/kv_event_publisher.py) fed by hand: blocks
1-2 of PROMPT in its pool ("CPU"), blocks 1-4 on its disk tier ("DISK"), as an engine whose pool evicted
the prompt's chain and promoted its first two blocks again would say.
"""

from __future__ import annotations

import time

import pytest

from engine.feeds.kv_event_publisher import KVEventPublisher
from engine.feeds.kv_events import BlockStored, EventBatch, GroupSpec, KVEventTranslator
from tests.fleet_support import wait_until
from tests.test_app_support import console_env, no_exceptions, open_page, texts  # noqa: F401

BS = 4
PROMPT = list(range(100, 117))  # four whole blocks and one token
HISTORY = "History database (every collector)"


def stored(first: int, last: int, medium: str) -> BlockStored:
    """Blocks first..last of PROMPT (hash n for block n), chained, as one event."""
    parent = first - 1 if first > 1 else None
    return BlockStored(
        list(range(first, last + 1)), parent, PROMPT[(first - 1) * BS : last * BS], BS, None, medium, None, group_idx=0
    )


@pytest.fixture
def two_tier_pod(console_env, monkeypatch):
    publisher = KVEventPublisher(
        KVEventTranslator([GroupSpec("full", None)], BS, "CPU"), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "kv-events"
    )
    events = [stored(1, 4, "DISK"), stored(1, 2, "CPU")]
    publisher.publish(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
    spec = f"engine={publisher.endpoint},replay={publisher.replay_endpoint},topic=kv-events"
    monkeypatch.setenv("PREFIX_CONSOLE_FLEET_PODS", spec)
    yield publisher
    publisher.close()


def wait_for_the_pod() -> None:
    from app.fleet_hosting import get_fleet_host

    watch = get_fleet_host().watch
    held = {("CPU", 0, 1): 1, ("CPU", 0, 2): 1, **{("DISK", 0, n): 1 for n in range(1, 5)}}
    wait_until(lambda: watch.index.copies("engine") == held, "the pod's blocks in the live index", 30)
    assert watch.writer.flush(30)


def test_the_pods_page_shows_held_blocks_per_tier(two_tier_pod) -> None:
    at = open_page("fleet_pods")  # starts the console's collector
    wait_for_the_pod()
    at.run()
    no_exceptions(at)
    tiers = at.dataframe[1].value  # after the pods table
    rows = tiers[["pod", "tier", "blocks"]].values.tolist()
    assert rows == [["engine", "CPU", 2], ["engine", "DISK", 4]]
    assert tiers["share of pod"].tolist() == [2 / 6, 4 / 6]


def test_the_route_page_says_which_tier_would_serve_the_prompt_live_and_from_the_history(two_tier_pod) -> None:
    at = open_page("fleet_route")
    wait_for_the_pod()
    at.run()
    at.radio(key="fleet_route_mode").set_value("Token ids").run()
    at.text_area(key="fleet_route_prompt").input(", ".join(map(str, PROMPT)))
    at.button(key="fleet_route_go").click().run()
    no_exceptions(at)
    assert "engine: 8 tokens in CPU memory, 8 more on DISK" in texts(at)
    at.radio(key="fleet_route_view").set_value(HISTORY).run()
    no_exceptions(at)
    assert "engine: 8 tokens in CPU memory, 8 more on DISK" in texts(at)
