"""An engine's parts, built from its configuration and its loaded model.

The torch side (the model runner, the step's forward, the replay verifier, the thread governor) around
the torch-free core that engine/core/assembly.py builds (the KV groups' coordinator and the scheduler),
all over one event log and one cache namespace. engine/engine.py holds them and drives them; nothing
here keeps state of its own.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.core.admission import ModelLimits
from engine.core.assembly import EngineCore, build_core
from engine.core.config import EngineConfig
from engine.core.events import EventLog
from engine.core.kv_memory import pool_num_blocks
from engine.core.namespace import CacheNamespace
from engine.core.kv_tier import TierIndex
from engine.forward import StepForward
from engine.runner.kv_tier_files import TierFiles, TierGeometry
from engine.runner.kv_tier_io import DiskTier
from engine.runner.model_loading import LoadedModel
from engine.runner.model_runner import ModelRunner
from engine.runner.thread_governor import ThreadGovernor
from engine.runner.verify import ReplayVerifier


class EngineParts(NamedTuple):
    runner: ModelRunner
    log: EventLog  # every part emits its events here
    namespace: CacheNamespace  # the root of every chain key: model, weights, dtype, block size, attention
    core: EngineCore  # the KV coordinator and the scheduler
    verifier: ReplayVerifier | None  # only when asked for: it keeps logits of approximate replays
    forward: StepForward
    thread_governor: ThreadGovernor | None  # None: the thread count stays as set
    limits: ModelLimits  # what admission holds requests to


def pool_size(config: EngineConfig, loaded: LoadedModel) -> int:
    """Blocks in the pool: `num_blocks`, or as many as `kv_memory_mb` holds, or the default
    (engine/core/kv_memory.py's `pool_num_blocks`, the console's rule too)."""
    bytes_per_block = ModelRunner.bytes_per_block(loaded, config.block_size)
    return pool_num_blocks(config.num_blocks, config.kv_memory_mb, bytes_per_block)


def build_parts(config: EngineConfig, loaded: LoadedModel) -> EngineParts:
    """Every part of an engine of `config` over `loaded`, wired together, with pools of `pool_size` blocks."""
    num_blocks = pool_size(config, loaded)
    runner = ModelRunner(loaded, num_blocks, config.block_size)
    log = EventLog()
    namespace = CacheNamespace(
        model_id=loaded.model_id,
        weights_revision=loaded.weights_revision,
        dtype=config.dtype,
        block_size=config.block_size,
        attention_spec=loaded.attention_spec,
    )
    disk, index = open_disk_tier(config, runner, namespace, log)
    core = build_core(config, runner.groups, namespace, log, num_blocks, eos_token_ids=loaded.eos_token_ids, tier=index)
    verifier = ReplayVerifier(runner, log) if config.verify_replay else None
    limits = ModelLimits(int(loaded.model.config.vocab_size), int(loaded.max_position_embeddings))
    governor = ThreadGovernor.for_device(loaded.device)
    forward = StepForward(runner, core.kv, verifier, disk)
    return EngineParts(runner, log, namespace, core, verifier, forward, governor, limits)


def open_disk_tier(
    config: EngineConfig, runner: ModelRunner, namespace: CacheNamespace, log: EventLog
) -> tuple[DiskTier | None, TierIndex | None]:
    """The disk tier `config.offload_dir` names (its byte copies and its index, warm with what the directory
    holds), behind the full-attention group's pool; (None, None) without one.

    Raises:
        ValueError: an all-sliding model (no full-attention group to offload).
        TierUnavailableError, TierMismatchError: the directory cannot serve this engine
            (engine/runner/kv_tier_files.py).
    """
    if config.offload_dir is None or config.offload_gib is None:
        return None, None
    full = next((g for g, spec in enumerate(runner.groups) if spec.window is None), None)
    if full is None:
        raise ValueError("the disk tier holds full-attention blocks: an all-sliding model has none to offload")
    kv = runner.kv[full]
    block_shape = (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[5])
    geometry = TierGeometry.sized(block_shape, kv.element_size(), config.offload_gib)
    disk = DiskTier(TierFiles(config.offload_dir, namespace, geometry), kv)
    index = TierIndex(geometry.num_slots, config.block_size, geometry.slot_bytes, disk.writes, log, config.offload_policy)
    index.restore(disk.files.restored)
    return disk, index
