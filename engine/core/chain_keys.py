"""Chain keys: the key of a full block (`chain_key`), and a context's keys kept as lookups reach them.

Pure Python: no torch. A full block's key chains its parent's key with its own tokens, so the key of
logical block i depends only on the root (the namespace and the request's salt) and the context's first
(i + 1) * block_size tokens: it names those exact tokens at those positions (engine/core/block_pool.py
confirms the tokens on every hit all the same). A context only
grows, so a key once computed stays right: a request keeps its `ChainKeys` (engine/core/request.py), and
the lookups it repeats while it waits to start hash no block twice.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

import xxhash

# Token ids -> bytes, by block length: a compiled struct packs a block in a third less time than an array.
_TOKEN_PACKERS: dict[int, Callable[..., bytes]] = {}


def chain_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """The cache key of a full block: a 128-bit hash over its parent's key and its token ids (each as
    4 little-endian bytes, so keys are the same on every platform)."""
    pack = _TOKEN_PACKERS.get(len(token_ids))
    if pack is None:
        pack = _TOKEN_PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}I").pack
    return xxhash.xxh3_128_digest(parent_key + pack(*token_ids))


class ChainKeys:
    """The chain keys of one context's leading full blocks under one root, extended on demand.

    Invariant: `key(i, ...)` is `chain_key(key(i - 1, ...), block i's tokens)`, with the root before
    block 0; every call passes the same context (or a longer one: only its first blocks are ever read).
    """

    def __init__(self, root_key: bytes, block_size: int) -> None:
        self.root_key = root_key  # the namespace root (with the salt) block 0 hangs from
        self.block_size = block_size
        self._keys: list[bytes] = []  # keys of blocks [0, len), computed so far

    def __len__(self) -> int:
        """How many keys are computed so far."""
        return len(self._keys)

    def key(self, index: int, token_ids: Sequence[int]) -> bytes:
        """The key of full block `index` of the context `token_ids`, hashing only the blocks up to it
        that no earlier call reached."""
        keys, size = self._keys, self.block_size
        while len(keys) <= index:
            start = len(keys) * size
            keys.append(chain_key(keys[-1] if keys else self.root_key, token_ids[start : start + size]))
        return keys[index]

    def first(self, num_blocks: int, token_ids: Sequence[int]) -> list[bytes]:
        """The keys of the context's first `num_blocks` full blocks (a new list)."""
        if num_blocks > 0:
            self.key(num_blocks - 1, token_ids)
        return self._keys[:num_blocks]
