"""The cache namespace: everything that changes the computation, folded into the root of every key chain.

Two requests can share KV only when they would compute identical state: same model and weights, same
cache format and the same attention spec. Every field below is part of the root key, so a change to any
of them (or a different tenant salt) makes every lookup miss.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import xxhash

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
