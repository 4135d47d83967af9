"""Engine configuration: one frozen, validated value built once and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.core.eviction import EvictionPolicyName
from engine.core.kv_memory import DTYPE_BYTES
from engine.core.kv_tier import TIER_POLICIES

DEFAULT_MODEL = "smollm2"
DTYPES = tuple(DTYPE_BYTES)
DATA_DIR_ENV = "PREFIX_CONSOLE_DATA_DIR"

# Bounds on every size an operator can type (console and CLI validate against these).
MAX_BLOCK_SIZE = 256
MAX_NUM_BLOCKS = 1 << 20
MAX_NEW_TOKENS = 4096
MAX_BATCHED_TOKENS = 1 << 16
MAX_TOPIC_BYTES = 256
MAX_OFFLOAD_GIB = 1 << 14
_BIND_SCHEMES = ("tcp://", "ipc://", "inproc://")


def default_data_dir() -> Path:
    """Where converted weights and the SQLite history live: $PREFIX_CONSOLE_DATA_DIR, or ./data when it is
    unset or empty (an empty path would resolve to the working directory itself)."""
    return Path(os.environ.get(DATA_DIR_ENV) or "data").resolve()


@dataclass(frozen=True)
class EngineConfig:
    """Everything that fixes how the engine computes and how much memory it holds.

    Exactly one of `num_blocks` and `kv_memory_mb` sizes the pool; when both are None a default of
    1024 blocks is used.
    """

    model: str = DEFAULT_MODEL  # preset name ("smollm2", "tiny-llama", ...) or a local model directory
    device: str = "auto"  # "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:N"
    dtype: str = "float32"  # dtype of weights and KV blocks
    block_size: int = 16  # token slots per KV block
    num_blocks: int | None = None  # pool size in blocks
    kv_memory_mb: int | None = None  # pool size as a memory budget (converted to blocks)
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill + decode)
    max_num_seqs: int = 64  # most requests running at once
    eviction_policy: EvictionPolicyName = EvictionPolicyName.LRU  # which evictable block goes first (engine/core/eviction.py)
    seed: int = 0  # seeds random-weight presets and default sampling
    attention_override: str | None = None  # "sliding:W" (all layers) or "hybrid:W" (even layers sliding)
    window_backtrack: int = 0  # sliding layers: extra tokens of window state kept when caching
    allow_approximate_replay: bool = False  # may recover window state by a bounded approximate replay
    verify_replay: bool = False  # after an approximate replay, recompute from scratch and record divergence
    data_dir: Path | None = None  # None -> default_data_dir()
    # Opt-in feeds (engine/feeds/outbound.py `open_feeds`, which the console calls): vLLM's KV-event feed and metrics.
    kv_events_endpoint: str | None = None  # PUB socket to bind, e.g. "tcp://127.0.0.1:5557"; None: no feed
    kv_events_replay_endpoint: str | None = None  # replay ROUTER to bind, e.g. "tcp://127.0.0.1:5558"
    kv_events_topic: str = ""  # the feed's topic frame (vLLM's default is "")
    metrics_port: int | None = None  # Prometheus /metrics on 127.0.0.1:PORT (0: any free port); None: none
    # A second KV tier on local disk (engine/core/kv_tier.py): evicted full-attention blocks kept in files in
    # this directory, up to `offload_gib` GiB, and promoted back on a hit. None: no second tier (the default).
    offload_dir: Path | None = None
    offload_gib: float | None = None  # the tier's size; required with `offload_dir`
    offload_policy: str = "lru"  # the tier's eviction order: "lru" or "reuse-lru" (engine/core/kv_tier.py)

    def __post_init__(self) -> None:
        try:  # a name ("reuse-lru") is accepted and stored as the enum
            object.__setattr__(self, "eviction_policy", EvictionPolicyName(self.eviction_policy))
        except ValueError:
            names = ", ".join(policy.value for policy in EvictionPolicyName)
            raise ValueError(f"eviction_policy must be one of {names}, got {self.eviction_policy!r}") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.num_blocks is not None and self.kv_memory_mb is not None:
            raise ValueError("give num_blocks or kv_memory_mb, not both")
        if self.num_blocks is not None and not 1 <= self.num_blocks <= MAX_NUM_BLOCKS:
            raise ValueError(f"num_blocks must be in [1, {MAX_NUM_BLOCKS}], got {self.num_blocks}")
        if self.kv_memory_mb is not None and not 1 <= self.kv_memory_mb <= 1 << 20:
            raise ValueError(f"kv_memory_mb must be in [1, {1 << 20}], got {self.kv_memory_mb}")
        if not 1 <= self.max_num_batched_tokens <= MAX_BATCHED_TOKENS:
            raise ValueError(
                f"max_num_batched_tokens must be in [1, {MAX_BATCHED_TOKENS}], got {self.max_num_batched_tokens}"
            )
        if not 1 <= self.max_num_seqs <= 4096:
            raise ValueError(f"max_num_seqs must be in [1, 4096], got {self.max_num_seqs}")
        if not 0 <= self.window_backtrack <= MAX_BATCHED_TOKENS:
            raise ValueError(f"window_backtrack must be in [0, {MAX_BATCHED_TOKENS}], got {self.window_backtrack}")
        if not self.device == "auto" and not self.device == "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and (not isinstance(endpoint, str) or not endpoint.startswith(_BIND_SCHEMES)):
                raise ValueError(f"{name} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {endpoint!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if len(self.kv_events_topic.encode()) > MAX_TOPIC_BYTES:
            raise ValueError(f"kv_events_topic must be at most {MAX_TOPIC_BYTES} bytes")
        if (self.offload_dir is None) != (self.offload_gib is None):
            raise ValueError("give offload_dir and offload_gib together (a disk tier needs both), or neither")
        if self.offload_policy not in TIER_POLICIES:
            raise ValueError(f"offload_policy must be one of {', '.join(TIER_POLICIES)}, got {self.offload_policy!r}")
        if self.offload_dir is not None:
            object.__setattr__(self, "offload_dir", Path(self.offload_dir))
            if not 0 < float(self.offload_gib or 0) <= MAX_OFFLOAD_GIB:
                raise ValueError(f"offload_gib must be in (0, {MAX_OFFLOAD_GIB}], got {self.offload_gib}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir if self.data_dir is not None else default_data_dir()


def shares_disk_tier(a: EngineConfig, b: EngineConfig) -> bool:
    """Whether two configurations name the same disk tier directory: the second engine can open it only after
    the first closed it (`Engine.close`), so a restart between them hands the tier over in that order."""
    if a.offload_dir is None or b.offload_dir is None:
        return False
    return Path(a.offload_dir).resolve() == Path(b.offload_dir).resolve()
