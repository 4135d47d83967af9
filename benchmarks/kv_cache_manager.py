"""Block bookkeeping throughput: this engine's KV cache manager next to transformers' cache allocators.

A report, not a goal: the pool is built to be simple to read (an intrusive linked-list LRU, chain keys as
a list of bytes, no cached enum members); the speed that counts is replaying a real workload.

Four operations per context length, on the same pool size, block size and token ids for both sides:

    lookup    hash the prompt block by block and find every block of a fully cached context
              ours: `FullAttentionManager.find_prefix_hit`      theirs: `CacheAllocator.match_prefix_blocks`
    allocate  give a new context its blocks on a cold cache, then key its full blocks
              ours: `allocate` (which checks `can_allocate` first) + `cache_full_blocks`
              theirs: `needs_new_sectors` + `allocate_cache_to_request` + `mark_complete_blocks`
    fork      give a child a table sharing every block of a prefilled parent
              ours: `fork`                                theirs: `fork_blocks`
    release   drop a finished context's blocks (full blocks stay cached for later hits)
              ours: `free`                                theirs: `free_blocks`

Each timed run repeats one operation over a batch of contexts (or children, or lookups) on freshly built
state; building that state is not timed (our side drains its event log after building it, as the engine
does every step; the events of the timed operations stay in the log). A round times one run of each side,
back to back. tokens/s counts context tokens covered (every operation covers the whole context), ops/s
counts operations, each the median run of its side; both sides cover the same tokens per operation, so
one ratio (ours / theirs, > 1 means ours is faster) serves both. The ratio is the median over rounds of
each round's ratio: this machine's speed drifts by tens of percent within seconds, and a drift between
rounds cancels out of a round's ratio but not out of a ratio of two medians.

Run: `.venv/bin/python benchmarks/kv_cache_manager.py` (about a minute on 2 cores) or `--quick` for a smoke run.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import PreTrainedConfig  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    CachePool,
    FullAttentionCacheAllocator,
)

from engine.core.block_pool import BlockPool  # noqa: E402
from engine.core.chain_keys import ChainKeys  # noqa: E402
from engine.core.events import EventLog  # noqa: E402
from engine.core.full_attention_manager import FullAttentionManager  # noqa: E402
from engine.core.namespace import CacheNamespace, NamespaceRoots  # noqa: E402

BLOCK_SIZE = 16
CONTEXTS = (256, 1024, 4096, 16384, 32768)
QUICK_CONTEXTS = (256, 1024)
VOCAB_SIZE = 49152
OPS = ("lookup", "allocate", "fork", "release")

# What the two sides do differently for the same call (printed under the table).
NOTES = {
    "lookup": "theirs trusts a 64-bit blake2b hit; ours hashes under a namespace root (xxh3-128) and "
    "confirms each hit's token ids and parent key",
    "allocate": "ours also checks the pool first, stamps each block, checks the chain parent and emits one "
    "ALLOCATE and one CACHE event per call, each listing its blocks",
    "fork": "contexts are whole blocks, so both sides share every block and copy nothing (with a partial "
    "tail theirs takes a fresh block for a copy at fork time; ours shares it until the first write); "
    "ours emits one FORK event",
    "release": "theirs keeps unreferenced hashed blocks in a dict that is evicted all at once; ours links the "
    "released blocks, tail first, into an LRU queue threaded through the blocks (a doubly linked list: O(1) "
    "removal on a later hit), stamps each block's last use and emits one RELEASE event listing the blocks",
}

Thunk = Callable[[], None]


@dataclass(frozen=True)
class Settings:
    contexts: tuple[int, ...]  # context lengths in tokens, each a multiple of BLOCK_SIZE
    runs: int  # timed rounds per measurement (each side runs once a round), after one warm-up round
    target_tokens: int  # tokens one timed run should cover; batches are sized to reach it
    num_blocks: int  # pool size, the same for both sides

    @staticmethod
    def make(quick: bool) -> Settings:
        contexts = QUICK_CONTEXTS if quick else CONTEXTS
        # Room for two of the largest contexts: a parent plus anything a run allocates beside it.
        num_blocks = 2 * max(contexts) // BLOCK_SIZE
        if quick:
            return Settings(contexts, runs=3, target_tokens=8192, num_blocks=num_blocks)
        return Settings(contexts, runs=21, target_tokens=262144, num_blocks=num_blocks)


# ---------------------------------------------------------------------------------------------- the two sides
class Ours:
    """This engine's KV cache manager over a fresh block pool."""

    name = "ours"
    namespace = CacheNamespace("bench", "r0", "float16", BLOCK_SIZE, ("full",))

    def __init__(self, num_blocks: int) -> None:
        self.log = EventLog()
        self.manager = FullAttentionManager(BlockPool(num_blocks, BLOCK_SIZE, self.log), self.namespace, self.log)
        self.root = NamespaceRoots(self.namespace, [self.manager.pool]).root_key(None)  # as the scheduler's, once

    def prefill(self, request_id: str, tokens: list[int]) -> None:
        self.manager.allocate(request_id, tokens, root_key=self.root)
        self.manager.cache_full_blocks(request_id)
        self.log.take()  # the engine drains its events every step

    def lookup_thunk(self, prompt: list[int], repeats: int) -> Thunk:
        find, root = self.manager.find_prefix_hit, self.root

        def run() -> None:
            for _ in range(repeats):
                find(prompt, ChainKeys(root, BLOCK_SIZE))  # a request's first lookup hashes its blocks

        return run

    def allocate_thunk(self, contexts: list[tuple[str, list[int]]]) -> Thunk:
        allocate, cache, root = self.manager.allocate, self.manager.cache_full_blocks, self.root

        def run() -> None:
            for request_id, tokens in contexts:
                allocate(request_id, tokens, root_key=root)
                cache(request_id)

        return run

    def fork_thunk(self, parent_id: str, child_ids: list[str], num_tokens: int) -> Thunk:
        fork = self.manager.fork

        def run() -> None:
            for child_id in child_ids:
                fork(parent_id, child_id)

        return run

    def release_thunk(self, request_ids: list[str]) -> Thunk:
        free = self.manager.free

        def run() -> None:
            for request_id in request_ids:
                free(request_id)

        return run

    def num_hit_blocks(self, prompt: list[int]) -> int:
        return len(self.manager.find_prefix_hit(prompt, ChainKeys(self.root, BLOCK_SIZE)))

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.manager.block_ids(request_id))


