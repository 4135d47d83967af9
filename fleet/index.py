"""The fleet index: which blocks each pod's prefix cache holds, and which pods hold which prefix.

A `BatchSink`: the collector applies every pod's batches to it in order; pages and commands query it
from other threads (one lock guards both).

Per pod, per (medium, KV group), the held blocks by hash:

    pod "a" ── ("GPU", 0) ── hash -> HeldBlock(copies, parent_hash, tokens, block_size, first/last stored)
            └─ ("CPU", 0) ── ...

`copies` counts physical blocks: each BlockStored of a hash adds one, each BlockRemoved of it takes one
away, and the hash is held until the last copy goes (vLLM does not de-duplicate, and sends one
BlockRemoved per physical copy). A BlockRemoved of a hash the pod does not hold is counted
(`num_unknown_removals`: a feed joined late, or a gap that could not be recovered) and changes nothing.
AllBlocksCleared and a PodReset drop everything the pod holds.

The prefix tree. A block's place is its parent hash and its own token ids (BlockStored carries both).
Each group keeps its held blocks by parent hash, then by token ids (`children`), so the index can walk
a prompt from the root without the pod's hash function (which it cannot recompute: vLLM seeds it per
deployment, and SGLang namespaces it). Across pods, blocks at the same place with the same tokens are
the same prefix: `prefix_tree` merges them into one node, which says which pods hold it.

Invariants (`check_invariants`):
  * every held block has copies >= 1, and a group's `num_copies` is the sum of its blocks' copies;
  * a held block with known tokens is in `children[parent_hash][tokens]` and nowhere else in
    `children`; every hash in `children` is held with those tokens and that parent; no empty
    container stays in `children`;
  * a held block's tokens are `block_size` token ids.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fleet.events import (
    DEFAULT_MEDIUM,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    PodBatch,
    PodReset,
)
from fleet.source import PodSource

# Token ids are packed four bytes each (msgspec already checked 0 <= id < 2**32): a held block costs
# one bytes object instead of one int object per token, and a packed slice of a prompt is a dict key.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_TOKEN_BYTES = 4

DEFAULT_STALE_AFTER_S = 60.0


class IndexInvariantError(RuntimeError):
    """A check of the index's invariants failed: a bug in the index."""


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    """Token ids as the index keys them (native-endian uint32, back to back).

    Raises:
        OverflowError: a token id is negative or not below 2**32.
    """
    return array(_U32, token_ids).tobytes()


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    """The inverse of `pack_tokens`."""
    return tuple(array(_U32, packed))


@dataclass(slots=True)
class HeldBlock:
    """One hash a pod holds in one (medium, group)."""

    copies: int  # physical blocks holding it now (>= 1)
    parent_hash: BlockHash | None  # the block before it; None at a prompt's start or when not known
    tokens: bytes | None  # its token ids (pack_tokens); None when the event's tokens did not split per block
    block_size: int  # tokens per block
    first_stored: float  # publisher time of the store that made it held (its copies went 0 -> 1)
    last_stored: float  # publisher time of the latest store of any copy


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


class _Group:
    """The held blocks of one pod in one (medium, KV group)."""

    __slots__ = ("blocks", "children", "num_copies", "block_sizes")

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, HeldBlock] = {}
        # parent hash (None: the root) -> packed tokens -> hashes held there with those tokens
        self.children: dict[BlockHash | None, dict[bytes, set[BlockHash]]] = {}
        self.num_copies = 0
        # tokens per block -> held blocks of that size with known tokens (a walk tries each size)
        self.block_sizes: Counter[int] = Counter()

    def store(self, event: BlockStored, ts: float) -> None:
        blocks = self.blocks
        size = event.block_size
        step = size * _TOKEN_BYTES
        packed = pack_tokens(event.token_ids) if event.tokens_aligned else None
        parent = event.parent_block_hash if packed is not None else None
        for i, block_hash in enumerate(event.block_hashes):
            held = blocks.get(block_hash)
            if held is None:
                tokens = packed[i * step : (i + 1) * step] if packed is not None else None
                blocks[block_hash] = HeldBlock(1, parent, tokens, size, ts, ts)
                if tokens is not None:
                    self.children.setdefault(parent, {}).setdefault(tokens, set()).add(block_hash)
                    self.block_sizes[size] += 1
            else:
                held.copies += 1
                held.last_stored = ts
            if packed is not None:
                parent = block_hash
        self.num_copies += len(event.block_hashes)

    def remove(self, block_hash: BlockHash) -> bool:
        """Take one copy of `block_hash` away; False if the group does not hold it."""
        held = self.blocks.get(block_hash)
        if held is None:
            return False
        self.num_copies -= 1
        held.copies -= 1
        if held.copies == 0:
            del self.blocks[block_hash]
            if held.tokens is not None:
                self._unlink(block_hash, held)
        return True

    def _unlink(self, block_hash: BlockHash, held: HeldBlock) -> None:
        by_tokens = self.children[held.parent_hash]
        hashes = by_tokens[held.tokens]
        hashes.discard(block_hash)
        if not hashes:
            del by_tokens[held.tokens]
            if not by_tokens:
                del self.children[held.parent_hash]
        self.block_sizes[held.block_size] -= 1
        if not self.block_sizes[held.block_size]:
            del self.block_sizes[held.block_size]

    def walk(self, prompt: bytes) -> tuple[int, int]:
        """The longest run of held blocks from the root matching `prompt` (packed).

        Returns:
            (blocks, tokens) of the deepest match; (0, 0) if the first block misses.
        """
        best_blocks = best_tokens = 0
        num_prompt_tokens = len(prompt) // _TOKEN_BYTES
        sizes = tuple(self.block_sizes)
        stack: list[tuple[BlockHash | None, int, int]] = [(None, 0, 0)]  # (parent, tokens, blocks)
        while stack:
            parent, start, depth = stack.pop()
            by_tokens = self.children.get(parent)
            if by_tokens is None:
                continue
            for size in sizes:
                end = start + size
                if end > num_prompt_tokens:
                    continue
                for block_hash in by_tokens.get(prompt[start * _TOKEN_BYTES : end * _TOKEN_BYTES], ()):
                    if end > best_tokens:
                        best_blocks, best_tokens = depth + 1, end
                    stack.append((block_hash, end, depth + 1))
        return best_blocks, best_tokens


