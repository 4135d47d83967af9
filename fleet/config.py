"""How the collector listens: `CollectorConfig`, every field with a default that suits a local fleet."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.decode import DecodeLimits


@dataclass(frozen=True)
class CollectorConfig:
    """How the collector listens; every field has a default that suits a local fleet."""

    limits: DecodeLimits = field(default_factory=DecodeLimits)  # bounds on each message
    replay_idle_timeout_s: float = 2.0  # a replay silent this long is abandoned
    replay_backoff_s: float = 1.0  # after an abandoned replay, none for this long (doubling)
    replay_backoff_max_s: float = 30.0  # the backoff's ceiling
    idle_replay_after_s: float = 5.0  # a feed quiet this long after a message is checked for a lost tail
    max_replay_batches: int = 1_000_000  # a replay is cut after this many batches
    reconnect_ivl_ms: int = 100  # ZeroMQ's first reconnect delay (ZMQ_RECONNECT_IVL)
    reconnect_ivl_max_ms: int = 5_000  # ZeroMQ's reconnect delay ceiling (ZMQ_RECONNECT_IVL_MAX)
    resubscribe_after_s: float = 10.0  # a SUB connection down this long gets a new socket (doubling)
    resubscribe_max_s: float = 300.0  # that wait's ceiling
    receive_hwm: int = 100_000  # messages the SUB socket buffers (ZMQ_RCVHWM)
    queue_size: int = 10_000  # batches between the pod threads and the dispatcher
    max_queued_bytes: int = 256 * 1024 * 1024  # their payloads' bytes, at most (a larger batch goes alone)
    poll_interval_s: float = 0.1  # how often idle threads look at the stop flag
    status_every_s: float = 5.0  # each pod's PodStatus heartbeat to the sinks, this often
    metrics_every_s: float = 5.0  # each pod's /metrics (if it names one) is scraped this often
    metrics_timeout_s: float = 2.0  # a scrape slower than this fails

    def __post_init__(self) -> None:
        positive = {
            "replay_idle_timeout_s": self.replay_idle_timeout_s,
            "replay_backoff_s": self.replay_backoff_s,
            "replay_backoff_max_s": self.replay_backoff_max_s,
            "idle_replay_after_s": self.idle_replay_after_s,
            "max_replay_batches": self.max_replay_batches,
            "reconnect_ivl_ms": self.reconnect_ivl_ms,
            "reconnect_ivl_max_ms": self.reconnect_ivl_max_ms,
            "resubscribe_after_s": self.resubscribe_after_s,
            "resubscribe_max_s": self.resubscribe_max_s,
            "receive_hwm": self.receive_hwm,
            "queue_size": self.queue_size,
            "max_queued_bytes": self.max_queued_bytes,
            "poll_interval_s": self.poll_interval_s,
            "status_every_s": self.status_every_s,
            "metrics_every_s": self.metrics_every_s,
            "metrics_timeout_s": self.metrics_timeout_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"CollectorConfig.{name} must be positive, got {value!r}")
        if self.replay_backoff_max_s < self.replay_backoff_s:
            raise ValueError("replay_backoff_max_s must be at least replay_backoff_s")
        if self.resubscribe_max_s < self.resubscribe_after_s:
            raise ValueError("resubscribe_max_s must be at least resubscribe_after_s")