class Theirs:
    """transformers' full-attention cache allocator over a real (tiny) cache tensor and cache pool.

    Built as `PagedAttentionCache` builds it, minus the model: one allocator, one layer, one KV head of
    dimension 2 in float16, so a block is 128 bytes and a sector holds exactly one block (as it does for a
    real model with a single attention type). Every sector is handed to the allocator up front, so
    allocation never pays for sector bookkeeping: their cheapest steady state.
    """

    name = "theirs"

    def __init__(self, num_blocks: int) -> None:
        self.allocator = FullAttentionCacheAllocator(
            index=0,
            config=PreTrainedConfig(head_dim=2),
            num_key_value_heads=1,
            cache_dtype=torch.float16,
            page_size=BLOCK_SIZE,
            layer_indices=[0],
            allow_block_sharing=True,
        )
        bytes_per_sector = self.allocator.bytes_per_block
        pool = CachePool(num_blocks, num_allocators=1)
        # Two leading trash sectors, as in PagedAttentionCache.
        tensor = torch.zeros((num_blocks + 2) * bytes_per_sector, dtype=torch.uint8)
        self.allocator.register_cache_tensor(bytes_per_sector, num_blocks * bytes_per_sector, tensor, pool)
        for _ in range(num_blocks):
            pool.allocate_sector(self.allocator.index)

    def prefill(self, request_id: str, tokens: list[int]) -> None:
        assert self.allocator.needs_new_sectors(request_id, 0, len(tokens)) == 0
        self.allocator.allocate_cache_to_request(request_id, 0, len(tokens))
        self.allocator.mark_complete_blocks(request_id, tokens, len(tokens) // BLOCK_SIZE)

    def lookup_thunk(self, prompt: list[int], repeats: int) -> Thunk:
        match = self.allocator.match_prefix_blocks

        def run() -> None:
            for _ in range(repeats):
                match(prompt)

        return run

    def allocate_thunk(self, contexts: list[tuple[str, list[int]]]) -> Thunk:
        a = self.allocator
        needs, allocate, mark = a.needs_new_sectors, a.allocate_cache_to_request, a.mark_complete_blocks

        def run() -> None:
            for request_id, tokens in contexts:
                n = len(tokens)
                needs(request_id, 0, n)  # the capacity check PagedAttentionCache runs before allocating
                allocate(request_id, 0, n)
                mark(request_id, tokens, n // BLOCK_SIZE)

        return run

    def fork_thunk(self, parent_id: str, child_ids: list[str], num_tokens: int) -> Thunk:
        fork = self.allocator.fork_blocks

        def run() -> None:
            for child_id in child_ids:
                fork(parent_id, child_id, num_tokens)

        return run

    def release_thunk(self, request_ids: list[str]) -> Thunk:
        free = self.allocator.free_blocks

        def run() -> None:
            for request_id in request_ids:
                free(request_id)

        return run

    def num_hit_blocks(self, prompt: list[int]) -> int:
        return len(self.allocator.match_prefix_blocks(prompt))

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.allocator.block_table.get(request_id, ()))


Side = type[Ours] | type[Theirs]


# ---------------------------------------------------------------------------------------------- workloads
def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


@dataclass
class Workload:
    """The token ids of one context length, shared by both sides."""

    num_tokens: int
    parent: list[int]  # the context that lookups and forks reuse
    batch: list[list[int]]  # distinct contexts for allocate and release
    num_lookups: int  # lookups per timed run
    num_children: int  # forks per timed run

    @staticmethod
    def make(num_tokens: int, settings: Settings) -> Workload:
        rng = random.Random(num_tokens)
        per_run = max(1, settings.target_tokens // num_tokens)
        # Allocate and release hold every context of a run at once, so the pool bounds the batch.
        batch_size = max(1, min(per_run, settings.num_blocks // (num_tokens // BLOCK_SIZE)))
        return Workload(
            num_tokens=num_tokens,
            parent=random_tokens(rng, num_tokens),
            batch=[random_tokens(rng, num_tokens) for _ in range(batch_size)],
            num_lookups=per_run,
            num_children=per_run,
        )


def prepare(side: Side, op: str, work: Workload, settings: Settings) -> tuple[Thunk, int]:
    """Build fresh state for one timed run of `op`. Returns the timed thunk and the operations it runs."""
    s = side(settings.num_blocks)
    n = work.num_tokens
    if op == "lookup":
        s.prefill("parent", work.parent)
        prompt = work.parent + [0]  # one token past the context, so every cached block is within the cap
        assert s.num_hit_blocks(prompt) == n // BLOCK_SIZE
        return s.lookup_thunk(prompt, work.num_lookups), work.num_lookups
    if op == "allocate":
        contexts = [(f"r{i}", tokens) for i, tokens in enumerate(work.batch)]
        return s.allocate_thunk(contexts), len(contexts)
    if op == "fork":
        s.prefill("parent", work.parent)
        children = [f"c{i}" for i in range(work.num_children)]
        return s.fork_thunk("parent", children, n), len(children)
    if op == "release":
        request_ids = [f"r{i}" for i in range(len(work.batch))]
        for request_id, tokens in zip(request_ids, work.batch):
            s.prefill(request_id, tokens)
        return s.release_thunk(request_ids), len(request_ids)
    raise ValueError(op)


def check_same_outcome(work: Workload, settings: Settings) -> None:
    """Both sides must end each operation holding the same number of blocks (untimed)."""
    n_blocks = work.num_tokens // BLOCK_SIZE
    for side in (Ours, Theirs):
        s = side(settings.num_blocks)
        s.allocate_thunk([("a", work.parent)])()
        assert s.num_held_blocks("a") == n_blocks, side.name
        s.fork_thunk("a", ["b"], work.num_tokens)()
        assert s.num_held_blocks("b") == n_blocks, side.name
        s.release_thunk(["a", "b"])()
        assert s.num_held_blocks("a") == 0 and s.num_held_blocks("b") == 0, side.name
        assert s.num_hit_blocks(work.parent + [0]) == n_blocks, f"{side.name}: released blocks must stay cached"


@dataclass
class Row:
    num_tokens: int
    op: str
    ours_s: float  # seconds per operation, median run
    theirs_s: float
    ratio: float  # median over rounds of theirs / ours (> 1: ours faster)


def measure(op: str, work: Workload, settings: Settings) -> Row:
    """Time `settings.runs` rounds of `op` after a warm-up round; a round runs each side once on fresh state.

    Who goes first alternates round by round.
    """
    times: dict[Side, list[float]] = {Ours: [], Theirs: []}
    for i in range(settings.runs + 1):
        for side in (Ours, Theirs) if i % 2 else (Theirs, Ours):
            thunk, num_ops = prepare(side, op, work, settings)
            gc.collect()  # garbage from building the state is not charged to the run
            start = time.perf_counter()
            thunk()
            elapsed = time.perf_counter() - start
            if i:
                times[side].append(elapsed / num_ops)
    ratios = [theirs / ours for ours, theirs in zip(times[Ours], times[Theirs])]
    return Row(
        work.num_tokens,
        op,
        ours_s=statistics.median(times[Ours]),
        theirs_s=statistics.median(times[Theirs]),
        ratio=statistics.median(ratios),
    )


# ---------------------------------------------------------------------------------------------- report
def fmt_rate(per_s: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_s >= scale:
            return f"{per_s / scale:.2f}{unit}"
    return f"{per_s:.1f}"


def print_table(rows: list[Row], settings: Settings) -> None:
    header = (
        f"{'context':>8} {'op':<9} {'ours tok/s':>11} {'theirs tok/s':>13} "
        f"{'ours op/s':>10} {'theirs op/s':>12} {'ours/theirs':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        flag = "" if r.ratio >= 1 else "  < slower"
        print(
            f"{r.num_tokens:>8} {r.op:<9} {fmt_rate(r.num_tokens / r.ours_s):>11} "
            f"{fmt_rate(r.num_tokens / r.theirs_s):>13} {fmt_rate(1 / r.ours_s):>10} "
            f"{fmt_rate(1 / r.theirs_s):>12} {r.ratio:>11.2f}x{flag}"
        )
    print()
    print(
        f"block size {BLOCK_SIZE}, pool {settings.num_blocks} blocks on both sides; {settings.runs} rounds: rates from "
        "each side's median run, ratio the median of the rounds' ratios"
    )
    for op in OPS:
        print(f"  {op:<9} {NOTES[op]}")
    slower = [r for r in rows if r.ratio < 1]
    print()
    print("ours is at least as fast on every row" if not slower else f"ours is slower on {len(slower)} row(s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small contexts and few runs (a smoke test)")
    args = parser.parse_args(argv)
    settings = Settings.make(args.quick)
    # torch and transformers leave a large heap; park it so collections during runs skip it.
    gc.collect()
    gc.freeze()
    try:
        rows = []
        for num_tokens in settings.contexts:
            work = Workload.make(num_tokens, settings)
            check_same_outcome(work, settings)
            for op in OPS:
                rows.append(measure(op, work, settings))
    finally:
        gc.unfreeze()
    print_table(rows, settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
