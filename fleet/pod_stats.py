"""What one pod's subscriber has seen: `PodStats`, the collector's counters (`Collector.stats` returns copies)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.decode import FeedErrorKind
from fleet.events import LinkState


@dataclass
class PodStats:
    """What one pod's subscriber has seen. `Collector.stats` returns copies."""

    pod: str  # the pod's name
    ready: bool = False  # the start-up replay is over (done, timed out, or none): live batches flow
    link: LinkState = LinkState.CONNECTING  # the SUB connection
    num_connects: int = 0  # TCP connections made (1 + reconnects)
    num_disconnects: int = 0  # TCP connections lost
    num_resubscribes: int = 0  # new SUB sockets for a connection ZeroMQ gave up on
    num_batches: int = 0  # batches handed to the sinks, live and replayed
    num_replayed_batches: int = 0  # of which came through the replay socket
    num_block_events: int = 0  # blocks stored plus blocks removed in them
    num_unknown_events: int = 0  # events of unknown types skipped
    num_duplicates: int = 0  # live batches already applied from a replay (dropped)
    num_wrong_topic: int = 0  # messages under another topic (dropped)
    num_gaps: int = 0  # times the live sequence skipped ahead
    num_lost_batches: int = 0  # sequence numbers neither live nor replay delivered
    num_replays: int = 0  # replay requests sent (catch-ups and gaps)
    num_replay_timeouts: int = 0  # replays abandoned because the server went silent
    num_replays_skipped: int = 0  # gaps not replayed: no replay socket, or backing off
    num_restarts: int = 0  # restarted servers detected (each sent a PodReset)
    last_restart_at: float | None = None  # collector time of the latest restart detected
    errors: dict[FeedErrorKind, int] = field(default_factory=dict)  # messages refused, by kind
    last_error: str | None = None  # the latest refusal's reason
    last_seq: int | None = None  # the sequence number of the latest batch handed on
    last_batch_ts: float | None = None  # publisher time of that batch
    last_received_at: float | None = None  # collector time of the latest message of any kind
    last_lag_s: float | None = None  # received_at - ts of the latest live batch

    @property
    def num_errors(self) -> int:
        """Messages refused, all kinds together."""
        return sum(self.errors.values())
