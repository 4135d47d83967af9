"""Helpers for the analysis tests: hand-made traces, Hypothesis strategies, an exhaustive optimum."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

from hypothesis import strategies as st

from analysis.errors import NoVictimError
from analysis.policies import KeyEvictionPolicy
from analysis.trace import PartialBlocks, Trace, TraceFormat, TraceRequest

DATA = Path(__file__).resolve().parent.parent / "analysis" / "samples"  # shipped with their licence note
CONVERSATION_SAMPLE = DATA / "mooncake_conversation_sample.jsonl"
SYNTHETIC_SAMPLE = DATA / "mooncake_synthetic_sample.jsonl"
BAILIAN_SAMPLE = DATA / "bailian_sample.jsonl"
BLOCK_SIZE = 4  # tokens per block in hand-made traces


def trace_of(chains: list[list[int]], lengths: list[int] | None = None, types: list[str] | None = None) -> Trace:
    """A trace of `chains` (block ids per request) at BLOCK_SIZE, one request per second.

    `lengths` defaults to full blocks (`len(chain) * BLOCK_SIZE` tokens each).
    """
    lengths = lengths or [len(chain) * BLOCK_SIZE for chain in chains]
    requests = [
        TraceRequest(
            arrival_s=float(i),
            input_length=lengths[i],
            output_length=1,
            block_ids=tuple(chain),
            block_size=BLOCK_SIZE,
            request_type=None if types is None else types[i],
        )
        for i, chain in enumerate(chains)
    ]
    return Trace.from_requests(requests, TraceFormat.MOONCAKE, PartialBlocks.CACHED)


@st.composite
def prefix_chains(draw, max_requests: int = 12, max_new: int = 4) -> list[list[int]]:
    """Requests whose ids always follow the same parent, like prefix hashes: each request continues a
    leading part of an earlier one (or starts afresh) with 0..max_new new blocks."""
    chains: list[list[int]] = []
    next_id = 0
    for _ in range(draw(st.integers(1, max_requests))):
        base: list[int] = []
        if chains and draw(st.booleans()):
            earlier = draw(st.sampled_from(chains))
            base = earlier[: draw(st.integers(0, len(earlier)))]
        new = draw(st.integers(0 if base else 1, max_new))
        chains.append(base + list(range(next_id, next_id + new)))
        next_id += new
    return chains


@st.composite
def any_chains(draw, max_requests: int = 12, max_len: int = 5, ids: int = 8) -> list[list[int]]:
    """Requests of distinct ids drawn from a small alphabet, in any order (not prefix-consistent)."""
    count = draw(st.integers(1, max_requests))
    return [
        draw(st.lists(st.integers(0, ids - 1), min_size=1, max_size=max_len, unique=True)) for _ in range(count)
    ]


class NaiveLru(KeyEvictionPolicy):
    """A test oracle: LRU over any hashable keys, the victim recomputed from release stamps (O(n)).

    The product's LRU is the engine's block pool, which keys a block by its whole prefix; this one
    keys blocks by id alone, so the one-pass curve can be checked on traces whose ids change parents.
    """

    def __init__(self) -> None:
        self.released: dict[int, int] = {}  # evictable key -> release stamp
        self.clock = 0

    def insert(self, key):
        pass

    def touch(self, key):
        self.released.pop(key, None)

    def release(self, key):
        self.clock += 1
        self.released[key] = self.clock

    def victim(self):
        if not self.released:
            raise NoVictimError("no evictable block")
        return min(self.released, key=self.released.__getitem__)

    def remove(self, key):
        del self.released[key]

    @property
    def num_evictable(self) -> int:
        return len(self.released)

    def check_invariants(self) -> None:
        pass


def best_hit_blocks(chains: list[list[int]], capacity: int) -> int:
    """The most leading-block hits any lazy eviction choice achieves under the sequential rule
    (exhaustive search: for tiny traces only)."""
    return _best(tuple(tuple(chain) for chain in chains), capacity, lambda request, hit: hit)


def best_hit_tokens(chains: list[list[int]], lengths: list[int], capacity: int) -> int:
    """As `best_hit_blocks`, maximising hit tokens at BLOCK_SIZE instead."""
    return _best(
        tuple(tuple(chain) for chain in chains), capacity, lambda request, hit: min(hit * BLOCK_SIZE, lengths[request])
    )


def _best(chains: tuple[tuple[int, ...], ...], capacity: int, value) -> int:
    @functools.cache
    def best(request: int, cached: frozenset[int]) -> int:
        if request == len(chains):
            return 0
        chain = chains[request]
        hit = 0
        for block in chain:
            if block not in cached:
                break
            hit += 1
        kept = frozenset(chain[:capacity])
        candidates = sorted(cached - kept)
        excess = len(cached | kept) - capacity
        choices = itertools.combinations(candidates, excess) if excess > 0 else [()]
        gained = value(request, hit)
        return gained + max(best(request + 1, (cached - frozenset(victims)) | kept) for victims in choices)

    return best(0, frozenset())