@dataclass(slots=True)
class _Pod:
    source: PodSource | None  # None for a pod that sent batches without being opened
    opened_at: float  # wall clock when the index first heard of it
    groups: dict[tuple[str, int], _Group] = field(default_factory=dict)
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
    stale: bool  # silent for longer than the index's stale_after_s: shown, never dropped

    @property
    def num_blocks(self) -> int:
        """Physical blocks held, every medium and group."""
        return sum(group.num_blocks for group in self.groups)


@dataclass(frozen=True)
class PodMatch:
    """How much of a prompt one pod holds, from its start."""

    pod: str  # the pod
    matched_blocks: int  # consecutive blocks from the prompt's start the pod holds
    matched_tokens: int  # the tokens they cover
    stale: bool  # whether the pod is stale (its answer may be out of date)


@dataclass(frozen=True)
class RouteResult:
    """A prompt matched against every pod, best first: the pick of a longest-prefix scorer."""

    num_prompt_tokens: int  # the prompt's length
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


@dataclass(frozen=True)
class PrefixNode:
    """One block-sized step of a prefix, merged across pods."""

    node_id: int  # index in PrefixTree.nodes
    parent_id: int | None  # the node before it; None for a first block
    depth: int  # 1 for a first block
    num_tokens: int  # tokens from the prompt's start through this block
    token_ids: tuple[int, ...]  # this block's tokens
    pods: frozenset[str]  # the pods holding this prefix
    copies: int  # physical blocks holding it, all pods together

    @property
    def replicas(self) -> int:
        """How many pods hold this prefix."""
        return len(self.pods)


@dataclass(frozen=True)
class PrefixTree:
    """The cross-pod prefix tree of one (medium, group)."""

    nodes: tuple[PrefixNode, ...]  # parents before children
    truncated: bool  # whether max_nodes cut it short
    unreachable: dict[
        str, int
    ]  # per pod, held blocks not reachable from a root (parent not held or tokens unknown)


@dataclass(slots=True)
class _NodeDraft:
    """A PrefixNode while prefix_tree builds it."""

    parent_id: int | None  # see PrefixNode
    depth: int  # see PrefixNode
    num_tokens: int  # see PrefixNode
    tokens: bytes  # packed token ids of this block
    pods: set[str] = field(default_factory=set)  # pods holding it so far
    copies: int = 0  # physical blocks so far


