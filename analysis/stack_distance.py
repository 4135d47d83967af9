"""The whole LRU hit curve in one pass over the trace, from stack distances.

In the sequential mode an LRU cache of C blocks holds exactly the C most recently released blocks (a
request releases its blocks tail first, so after it they are the top of the recency stack in order,
first block on top; a request larger than C leaves its first C blocks, as the simulator's rule says).
So block i of a request is cached at arrival, at capacity C, exactly when its *stack depth* (how many
distinct blocks were released after its own last release) is below C; never-seen blocks have infinite
depth. The request hits its leading blocks, so

    k(C) = #{ i : max(depth_0, ..., depth_i) < C }

and with the running maximum `prefix_depth_i` of the leading depths, each block reference adds its
tokens to the hit tokens of every capacity above `prefix_depth_i`. One pass yields every capacity.

Depths come from a Fenwick tree over release times: each block keeps one mark, at its last release;
the depth of a block is the number of marks after its own. A request's depths are all read before it
releases anything, one vectorised query per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from analysis.policies import Policy
from analysis.sequential import PROGRESS_EVERY, PolicyRun
from analysis.trace import Trace

INFINITE_DEPTH = np.iinfo(np.int64).max  # the stack depth of a block never seen before


class _Fenwick:
    """Counts over positions 1..size, with vectorised point updates and prefix sums."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._levels = max(1, size.bit_length())
        # Slot 0 is a sink for finished query paths, slot size + 1 for finished update paths.
        self._tree = np.zeros(size + 2, dtype=np.int64)

    def prefix_sums(self, positions: np.ndarray) -> np.ndarray:
        """For each position p (0 <= p <= size), the sum of counts at 1..p."""
        index = positions.copy()
        total = np.zeros(len(positions), dtype=np.int64)
        for _ in range(self._levels):
            total += self._tree[index]  # tree[0] stays 0
            index &= index - 1
        return total

    def add(self, positions: np.ndarray, deltas: np.ndarray) -> None:
        """Add deltas[j] at positions[j] (1 <= p <= size; repeated positions add up)."""
        index = positions.copy()
        sink = self._size + 1
        for _ in range(self._levels):
            np.add.at(self._tree, index, deltas)
            index += index & -index
            index[index > self._size] = sink
        self._tree[sink] = 0


@dataclass(frozen=True, eq=False)
class LruCurve:
    """Hit tokens of the LRU sequential cache at every capacity, from one pass."""

    trace: Trace  # the trace it describes
    prefix_depths: np.ndarray  # int64 per reference: the running maximum of the leading stack depths
    _sorted_depths: np.ndarray  # prefix_depths, sorted
    _cumulative_tokens: np.ndarray  # tokens of the references in _sorted_depths order, cumulated, from 0

    def hit_tokens(self, capacity_blocks: int) -> int:
        """Prompt tokens hit by an LRU cache of `capacity_blocks` blocks."""
        return int(self._cumulative_tokens[np.searchsorted(self._sorted_depths, capacity_blocks, side="left")])

    def hit_tokens_at(self, capacities_blocks: Iterable[int]) -> np.ndarray:
        """int64: `hit_tokens` at each capacity."""
        capacities = np.asarray(list(capacities_blocks), dtype=np.int64)
        return self._cumulative_tokens[np.searchsorted(self._sorted_depths, capacities, side="left")]

    def hit_references_at(self, capacities_blocks: Iterable[int]) -> np.ndarray:
        """int64: at each capacity, how many block references hit (each is one block found in the cache)."""
        capacities = np.asarray(list(capacities_blocks), dtype=np.int64)
        return np.searchsorted(self._sorted_depths, capacities, side="left").astype(np.int64)

    @property
    def max_hit_tokens(self) -> int:
        """Prompt tokens hit by an infinite cache."""
        return int(self._cumulative_tokens[np.searchsorted(self._sorted_depths, INFINITE_DEPTH, side="left")])

    def hit_blocks(self, capacity_blocks: int) -> np.ndarray:
        """int64 per request: its leading blocks cached at arrival, at `capacity_blocks`."""
        trace = self.trace
        present = (self.prefix_depths < capacity_blocks).astype(np.int64)
        return np.bincount(trace.request_of_reference, weights=present, minlength=len(trace)).astype(np.int64)

    def run(self, capacity_blocks: int) -> PolicyRun:
        """The LRU simulation's result at `capacity_blocks`, read off the curve."""
        return PolicyRun(Policy.LRU, capacity_blocks, self.hit_blocks(capacity_blocks))

    def min_capacity_for(self, hit_tokens: int) -> int:
        """The smallest capacity in blocks at which an LRU cache hits at least `hit_tokens`.

        Raises:
            ValueError: even an infinite cache hits fewer (`hit_tokens > max_hit_tokens`).
        """
        if hit_tokens > self.max_hit_tokens:
            raise ValueError(f"no capacity hits {hit_tokens} tokens (an infinite cache hits {self.max_hit_tokens})")
        references = int(np.searchsorted(self._cumulative_tokens, hit_tokens, side="left"))
        return 0 if references == 0 else int(self._sorted_depths[references - 1]) + 1


