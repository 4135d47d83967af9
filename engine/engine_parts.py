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
from engine.forward import StepForward
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
    core = build_core(config, runner.groups, namespace, log, num_blocks, eos_token_ids=loaded.eos_token_ids)
    verifier = ReplayVerifier(runner, log) if config.verify_replay else None
    limits = ModelLimits(int(loaded.model.config.vocab_size), int(loaded.max_position_embeddings))
    governor = ThreadGovernor.for_device(loaded.device)
    return EngineParts(runner, log, namespace, core, verifier, StepForward(runner, core.kv, verifier), governor, limits)
