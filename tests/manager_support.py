"""A KV cache manager driven alone, without a coordinator or scheduler: its salts' roots come from the
engine's one resolver (engine/core/namespace.py's `NamespaceRoots`), as an admission's do."""

from __future__ import annotations

from engine.core.block import Block
from engine.core.chain_keys import ChainKeys
from engine.core.full_attention_manager import FullAttentionManager
from engine.core.namespace import NamespaceRoots
from engine.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


def root_key(manager: SingleTypeKVCacheManager, salt: str | None = None) -> bytes:
    """`salt`'s root under the manager's namespace, registered with its pool."""
    return NamespaceRoots(manager.namespace, [manager.pool]).root_key(salt)


def find_hit(manager: FullAttentionManager, tokens: list[int], salt: str | None = None) -> list[Block]:
    """The manager's prefix hit for `tokens` under `salt`'s root, hashed afresh."""
    return manager.find_prefix_hit(tokens, ChainKeys(root_key(manager, salt), manager.block_size))
