"""Why the misses happened, which prefixes saved the most, and hits per request type.

Every function takes a trace and per-request hit blocks (a `PolicyRun.hit_blocks`, or the infinite
cache's `infinite_hit_blocks`), so they serve any policy, capacity or mode alike.

A request's prompt tokens split into

    hit | pinned | capacity | namespace | compulsory | partial
        k        k_ref      k_inf       k_any        n          (block counts; tokens are
                                                                  min(blocks * block_size, input_length))

  * hit: its first `k` blocks were cached;
  * pinned (timed mode): blocks `k..k_ref-1` were hit by the same pool serving one request at a time
    (`k_ref`, the sequential reference) but missed here: running requests held the room they needed;
  * capacity: blocks up to `k_inf - 1` had all been seen before (an infinite cache would have hit
    them), but this cache had evicted them or a block before them;
  * namespace (own workloads, whose blocks carry content ids): blocks up to `k_any - 1` hold tokens
    seen before at the same positions, but under another model revision, dtype or tenant salt, so no
    key matched (block sizes never mix in one trace: the readers take one);
  * compulsory: from the first block whose prefix was never seen before (no cache of any size holds
    it). In a trace whose ids always follow the same parent, as prefix hashes do, that block is the
    first one whose id is new;
  * partial: past the last full block, in a workload that caches full blocks only (never cacheable;
    zero in hash-id traces, whose last block is cached); in the timed mode also the block of the last
    prompt token when it is full (the engine computes that token again, for its logits).

`k_inf` and `k_any` are the trace's `HitBounds`, computed once per trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis.sequential import infinite_hit_blocks, leading_seen_blocks
from analysis.trace import Trace
from engine.core.errors import InvariantError


@dataclass(frozen=True, eq=False)
class HitBounds:
    """Per request, the leading blocks no cache of any size could hit beyond (see the module docstring)."""

    hittable: np.ndarray  # int64: blocks a lookup may hit at all (all of them; the engine: not the last token's)
    infinite: np.ndarray  # int64: leading blocks seen before under the same namespace (the infinite cache)
    any_namespace: np.ndarray  # int64: leading blocks whose tokens were seen before under any namespace


def hit_bounds(trace: Trace, *, engine_cap: bool = False) -> HitBounds:
    """The trace's bounds; `any_namespace` equals `infinite` for a trace without content ids.

    Args:
        trace: the requests.
        engine_cap: bound every hit by the engine's lookup cap, `(input_length - 1) // block_size` blocks
            (the last token is always computed, for its logits): the timed mode's hits are the engine's.
    """
    hittable = trace.blocks_per_request
    if engine_cap:
        hittable = np.minimum(hittable, (trace.input_lengths - 1) // trace.block_size)
    infinite = np.minimum(infinite_hit_blocks(trace), hittable)
    if trace.content_ids is None:
        return HitBounds(hittable, infinite, infinite)
    _, dense_content = np.unique(trace.content_ids, return_inverse=True)
    any_namespace = leading_seen_blocks(dense_content.astype(np.int64), trace.block_starts)
    return HitBounds(hittable, infinite, np.maximum(np.minimum(any_namespace, hittable), infinite))


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


def miss_breakdown(
    trace: Trace, hit_blocks: np.ndarray, bounds: HitBounds, reference_blocks: np.ndarray | None = None
) -> MissBreakdown:
    """Missed tokens by reason, for per-request `hit_blocks` within the trace's `bounds`.

    Args:
        trace: the requests.
        hit_blocks: int64 per request: leading blocks hit.
        bounds: `hit_bounds(trace)`.
        reference_blocks: timed mode: the sequential reference's hits at the same pool size; what it
            hit and this run did not is `pinned`. None: no reference (pinned is 0).

    Raises:
        InvariantError: a request hit more blocks than the infinite cache (a simulation bug).
    """
    if np.any(hit_blocks > bounds.infinite):
        raise InvariantError("a cache hit more leading blocks than the infinite cache")
    hit = trace.hit_tokens(hit_blocks)
    reusable = trace.hit_tokens(bounds.infinite)
    seen = trace.hit_tokens(bounds.any_namespace)
    cacheable = trace.hit_tokens(bounds.hittable)
    pinned = 0
    if reference_blocks is not None:
        reference = trace.hit_tokens(np.minimum(reference_blocks, bounds.infinite))
        pinned = int(np.maximum(reference - hit, 0).sum())
    return MissBreakdown(
        compulsory=int((cacheable - seen).sum()),
        capacity=int((reusable - hit).sum()) - pinned,
        partial=int((trace.input_lengths - cacheable).sum()),
        pinned=pinned,
        namespace=int((seen - reusable).sum()),
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
