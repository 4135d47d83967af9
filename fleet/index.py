"""The fleet index: which blocks each pod's prefix cache holds, and which pods hold which prefix.

A `BatchSink`: the collector applies every pod's batches to it in order; pages and commands query it
from other threads (one lock guards both).

Per pod, per (medium, KV group), the held blocks by hash, with their copies (`fleet.held_blocks`):

    pod "a" ── ("GPU", 0) ── BlockGroup: hash -> HeldBlock(copies, parent_hash, tokens, ...)
            └─ ("CPU", 0) ── ...

A BlockRemoved of a hash the pod does not hold is counted (`num_unknown_removals`: a feed joined late,
or a gap that could not be recovered) and changes nothing. AllBlocksCleared and a PodReset drop
everything the pod holds. Across pods, `prefix_tree` merges the groups by token content
(`fleet.prefix_tree`); `route` walks a prompt through each pod's group, `route_tiers` through each pod's
media of a group, fastest first (`fleet.tiers`: which tier would serve it).

Besides the blocks, per pod: the collector's latest `PodStatus` (its link, which with the silence
since the last batch gives the pod's health, `fleet.health`) and its recent `/metrics` scrapes
(`METRICS_KEPT`, oldest first).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fleet.events import (
    DEFAULT_MEDIUM,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    LinkState,
    PodBatch,
    PodMetrics,
    PodReset,
    PodStatus,
)
from fleet.health import PodHealth, pod_health
from fleet.held_blocks import BlockGroup, check_group, pack_tokens, unpack_tokens
from fleet.prefix_tree import PrefixTree, build_prefix_tree
from fleet.source import PodSource
from fleet.tiers import PodTierMatch, TieredRoute, tiered_reach

DEFAULT_STALE_AFTER_S = 60.0
_M = TypeVar("_M", "PodMatch", PodTierMatch)  # what `_match_pods` collects per pod
METRICS_KEPT = 720  # a pod's latest scrapes kept for the live view (an hour at one per 5 s)


@dataclass(frozen=True)
class BlockInfo:
    """A held block as queries return it (a copy: later batches do not change it)."""

    hash: BlockHash  # the block's hash
    copies: int  # physical blocks holding it
    parent_hash: BlockHash | None  # see HeldBlock
    token_ids: tuple[int, ...] | None  # its tokens; None when not known
    block_size: int  # tokens per block
    first_stored: float  # see HeldBlock
    last_stored: float  # see HeldBlock


@dataclass(slots=True)
class _Pod:
    source: PodSource | None  # None for a pod that sent batches without being opened
    opened_at: float  # wall clock when the index first heard of it
    groups: dict[tuple[str, int], BlockGroup] = field(default_factory=dict)
    num_batches: int = 0
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_unknown_removals: int = 0
    num_unaligned_stores: int = 0
    num_unknown_events: int = 0
    num_clears: int = 0
    num_resets: int = 0
    last_seq: int | None = None
    last_batch_ts: float | None = None
    last_received_at: float | None = None
    status: PodStatus | None = None  # the collector's latest word on the link
    metrics: deque[PodMetrics] = field(default_factory=lambda: deque(maxlen=METRICS_KEPT))


@dataclass(frozen=True)
class GroupSummary:
    """What a pod holds in one (medium, KV group)."""

    medium: str  # "GPU", "CPU", ...
    group_idx: int  # the KV cache group
    num_hashes: int  # distinct hashes held
    num_blocks: int  # physical blocks holding them (>= num_hashes)


@dataclass(frozen=True)
class PodSummary:
    """One pod as the console shows it."""

    pod: str  # its name
    groups: tuple[GroupSummary, ...]  # by medium, then group
    num_batches: int  # batches applied
    num_blocks_stored: int  # block stores applied (one per hash per BlockStored)
    num_blocks_removed: int  # block removals received (one per hash per BlockRemoved)
    num_unknown_removals: int  # removals of hashes the pod did not hold (ignored)
    num_unaligned_stores: int  # BlockStored events whose tokens did not split per block
    num_unknown_events: int  # events of unknown types the collector skipped
    num_clears: int  # AllBlocksCleared applied
    num_resets: int  # PodReset applied (restarted server)
    last_seq: int | None  # the sequence number of the last batch applied; None before the first
    last_batch_ts: float | None  # publisher time of the last batch applied
    last_received_at: float | None  # collector time the last batch arrived
    seconds_silent: float  # since the last batch arrived (or since the pod was opened)
    health: PodHealth  # live, idle, down, unreachable or silent (fleet.health)
    stale: bool  # health.stale: its blocks may be out of date (shown, never dropped)
    link: LinkState | None  # the collector's link to it, as last reported; None if never
    num_lost_batches: int  # batches neither live nor replay delivered (the collector's count)
    num_restarts: int  # restarted servers the collector detected
    last_status_at: float | None  # collector time of its latest PodStatus

    @property
    def num_blocks(self) -> int:
        """Physical blocks held, every medium and group."""
        return sum(group.num_blocks for group in self.groups)


@dataclass(frozen=True)
class PodMatch:
    """How much of a prompt one pod holds, from its start."""

    pod: str  # the pod
    matched_blocks: int  # consecutive blocks from the prompt's start the pod holds, at most max_cached_tokens
    matched_tokens: int  # the tokens they cover: what the server would report as cached
    stale: bool  # whether the pod is stale (its answer may be out of date)


@dataclass(frozen=True)
class RouteResult:
    """A prompt matched against every pod, best first: the pick of a longest-prefix scorer."""

    num_prompt_tokens: int  # the prompt's length
    max_cached_tokens: int  # num_prompt_tokens - 1: the server recomputes the last token (vLLM's cap)
    medium: str  # the medium matched
    group_idx: int  # the KV group matched
    matches: tuple[PodMatch, ...]  # every pod, longest match first, then by name

    @property
    def best_pods(self) -> tuple[str, ...]:
        """The pods with the longest match (none if no pod holds the first block)."""
        if not self.matches or self.matches[0].matched_blocks == 0:
            return ()
        top = self.matches[0].matched_tokens
        return tuple(match.pod for match in self.matches if match.matched_tokens == top)


class FleetIndex:
    """The blocks every pod holds; a `BatchSink`. Thread-safe."""

    def __init__(
        self, stale_after_s: float = DEFAULT_STALE_AFTER_S, clock: Callable[[], float] = time.time
    ) -> None:
        """Args:
        stale_after_s: a pod silent for longer is stale unless its link is connected (then idle).
        clock: wall clock (seconds since the epoch), replaceable in tests.
        """
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be positive, got {stale_after_s!r}")
        self.stale_after_s = stale_after_s  # the silence after which a pod without a live link is stale
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}

    # --- the sink -----------------------------------------------------------------------------

    def open_pod(self, source: PodSource, at: float) -> None:
        """Register a pod before its first batch (so a pod that never sends is shown stale)."""
        with self._lock:
            pod = self._pods.get(source.name)
            if pod is None:
                self._pods[source.name] = _Pod(source, at)
            else:
                pod.source = source

    def apply_batch(self, batch: PodBatch) -> None:
        """Apply one pod's batch: stores add copies, removals take them away, a clear drops all."""
        with self._lock:
            pod = self._pod(batch.pod, batch.received_at)
            ts = batch.batch.ts
            groups = pod.groups
            for event in batch.batch.events:
                if isinstance(event, BlockStored):
                    key = (event.medium, event.group_idx)
                    group = groups.get(key)
                    if group is None:
                        group = groups[key] = BlockGroup()
                    group.store(event, ts)
                    pod.num_blocks_stored += event.num_blocks
                    if not event.tokens_aligned and event.block_hashes:
                        pod.num_unaligned_stores += 1
                elif isinstance(event, BlockRemoved):
                    group = groups.get((event.medium, event.group_idx))
                    for block_hash in event.block_hashes:
                        if group is None or not group.remove(block_hash):
                            pod.num_unknown_removals += 1
                    pod.num_blocks_removed += event.num_blocks
                elif isinstance(event, AllBlocksCleared):
                    groups.clear()
                    pod.num_clears += 1
            pod.num_unknown_events += len(batch.batch.unknown_event_types)
            pod.num_batches += 1
            pod.last_seq = batch.seq
            pod.last_batch_ts = ts
            pod.last_received_at = batch.received_at

    def reset_pod(self, reset: PodReset) -> None:
        """Drop everything the pod holds (its server restarted with an empty cache)."""
        with self._lock:
            pod = self._pod(reset.pod, reset.at)
            pod.groups.clear()
            pod.num_resets += 1
            pod.last_seq = None

    def pod_status(self, status: PodStatus) -> None:
        """Keep the collector's latest word on the pod's link (it decides idle against stale)."""
        with self._lock:
            self._pod(status.pod, status.at).status = status

    def apply_metrics(self, metrics: PodMetrics) -> None:
        """Keep a scrape of the pod's /metrics (the latest METRICS_KEPT)."""
        with self._lock:
            self._pod(metrics.pod, metrics.at).metrics.append(metrics)

    def _pod(self, name: str, at: float) -> _Pod:
        pod = self._pods.get(name)
        if pod is None:
            pod = self._pods[name] = _Pod(None, at)
        return pod

    # --- queries ------------------------------------------------------------------------------

    def pod_names(self) -> list[str]:
        """Every pod the index knows, sorted."""
        with self._lock:
            return sorted(self._pods)

    def pods(self, now: float | None = None) -> list[PodSummary]:
        """A summary of every pod, sorted by name; `now` defaults to the clock."""
        now = self._clock() if now is None else now
        with self._lock:
            return [self._summary(name, self._pods[name], now) for name in sorted(self._pods)]

    def pod(self, name: str, now: float | None = None) -> PodSummary:
        """One pod's summary.

        Raises:
            KeyError: the index has never heard of the pod.
        """
        now = self._clock() if now is None else now
        with self._lock:
            return self._summary(name, self._pods[name], now)

    def metrics(self, name: str) -> list[PodMetrics]:
        """A pod's latest scrapes, oldest first ([] for a pod without a metrics URL or an unknown one)."""
        with self._lock:
            pod = self._pods.get(name)
            return [] if pod is None else list(pod.metrics)

    @staticmethod
    def _seconds_silent(pod: _Pod, now: float) -> float:
        heard_at = pod.last_received_at if pod.last_received_at is not None else pod.opened_at
        return max(0.0, now - heard_at)

    def _health(self, pod: _Pod, now: float) -> PodHealth:
        link = pod.status.link if pod.status is not None else None
        return pod_health(link, self._seconds_silent(pod, now), self.stale_after_s)

    def _summary(self, name: str, pod: _Pod, now: float) -> PodSummary:
        groups = tuple(
            GroupSummary(medium, group_idx, len(group.blocks), group.num_copies)
            for (medium, group_idx), group in sorted(pod.groups.items())
            if group.blocks
        )
        health = self._health(pod, now)
        status = pod.status
        return PodSummary(
            pod=name,
            groups=groups,
            num_batches=pod.num_batches,
            num_blocks_stored=pod.num_blocks_stored,
            num_blocks_removed=pod.num_blocks_removed,
            num_unknown_removals=pod.num_unknown_removals,
            num_unaligned_stores=pod.num_unaligned_stores,
            num_unknown_events=pod.num_unknown_events,
            num_clears=pod.num_clears,
            num_resets=pod.num_resets,
            last_seq=pod.last_seq,
            last_batch_ts=pod.last_batch_ts,
            last_received_at=pod.last_received_at,
            seconds_silent=self._seconds_silent(pod, now),
            health=health,
            stale=health.stale,
            link=None if status is None else status.link,
            num_lost_batches=0 if status is None else status.num_lost_batches,
            num_restarts=0 if status is None else status.num_restarts,
            last_status_at=None if status is None else status.at,
        )

    def copies(self, name: str) -> dict[tuple[str, int, BlockHash], int]:
        """Physical copies of every hash a pod holds, by (medium, group, hash); {} for an unknown pod."""
        with self._lock:
            pod = self._pods.get(name)
            if pod is None:
                return {}
            return {
                (medium, group_idx, block_hash): held.copies
                for (medium, group_idx), group in pod.groups.items()
                for block_hash, held in group.blocks.items()
            }

    def blocks(self, name: str, medium: str = DEFAULT_MEDIUM, group_idx: int = 0) -> dict[BlockHash, BlockInfo]:
        """The blocks a pod holds in one (medium, group); {} if it holds none there."""
        with self._lock:
            pod = self._pods.get(name)
            group = pod.groups.get((medium, group_idx)) if pod is not None else None
            if group is None:
                return {}
            return {
                block_hash: BlockInfo(
                    block_hash,
                    held.copies,
                    held.parent_hash,
                    unpack_tokens(held.tokens) if held.tokens is not None else None,
                    held.block_size,
                    held.first_stored,
                    held.last_stored,
                )
                for block_hash, held in group.blocks.items()
            }

    def route(
        self, token_ids: Sequence[int], medium: str = DEFAULT_MEDIUM, group_idx: int = 0, now: float | None = None
    ) -> RouteResult:
        """Each pod's longest cached prefix of a prompt, the way a longest-prefix scorer (llm-d's) picks.

        A pod matches block by block from the prompt's start: a held block whose parent is the
        previous match and whose token ids are the prompt's next `block_size` tokens. The match stops
        before the prompt's last token: vLLM (and SGLang) recompute at least that one to sample from
        it, so a prompt of whole blocks that is fully cached reuses one block less (`max_cached_tokens`).
        `matched_tokens` is then what the server reports as cached.

        Raises:
            OverflowError: a token id is negative or not below 2**32.
        """
        def match(name: str, pod: _Pod, prompt: bytes, stale: bool) -> PodMatch:
            group = pod.groups.get((medium, group_idx))
            blocks, tokens = group.walk(prompt) if group is not None else (0, 0)
            return PodMatch(name, blocks, tokens, stale)

        max_cached, matches = self._match_pods(token_ids, now, match)
        return RouteResult(len(token_ids), max_cached, medium, group_idx, matches)

    def route_tiers(self, token_ids: Sequence[int], group_idx: int = 0, now: float | None = None) -> TieredRoute:
        """Which tier of each pod would serve a prompt: its media of one KV group walked fastest first,
        each on from where the faster ones stopped (fleet.tiers), capped as `route` caps a match.

        Raises:
            OverflowError: a token id is negative or not below 2**32.
        """
        def match(name: str, pod: _Pod, prompt: bytes, stale: bool) -> PodTierMatch:
            groups = [(medium, group) for (medium, idx), group in pod.groups.items() if idx == group_idx]
            return PodTierMatch(name, tiered_reach(groups, prompt), stale)

        max_cached, matches = self._match_pods(token_ids, now, match)
        return TieredRoute(len(token_ids), max_cached, group_idx, matches)

    def _match_pods(self, token_ids: Sequence[int], now: float | None, match: Callable[..., _M]) -> tuple[int, tuple[_M, ...]]:
        """`match(pod name, pod, packed prompt, stale)` for every pod under the lock, longest match first (then by
        name), and the prompt's cap: its tokens before the last (what a server may report cached)."""
        max_cached = max(0, len(token_ids) - 1)
        prompt = pack_tokens(token_ids[:max_cached])
        now = self._clock() if now is None else now
        with self._lock:
            matches = [match(name, pod, prompt, self._health(pod, now).stale) for name, pod in self._pods.items()]
        matches.sort(key=lambda found: (-found.matched_tokens, found.pod))
        return max_cached, tuple(matches)

    def prefix_tree(self, medium: str = DEFAULT_MEDIUM, group_idx: int = 0, max_nodes: int = 10_000) -> PrefixTree:
        """The prefixes every pod holds in one (medium, group), merged by token content (fleet.prefix_tree).

        Args:
            medium: the medium.
            group_idx: the KV group.
            max_nodes: at most this many nodes (the rest is cut, and `truncated` says so).
        """
        with self._lock:
            groups = [
                (name, self._pods[name].groups[(medium, group_idx)])
                for name in sorted(self._pods)
                if (medium, group_idx) in self._pods[name].groups
            ]
            return build_prefix_tree(groups, max_nodes)

    def check_invariants(self) -> None:
        """Raise IndexInvariantError if an invariant of fleet.held_blocks fails in any pod's group."""
        with self._lock:
            for name, pod in self._pods.items():
                for key, group in pod.groups.items():
                    check_group(f"{name}{key}", group)
