"""The decoded KV-event feed: what a vLLM or SGLang server says about its prefix cache.

These are the collector's output types, independent of the wire encoding (`fleet.decode` reads both
of vLLM's encodings and SGLang's). A server publishes one `EventBatch` per engine step; the collector
tags each with its pod, sequence number and arrival time (`PodBatch`) and hands it to every sink.

The three event types are frozen msgspec Structs (built in C: a decoded batch of a few hundred events
costs microseconds, where frozen dataclasses cost a microsecond per event); the rest are dataclasses.

What the events mean (vLLM 0.33's `BlockPool`; SGLang's radix cache says the same per page):
  * `BlockStored`: blocks became full and entered the prefix cache, one hash per physical block,
    `token_ids` their tokens back to back. vLLM does not de-duplicate: the same hash can be stored by
    several physical blocks at once, one `BlockStored` each. (One exception the feed cannot show: a
    request sent with `kv_cache_report_mode="full"` makes vLLM also report the blocks it *hit* as
    BlockStored; consumers then count copies no BlockRemoved will ever take away.)
  * `BlockRemoved`: cached blocks left the prefix cache (a free cached block was re-popped for reuse,
    or evicted explicitly), one hash per physical copy. A block whose reference count reaches zero
    stays cached and sends nothing.
  * `AllBlocksCleared`: the prefix cache was reset. The event names no medium or group: vLLM's
    `reset_prefix_cache` resets every block pool of the server (each KV group, and the host pool of
    HiSparse), so consumers drop everything the pod holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

BlockHash = int | bytes
"""A block's hash as published: vLLM's default is the low 64 bits of the block hash as an unsigned
int (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), else the hash bytes; SGLang publishes signed 64-bit ints."""

DEFAULT_MEDIUM = "GPU"
"""The medium of events that name none (older releases, SGLang's default tier)."""


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Full blocks entered a pod's prefix cache, chained after `parent_block_hash`."""

    block_hashes: tuple[BlockHash, ...]  # one per physical block, in chain order
    parent_block_hash: BlockHash | None  # the block before the first one; None at a prompt's start
    token_ids: tuple[int, ...]  # the blocks' tokens back to back (len = blocks * block_size when aligned)
    block_size: int  # tokens per block
    medium: str  # where the blocks live: "GPU", "CPU", "CPU_PINNED", ... (DEFAULT_MEDIUM if unnamed)
    group_idx: int  # the KV cache group (0 if unnamed); hashes are only unique within a group
    lora_id: int | None = None  # deprecated by vLLM in favour of lora_name
    lora_name: str | None = None  # the LoRA adapter the blocks were computed with
    extra_keys: tuple[object, ...] | None = None  # per block: what else entered the hash (mm, salt)
    kv_cache_spec_kind: str | None = None  # the group's attention kind ("full_attention", ...)
    kv_cache_spec_sliding_window: int | None = None  # the group's window in tokens, if any
    locality: str | None = None  # "LOCAL" or "REMOTE" relative to the publisher, if said

    @property
    def num_blocks(self) -> int:
        """Physical blocks this event stores."""
        return len(self.block_hashes)

    @property
    def tokens_aligned(self) -> bool:
        """Whether `token_ids` splits into exactly `block_size` tokens per hash.

        vLLM skips null blocks (sliding-window groups) in `block_hashes` but not in `token_ids`; then
        which tokens belong to which hash is unknown.
        """
        return len(self.token_ids) == len(self.block_hashes) * self.block_size


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Cached blocks left a pod's prefix cache, one hash per physical copy."""

    block_hashes: tuple[BlockHash, ...]  # one per physical copy removed
    medium: str  # as in BlockStored
    group_idx: int  # as in BlockStored
    locality: str | None = None  # as in BlockStored

    @property
    def num_blocks(self) -> int:
        """Physical blocks this event removes."""
        return len(self.block_hashes)


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The pod's prefix cache was reset: every medium and group."""

    @property
    def num_blocks(self) -> int:
        """Always 0: a clear names no blocks."""
        return 0


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: the events of one engine step."""

    ts: float  # publisher's wall clock when the batch was made (seconds since the epoch)
    events: tuple[KVEvent, ...]  # in the order the server produced them
    data_parallel_rank: int | None  # vLLM's data_parallel_rank / SGLang's attn_dp_rank
    unknown_event_types: tuple[str, ...] = ()  # types of events skipped as unknown (newer servers)

    @property
    def num_block_events(self) -> int:
        """Blocks stored plus blocks removed."""
        return sum(event.num_blocks for event in self.events)


class BatchOrigin(enum.Enum):
    """How a batch reached the collector."""

    LIVE = "live"  # from the PUB socket
    REPLAY = "replay"  # from the replay socket, recovering a gap


@dataclass(frozen=True, slots=True)
class PodBatch:
    """A decoded, validated batch from one pod, in that pod's sequence order."""

    pod: str  # the pod's name (PodSource.name)
    seq: int  # the publisher's sequence number
    batch: EventBatch  # what was published
    received_at: float  # collector's wall clock at arrival (seconds since the epoch)
    origin: BatchOrigin  # live or replayed

    @property
    def lag_s(self) -> float:
        """Seconds between the publisher making the batch and the collector receiving it."""
        return self.received_at - self.batch.ts


class ResetReason(enum.Enum):
    """Why a pod's state must be dropped although it sent no AllBlocksCleared."""

    RESTARTED = "restarted"  # its sequence numbers started again: a new process, an empty cache


@dataclass(frozen=True, slots=True)
class PodReset:
    """Everything known about a pod's cache is void; batches that follow start from empty."""

    pod: str  # the pod's name
    reason: ResetReason  # why
    at: float  # collector's wall clock (seconds since the epoch)
    last_seq: int | None  # the last sequence number applied before the reset
    new_seq: int  # the sequence number that revealed it


class LinkState(enum.Enum):
    """A pod's SUB connection, as the collector's socket monitor reports it."""

    CONNECTING = "connecting"  # no connection yet, and no attempt refused
    CONNECTED = "connected"  # connected: the server's live batches arrive
    DISCONNECTED = "disconnected"  # was connected and lost it (the server went away); reconnecting
    REFUSED = "refused"  # every attempt refused: nothing listens at the endpoint (a server that is down,
    # or one whose PUB socket connects instead of binding); retrying


@dataclass(frozen=True, slots=True)
class PodStatus:
    """How the collector's link to a pod stands; sent when it changes, and every few seconds as a heartbeat."""

    pod: str  # the pod's name
    at: float  # collector's wall clock (seconds since the epoch)
    link: LinkState  # the SUB connection
    num_lost_batches: int  # sequence numbers neither live nor replay delivered, since the watch began
    num_restarts: int  # restarted servers detected since the watch began


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """One scrape of a pod's /metrics, reduced to the values the console keeps (None: not exposed)."""

    pod: str  # the pod's name
    at: float  # wall clock of the scrape
    prefix_cache_queries: float | None  # tokens looked up in the prefix cache since the server started
    prefix_cache_hits: float | None  # of which found cached
    num_preemptions: float | None  # requests preempted since the server started
    kv_cache_usage: float | None  # fraction of KV blocks in use, 0..1
    num_running: float | None  # requests running now
    num_waiting: float | None  # requests waiting now
    num_gpu_blocks: int | None  # the KV cache's capacity in blocks (vLLM's cache_config_info)
    error: str | None = None  # why the scrape failed (then every value is None)
    # vLLM's kv_block_idle_before_evict_seconds (with --kv-cache-metrics): cumulative (upper bound,
    # evictions) buckets, the last +Inf; None when not exposed. Kept by the live index only.
    idle_before_evict: tuple[tuple[float, float], ...] | None = None