class FleetIndex:
    """The blocks every pod holds; a `BatchSink`. Thread-safe."""

    def __init__(
        self, stale_after_s: float = DEFAULT_STALE_AFTER_S, clock: Callable[[], float] = time.time
    ) -> None:
        """Args:
        stale_after_s: a pod silent for longer is marked stale.
        clock: wall clock (seconds since the epoch), replaceable in tests.
        """
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be positive, got {stale_after_s!r}")
        self.stale_after_s = stale_after_s  # the silence after which a pod is stale
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
                        group = groups[key] = _Group()
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

    @staticmethod
    def _seconds_silent(pod: _Pod, now: float) -> float:
        heard_at = pod.last_received_at if pod.last_received_at is not None else pod.opened_at
        return max(0.0, now - heard_at)

    def _summary(self, name: str, pod: _Pod, now: float) -> PodSummary:
        silent = self._seconds_silent(pod, now)
        groups = tuple(
            GroupSummary(medium, group_idx, len(group.blocks), group.num_copies)
            for (medium, group_idx), group in sorted(pod.groups.items())
            if group.blocks
        )
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
            seconds_silent=silent,
            stale=silent > self.stale_after_s,
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
        previous match and whose token ids are the prompt's next `block_size` tokens. The match is
        what the pod holds; its engine still recomputes at least the prompt's last token.

        Raises:
            OverflowError: a token id is negative or not below 2**32.
        """
        prompt = pack_tokens(token_ids)
        now = self._clock() if now is None else now
        with self._lock:
            matches = []
            for name, pod in self._pods.items():
                group = pod.groups.get((medium, group_idx))
                blocks, tokens = group.walk(prompt) if group is not None else (0, 0)
                stale = self._seconds_silent(pod, now) > self.stale_after_s
                matches.append(PodMatch(name, blocks, tokens, stale))
        matches.sort(key=lambda match: (-match.matched_tokens, match.pod))
        return RouteResult(len(token_ids), medium, group_idx, tuple(matches))

    def prefix_tree(self, medium: str = DEFAULT_MEDIUM, group_idx: int = 0, max_nodes: int = 10_000) -> PrefixTree:
        """The prefixes every pod holds in one (medium, group), merged by token content.

        Args:
            medium: the medium.
            group_idx: the KV group.
            max_nodes: at most this many nodes (the rest is cut, and `truncated` says so).
        """
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be positive, got {max_nodes}")
        drafts: list[_NodeDraft] = []
        node_of: dict[tuple[int | None, bytes], int] = {}  # (parent node, tokens) -> node
        truncated = False
        unreachable: dict[str, int] = {}
        with self._lock:
            for name in sorted(self._pods):
                group = self._pods[name].groups.get((medium, group_idx))
                if group is None:
                    continue
                reached = 0
                stack: list[tuple[BlockHash | None, int | None]] = [(None, None)]  # (block, its node)
                while stack:
                    parent_hash, parent_id = stack.pop()
                    for tokens, hashes in group.children.get(parent_hash, {}).items():
                        node_id = node_of.get((parent_id, tokens))
                        if node_id is None:
                            if len(drafts) >= max_nodes:
                                truncated = True
                                continue
                            node_id = node_of[(parent_id, tokens)] = len(drafts)
                            parent = drafts[parent_id] if parent_id is not None else None
                            drafts.append(
                                _NodeDraft(
                                    parent_id=parent_id,
                                    depth=parent.depth + 1 if parent else 1,
                                    num_tokens=(parent.num_tokens if parent else 0) + len(tokens) // _TOKEN_BYTES,
                                    tokens=tokens,
                                )
                            )
                        draft = drafts[node_id]
                        draft.pods.add(name)
                        for block_hash in hashes:
                            draft.copies += group.blocks[block_hash].copies
                            reached += 1
                            stack.append((block_hash, node_id))
                unreachable[name] = len(group.blocks) - reached
        nodes = tuple(
            PrefixNode(
                node_id=node_id,
                parent_id=draft.parent_id,
                depth=draft.depth,
                num_tokens=draft.num_tokens,
                token_ids=unpack_tokens(draft.tokens),
                pods=frozenset(draft.pods),
                copies=draft.copies,
            )
            for node_id, draft in enumerate(drafts)
        )
        return PrefixTree(nodes=nodes, truncated=truncated, unreachable=unreachable)

    def check_invariants(self) -> None:
        """Raise IndexInvariantError if any invariant in the module docstring fails."""
        with self._lock:
            for name, pod in self._pods.items():
                for key, group in pod.groups.items():
                    _check_group(f"{name}{key}", group)


def _check_group(where: str, group: _Group) -> None:
    def fail(message: str) -> None:
        raise IndexInvariantError(f"{where}: {message}")

    if group.num_copies != sum(held.copies for held in group.blocks.values()):
        fail("num_copies is not the sum of the blocks' copies")
    linked: dict[BlockHash, tuple[BlockHash | None, bytes]] = {}
    for parent_hash, by_tokens in group.children.items():
        if not by_tokens:
            fail(f"an empty children map under {parent_hash!r}")
        for tokens, hashes in by_tokens.items():
            if not hashes:
                fail(f"an empty hash set under {parent_hash!r}")
            for block_hash in hashes:
                if block_hash in linked:
                    fail(f"{block_hash!r} is linked twice")
                linked[block_hash] = (parent_hash, tokens)
    sizes: Counter[int] = Counter()
    for block_hash, held in group.blocks.items():
        if held.copies < 1:
            fail(f"{block_hash!r} held with {held.copies} copies")
        if held.tokens is None:
            if block_hash in linked:
                fail(f"{block_hash!r} has no tokens but is linked")
            continue
        if len(held.tokens) != held.block_size * _TOKEN_BYTES:
            fail(f"{block_hash!r} holds {len(held.tokens) // _TOKEN_BYTES} tokens, block size {held.block_size}")
        if linked.pop(block_hash, None) != (held.parent_hash, held.tokens):
            fail(f"{block_hash!r} is not linked under its parent and tokens")
        sizes[held.block_size] += 1
    if linked:
        fail(f"linked hashes that are not held: {sorted(map(repr, linked))[:5]}")
    if sizes != group.block_sizes:
        fail(f"block_sizes {dict(group.block_sizes)} != {dict(sizes)}")
