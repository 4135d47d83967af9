"""What an engine tells the outside world when its configuration asks: the KV-event feed and /metrics.

    feeds = open_feeds(engine)     # binds what engine.core.config names; nothing when it names nothing
    ...
    feeds.close()                  # stops both and detaches their listeners

`EngineConfig.kv_events_endpoint` (+ `kv_events_replay_endpoint`, `kv_events_topic`) starts a
`KVEventPublisher` (engine/feeds/kv_event_publisher.py) listening on the engine; `EngineConfig.metrics_port`
starts a `MetricsServer` (engine/feeds/metrics_server.py) on 127.0.0.1. The engine object itself binds
nothing, so a console that restarts its engine closes the old feeds and opens them on the new engine
(with a new feed whose sequence starts at 0: consumers see a restarted server and drop its blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.feeds.kv_event_publisher import KVEventPublisher
from engine.feeds.kv_events import MEDIUM_CPU, MEDIUM_GPU, GroupSpec, KVEventTranslator, disk_blocks
from engine.feeds.metrics_server import MetricsServer


def translator_for(engine: Any) -> KVEventTranslator:
    """The KV-event translation of `engine`'s groups, block size, device and disk tier."""
    groups = [GroupSpec(group.name, group.window) for group in engine.runner.groups]
    medium = MEDIUM_GPU if str(engine.loaded.device).startswith("cuda") else MEDIUM_CPU
    return KVEventTranslator(groups, engine.config.block_size, medium, disk_tier=engine.kv.tier is not None)


@dataclass
class EngineFeeds:
    """The publisher and the metrics server of one engine (either may be absent)."""

    engine: Any  # the engine they listen on
    publisher: KVEventPublisher | None  # the KV-event feed, if configured
    metrics: MetricsServer | None  # the Prometheus endpoint, if configured

    def close(self) -> None:
        """Detach and close both. Idempotent."""
        if self.publisher is not None:
            try:
                self.engine.remove_listener(self.publisher.on_step)
            except ValueError:
                pass  # closed twice
            self.publisher.close()
        if self.metrics is not None:
            self.metrics.close()


def open_feeds(engine: Any) -> EngineFeeds:
    """Start the feeds `engine.core.config` asks for and attach them to the engine (before it starts stepping).

    Raises:
        zmq.ZMQError, OSError: an endpoint or port that cannot be bound; nothing stays open.
    """
    config = engine.config
    publisher = metrics = None
    try:
        if config.kv_events_endpoint is not None:
            publisher = KVEventPublisher(
                translator_for(engine),
                config.kv_events_endpoint,
                config.kv_events_replay_endpoint,
                config.kv_events_topic,
            )
            if engine.kv.tier is not None:  # a warm tier's blocks have no event: the feed opens with them
                publisher.announce_disk(disk_blocks(engine.kv.tier))
            engine.add_listener(publisher.on_step)
        if config.metrics_port is not None:
            metrics = MetricsServer(engine, config.metrics_port)
    except BaseException:
        EngineFeeds(engine, publisher, None).close()
        raise
    return EngineFeeds(engine, publisher, metrics)
