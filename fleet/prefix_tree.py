"""The cross-pod prefix tree: the prefixes every pod holds in one (medium, KV group), merged by token content.

Across pods, blocks at the same place (the same parent prefix) with the same tokens are the same
prefix, whatever each pod's hash function: `build_prefix_tree` walks each pod's `BlockGroup` from the
root and merges them into one node, which says which pods hold it, with how many copies and since when.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fleet.events import BlockHash
from fleet.held_blocks import TOKEN_BYTES, BlockGroup, unpack_tokens


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
    first_stored: float  # publisher time the oldest of its blocks became held (its age's start)
    last_stored: float  # publisher time of the latest store of any of its copies

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
    first_stored: float = float("inf")  # see PrefixNode
    last_stored: float = float("-inf")  # see PrefixNode


def build_prefix_tree(groups: Iterable[tuple[str, BlockGroup]], max_nodes: int) -> PrefixTree:
    """Merge the pods' groups of one (medium, KV group) into one tree (the caller holds their lock).

    Args:
        groups: (pod, its group), in the order the pods are merged (it fixes the node ids).
        max_nodes: at most this many nodes (the rest is cut, and `truncated` says so).
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be positive, got {max_nodes}")
    drafts: list[_NodeDraft] = []
    node_of: dict[tuple[int | None, bytes], int] = {}  # (parent node, tokens) -> node
    truncated = False
    unreachable: dict[str, int] = {}
    for name, group in groups:
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
                            num_tokens=(parent.num_tokens if parent else 0) + len(tokens) // TOKEN_BYTES,
                            tokens=tokens,
                        )
                    )
                draft = drafts[node_id]
                draft.pods.add(name)
                for block_hash in hashes:
                    held = group.blocks[block_hash]
                    draft.copies += held.copies
                    draft.first_stored = min(draft.first_stored, held.first_stored)
                    draft.last_stored = max(draft.last_stored, held.last_stored)
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
            first_stored=draft.first_stored,
            last_stored=draft.last_stored,
        )
        for node_id, draft in enumerate(drafts)
    )
    return PrefixTree(nodes=nodes, truncated=truncated, unreachable=unreachable)
