"""The engine's torch-free core, built from its configuration.

Pure Python: no torch. The engine (engine/engine.py) and the workload analyzer's timed mode
(analysis/timed.py) both build their core here, so both run the same parts wired the same way:

    per KV group:   BlockPool (its own eviction policy) -> FullAttentionManager | SlidingWindowManager
    over them all:  KVCoordinator (the window policy) -> Scheduler (the batching limits)

Both refuse a request that can never fit by one rule too: engine/core/admission.py's `never_fits`.
"""

from __future__ import annotations

from typing import Collection, NamedTuple, Sequence

from engine.core.block_pool import BlockPool
from engine.core.config import EngineConfig
from engine.core.events import EventLog
from engine.core.eviction import EvictionPolicy, make_eviction_policy
from engine.core.full_attention_manager import FullAttentionManager
from engine.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from engine.core.kv_coordinator import KVCoordinator
from engine.core.kv_groups import KVGroupSpec, WindowPolicy
from engine.core.kv_tier import TierIndex
from engine.core.namespace import CacheNamespace
from engine.core.scheduler import Scheduler
from engine.core.sliding_window_manager import SlidingWindowManager


class EngineCore(NamedTuple):
    """The bookkeeping half of an engine: the KV groups' coordinator and the scheduler over it."""

    kv: KVCoordinator  # its managers hold the pools (`kv.managers[g].pool`)
    scheduler: Scheduler


def build_core(
    config: EngineConfig,
    groups: Sequence[KVGroupSpec],
    namespace: CacheNamespace,
    log: EventLog,
    num_blocks: int,
    *,
    eos_token_ids: Collection[int] = (),
    eviction: EvictionPolicy | None = None,
    tier: TierIndex | None = None,
) -> EngineCore:
    """Build the pools, managers, coordinator and scheduler of a model with these KV groups.

    Args:
        config: the batching limits, eviction policy, window backtrack and approximate replay.
        groups: the model's KV groups (engine/core/kv_groups.py's `kv_groups`), full group first.
        namespace: the cache namespace; its block size is the pools' (`config.block_size` is not read, so
            that the analyzer may replay a trace of a block size the engine does not offer).
        log: where every part emits its events (and reads its clock).
        num_blocks: blocks in each group's pool.
        eos_token_ids: tokens that end a request.
        eviction: a fresh eviction policy for the pool of a one-group model (the analyzer brings its
            own); None gives every pool `config.eviction_policy`.
        tier: the disk tier's index behind the full group's pool (engine/core/kv_tier.py); None: none.

    Raises:
        ValueError: `eviction` given for more than one group.
    """
    if eviction is not None and len(groups) != 1:
        raise ValueError("an eviction policy instance serves one pool: give it only for a one-group model")
    managers = []
    for spec in groups:
        policy = eviction if eviction is not None else make_eviction_policy(config.eviction_policy, num_blocks)
        pool = BlockPool(
            num_blocks, namespace.block_size, log, group=spec.name, chained=spec.window is None, eviction=policy
        )
        managers.append(_manager(spec, pool, namespace, log, config.window_backtrack))
    window_policy = WindowPolicy(config.window_backtrack, config.allow_approximate_replay)
    kv = KVCoordinator(groups, managers, window_policy, log, tier)
    return EngineCore(kv, Scheduler(config, kv, log, eos_token_ids))


def _manager(
    spec: KVGroupSpec, pool: BlockPool, namespace: CacheNamespace, log: EventLog, backtrack: int
) -> SingleTypeKVCacheManager:
    """The manager of one group's attention type: a sliding group's keeps W + `backtrack` tokens of state."""
    if spec.window is None:
        return FullAttentionManager(pool, namespace, log)
    return SlidingWindowManager(pool, namespace, log, window=spec.window, retain_tokens=spec.window + backtrack)

