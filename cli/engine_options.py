"""The engine options every command that runs an engine takes (run-trace, serve), and the
`EngineConfig` they name: one set of flags, one set of defaults, checked by `EngineConfig` itself."""

from __future__ import annotations

import argparse
from typing import Any

from engine.core.config import DEFAULT_MODEL, DTYPES, EngineConfig
from engine.core.eviction import EvictionPolicyName
from engine.core.kv_tier import TIER_POLICIES


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """--model, --block-size, --num-blocks, --eviction-policy, --device, --dtype, --seed, --attention,
    --offload-dir, --offload-gib, --offload-policy."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local model directory")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument(
        "--eviction-policy", choices=[p.value for p in EvictionPolicyName], default=EvictionPolicyName.LRU.value,
        help="which evictable block the pool gives up first (engine/core/eviction.py)",
    )  # fmt: skip
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention", "--attention-override", dest="attention", default=None,
        help="'sliding:W' or 'hybrid:W' (even layers sliding)",
    )  # fmt: skip
    parser.add_argument(
        "--offload-dir", default=None,
        help="a second KV tier on local disk: evicted blocks kept in files here (with --offload-gib)",
    )  # fmt: skip
    parser.add_argument("--offload-gib", type=float, default=None, help="the disk tier's size in GiB")
    parser.add_argument(
        "--offload-policy", choices=TIER_POLICIES, default="lru",
        help="the disk tier's eviction order: lru, or reuse-lru (blocks promoted before are kept longer)",
    )  # fmt: skip


def engine_config(args: argparse.Namespace, **more: Any) -> EngineConfig:
    """The engine configuration the options name, with `more` of EngineConfig's fields on top.

    Raises:
        ValueError: an option out of its bounds (EngineConfig's message).
    """
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        eviction_policy=EvictionPolicyName(args.eviction_policy),
        seed=args.seed,
        attention_override=args.attention,
        offload_dir=args.offload_dir,
        offload_gib=args.offload_gib,
        offload_policy=args.offload_policy,
        **more,
    )
