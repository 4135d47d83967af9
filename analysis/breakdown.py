"""Why the misses happened, which prefixes saved the most, and hits per request type.

Every function takes a trace and per-request hit blocks (a `PolicyRun.hit_blocks`, or the infinite
cache's `infinite_hit_blocks`), so they serve any policy, capacity or mode alike.

A request's prompt tokens split into

    hit | capacity | compulsory | partial
        k          k_inf        n          (block counts; tokens are min(blocks * block_size, input_length))

  * hit: its first `k` blocks were cached;
  * capacity: blocks `k..k_inf-1` had all been seen before (an infinite cache would have hit them), but
    this cache had evicted them or a block before them;
  * compulsory: from the first block whose prefix was never seen before (no cache of any size holds
    it). In a trace whose ids always follow the same parent, as prefix hashes do, that block is the
    first one whose id is new;
  * partial: past the last full block, in a workload that caches full blocks only (never cacheable;
    zero in hash-id traces, whose last block is cached).

The slots `pinned` (timed mode: no room while running requests held the pool) and `namespace` (the
same tokens cached under another model revision, dtype, block size or tenant salt) are filled by the
modes and workloads that can tell; they are zero here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis.trace import Trace
from engine.errors import InvariantError


@dataclass(frozen=True, slots=True)
class MissBreakdown:
    """Missed prompt tokens by reason (see the module docstring)."""

    compulsory: int  # the prefix was never seen before
    capacity: int  # seen before, evicted (it or a block before it) before this reuse
    partial: int  # past the last full block of a full-blocks-only workload
    pinned: int  # timed mode: the pool was full of blocks held by running requests
    namespace: int  # cached under another namespace (own workloads)

    @property
    def total(self) -> int:
        """All missed tokens."""
        return self.compulsory + self.capacity + self.partial + self.pinned + self.namespace


@dataclass(frozen=True, slots=True)
class TypeHits:
    """Hits of the requests of one type (Bailian's `type` tag)."""

    request_type: str  # the tag
    requests: int  # requests of this type
    input_tokens: int  # their prompt tokens
    hit_tokens: int  # of which hit

    @property
    def hit_ratio(self) -> float:
        """hit_tokens / input_tokens."""
        return self.hit_tokens / self.input_tokens


@dataclass(frozen=True, slots=True)
class PrefixSavings:
    """One hit prefix: the exact leading chain of blocks some requests hit, and what it saved them."""

    first_block: int  # the chain's first block id
    last_block: int  # its last block id (in a prefix-hash trace, this alone names the chain)
    depth: int  # its length in blocks
    requests: int  # requests whose hit was exactly this chain
    tokens_saved: int  # prompt tokens those requests did not recompute


def miss_breakdown(trace: Trace, hit_blocks: np.ndarray, infinite_blocks: np.ndarray) -> MissBreakdown:
    """Missed tokens by reason, for per-request `hit_blocks` against the infinite cache's.

    Raises:
        InvariantError: a request hit more blocks than the infinite cache (a simulation bug).
    """
    if np.any(hit_blocks > infinite_blocks):
        raise InvariantError("a cache hit more leading blocks than the infinite cache")
    hit = trace.hit_tokens(hit_blocks)
    reusable = trace.hit_tokens(infinite_blocks)
    cacheable = trace.hit_tokens(trace.blocks_per_request)
    return MissBreakdown(
        compulsory=int((cacheable - reusable).sum()),
        capacity=int((reusable - hit).sum()),
        partial=int((trace.input_lengths - cacheable).sum()),
        pinned=0,
        namespace=0,
    )


def hits_by_type(trace: Trace, hit_blocks: np.ndarray) -> tuple[TypeHits, ...]:
    """Hits per request type, in the order types first appear; empty if the trace has no types."""
    if trace.type_codes is None:
        return ()
    hit = trace.hit_tokens(hit_blocks)
    result = []
    for code, name in enumerate(trace.type_names):
        mine = trace.type_codes == code
        result.append(
            TypeHits(name, int(mine.sum()), int(trace.input_lengths[mine].sum()), int(hit[mine].sum()))
        )
    return tuple(result)


def top_prefixes(trace: Trace, hit_blocks: np.ndarray, limit: int) -> tuple[PrefixSavings, ...]:
    """The `limit` hit prefixes that saved the most tokens (ties: deeper first, then by first block id).

    A request whose first `k > 0` blocks hit counts for the chain of exactly those `k` ids.
    """
    saved_by_chain: dict[bytes, list[int]] = {}  # chain ids as bytes -> [requests, tokens saved, request]
    hit = trace.hit_tokens(hit_blocks)
    starts = trace.block_starts
    for request in np.flatnonzero(hit_blocks > 0).tolist():
        start = int(starts[request])
        chain = trace.block_ids[start : start + int(hit_blocks[request])].tobytes()
        entry = saved_by_chain.setdefault(chain, [0, 0, request])
        entry[0] += 1
        entry[1] += int(hit[request])
    ranked = []
    for requests, tokens, example in saved_by_chain.values():
        start, depth = int(starts[example]), int(hit_blocks[example])
        first, last = int(trace.block_ids[start]), int(trace.block_ids[start + depth - 1])
        ranked.append(PrefixSavings(first, last, depth, requests, tokens))
    ranked.sort(key=lambda prefix: (-prefix.tokens_saved, -prefix.depth, prefix.first_block, prefix.last_block))
    return tuple(ranked[:limit])
