"""The cache namespace: everything that changes the computation, folded into the root of every key chain.

Two requests can share KV only when they would compute identical state: same model and weights, same
cache format and the same attention spec. Every field below is part of the root key, so a change to any
of them (or a different tenant salt) makes every lookup miss.

A salt becomes a root key in one place: `NamespaceRoots.root_key`, which the scheduler calls once per
admission plan (engine/core/scheduler.py); the plan carries the root to the coordinator and the managers
(engine/core/kv_groups.py's `HitPlan.root_key`), which take it and never derive one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

import xxhash

if TYPE_CHECKING:
    from engine.core.block_pool import BlockPool

KV_LAYOUT_VERSION = 1  # bump when the block tensor layout changes
# The root of namespace-free key chains: equal tokens at equal positions get equal content keys under every
# model, dtype and salt (the history keeps them so the analyzer can tell namespace misses; engine/core/request.py).
CONTENT_ROOT_KEY = xxhash.xxh3_128_digest(b"prefix-console/content\0")


@dataclass(frozen=True)
class CacheNamespace:
    model_id: str  # preset name or model path as loaded
    weights_revision: str  # fingerprint of the weights actually loaded
    dtype: str  # KV and weight dtype ("float32", ...)
    block_size: int  # token slots per block
    attention_spec: tuple[str, ...]  # per layer: "full" or "sliding:W"
    kv_layout_version: int = KV_LAYOUT_VERSION

    def text(self, salt: str | None = None) -> str:
        """A canonical text of the namespace plus a tenant salt (None and "" are distinct from any salt)."""
        fields = asdict(self)
        fields["attention_spec"] = list(self.attention_spec)
        fields["salt"] = salt
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def root_key(self, salt: str | None = None) -> bytes:
        """The 128-bit root every key chain under this namespace (and salt) hangs from."""
        return xxhash.xxh3_128_digest(b"prefix-console/ns\0" + self.text(salt).encode())


class NamespaceRoots:
    """Each salt's root key under one namespace, bound in every pool that may cache under it.

    Invariant: a root `root_key` returns is registered with every pool given (a pool refuses to cache under
    a root it does not know, and a second namespace text under a known key), and it is derived once per
    salt (the namespace is frozen, so a salt's root never changes).
    """

    def __init__(self, namespace: CacheNamespace, pools: Sequence[BlockPool]) -> None:
        self.namespace = namespace
        self._pools = tuple(pools)
        self._roots: dict[str | None, bytes] = {}  # salt -> its root, registered with every pool

    def root_key(self, salt: str | None) -> bytes:
        """The root every key chain of `salt`'s requests hangs from; registered with every pool on first
        use, and a later call changes nothing."""
        root = self._roots.get(salt)
        if root is None:
            root = self.namespace.root_key(salt)
            text = self.namespace.text(salt)
            for pool in self._pools:
                pool.register_root(root, text)
            self._roots[salt] = root
        return root
