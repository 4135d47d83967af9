"""One pod's held blocks in one (medium, KV group): `BlockGroup`, with the copy counting and the tree walk.

Held blocks by hash:

    hash -> HeldBlock(copies, parent_hash, tokens, block_size, first/last stored)

`copies` counts physical blocks: each BlockStored of a hash adds one, each BlockRemoved of it takes one
away, and the hash is held until the last copy goes (vLLM does not de-duplicate, and sends one
BlockRemoved per physical copy).

The prefix tree. A block's place is its parent hash and its own token ids (BlockStored carries both).
A group keeps its held blocks by parent hash, then by token ids (`children`), so a prompt can be walked
from the root without the pod's hash function (which the console cannot recompute: vLLM seeds it per
deployment, and SGLang namespaces it).

Invariants (`check_group`):
  * every held block has copies >= 1, and a group's `num_copies` is the sum of its blocks' copies;
  * a held block with known tokens is in `children[parent_hash][tokens]` and nowhere else in
    `children`; every hash in `children` is held with those tokens and that parent; no empty
    container stays in `children`;
  * a held block's tokens are `block_size` token ids.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fleet.events import BlockHash, BlockStored

# Token ids are packed four bytes each (msgspec already checked 0 <= id < 2**32): a held block costs
# one bytes object instead of one int object per token, and a packed slice of a prompt is a dict key.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
TOKEN_BYTES = 4


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


class Reach(NamedTuple):
    """Where a walk of a prompt through a group got to."""

    blocks: int  # blocks it matched (beyond where it started)
    tokens: int  # prompt tokens matched from the prompt's start, where it started included
    ends: tuple[BlockHash | None, ...]  # the hashes of its last blocks (several: twins with the same tokens)


class BlockGroup:
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
        step = size * TOKEN_BYTES
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
        reach = self.walk_from(prompt, ((None, 0),))
        return reach.blocks, reach.tokens

    def walk_from(self, prompt: bytes, starts: Sequence[tuple[BlockHash | None, int]]) -> Reach:
        """The longest run of held blocks matching `prompt` (packed) on from any of `starts`.

        Args:
            prompt: the packed prompt.
            starts: (parent hash, tokens matched so far) pairs, all with the same token count: the run
                hangs from one of the parents (None: the root) and matches the prompt from that token on.

        Returns:
            The deepest match: its new blocks, the tokens matched from the prompt's start, and the hashes
            it ends at (the starts' parents when nothing more matched).
        """
        start_tokens = starts[0][1] if starts else 0
        best = Reach(0, start_tokens, tuple(parent for parent, _ in starts))
        num_prompt_tokens = len(prompt) // TOKEN_BYTES
        sizes = tuple(self.block_sizes)
        stack: list[tuple[BlockHash | None, int, int]] = [(parent, tokens, 0) for parent, tokens in starts]
        while stack:
            parent, start, depth = stack.pop()
            by_tokens = self.children.get(parent)
            if by_tokens is None:
                continue
            for size in sizes:
                end = start + size
                if end > num_prompt_tokens:
                    continue
                for block_hash in by_tokens.get(prompt[start * TOKEN_BYTES : end * TOKEN_BYTES], ()):
                    if end > best.tokens:
                        best = Reach(depth + 1, end, (block_hash,))
                    elif end == best.tokens and block_hash not in best.ends:  # a twin: the next tier may hang from it
                        best = best._replace(ends=(*best.ends, block_hash))
                    stack.append((block_hash, end, depth + 1))
        return best


def check_group(where: str, group: BlockGroup) -> None:
    """Raise IndexInvariantError if one of the invariants in the module docstring fails for `group`."""

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
        if len(held.tokens) != held.block_size * TOKEN_BYTES:
            fail(f"{block_hash!r} holds {len(held.tokens) // TOKEN_BYTES} tokens, block size {held.block_size}")
        if linked.pop(block_hash, None) != (held.parent_hash, held.tokens):
            fail(f"{block_hash!r} is not linked under its parent and tokens")
        sizes[held.block_size] += 1
    if linked:
        fail(f"linked hashes that are not held: {sorted(map(repr, linked))[:5]}")
    if sizes != group.block_sizes:
        fail(f"block_sizes {dict(group.block_sizes)} != {dict(sizes)}")