def reference_tokens(trace: Trace) -> np.ndarray:
    """int64 per reference: the prompt tokens its block covers (a partial last block covers fewer)."""
    tokens = np.full(trace.num_references, trace.block_size, dtype=np.int64)
    counts = trace.blocks_per_request
    has_blocks = counts > 0
    last = trace.block_starts[1:][has_blocks] - 1
    tail = trace.input_lengths[has_blocks] - (counts[has_blocks] - 1) * trace.block_size
    tokens[last] = np.minimum(tail, trace.block_size)
    return tokens


def lru_curve(trace: Trace, on_requests: Callable[[int], None] | None = None) -> LruCurve:
    """One pass over `trace`: the LRU hit tokens at every capacity.

    Args:
        trace: the requests.
        on_requests: called with the number of requests done so far, every `PROGRESS_EVERY` requests
            and at the end.
    """
    dense = trace.dense.ids
    starts = trace.block_starts
    releases = _Fenwick(trace.num_references)
    last_release = np.zeros(trace.unique_blocks, dtype=np.int64)  # 0: never released
    prefix_depths = np.empty(trace.num_references, dtype=np.int64)
    seen = 0  # distinct blocks released so far (= marks in the tree)
    clock = 0  # releases so far
    for request in range(len(trace)):
        low, high = int(starts[request]), int(starts[request + 1])
        blocks = dense[low:high]
        last = last_release[blocks]
        known = last > 0
        depths = np.full(len(blocks), INFINITE_DEPTH, dtype=np.int64)
        depths[known] = seen - releases.prefix_sums(last[known])
        prefix_depths[low:high] = np.maximum.accumulate(depths) if len(blocks) else depths
        # Release tail first: block i gets time clock + n - i, so the first block is the latest.
        now = clock + len(blocks) - np.arange(len(blocks), dtype=np.int64)
        releases.add(
            np.concatenate((last[known], now)),
            np.concatenate((np.full(int(known.sum()), -1, dtype=np.int64), np.ones(len(blocks), dtype=np.int64))),
        )
        last_release[blocks] = now
        seen += len(blocks) - int(known.sum())
        clock += len(blocks)
        if on_requests is not None and (request + 1) % PROGRESS_EVERY == 0:
            on_requests(request + 1)
    if on_requests is not None:
        on_requests(len(trace))
    order = np.argsort(prefix_depths, kind="stable")
    cumulative = np.concatenate(([0], np.cumsum(reference_tokens(trace)[order])))
    prefix_depths.flags.writeable = False
    return LruCurve(trace, prefix_depths, prefix_depths[order], cumulative)
