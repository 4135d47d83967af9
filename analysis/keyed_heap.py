"""A min-heap of distinct items whose priorities stay fixed while they are in it, with removal by item.

The policies that order blocks by a number (FIFO by insertion, LFU by uses, Belady by next use) keep
their evictable blocks here. A block's priority is set when it becomes evictable and does not change
until it stops being evictable, which is exactly what this structure supports:

    push(item, priority)   O(log n)
    remove(item)           O(1): the entry stays in the heap array, dead, until it surfaces
    peek()                 the live item with the smallest priority (ties: the one pushed first)

Dead entries are dropped when they reach the top, and the array is rebuilt from the live entries once
the dead outnumber them, so memory stays O(live items) and every operation is O(log n) amortized.

Invariants (checked by `check_invariants`):
  * `_live` maps each item in the heap to the sequence number of its one live entry;
  * the array holds `len(_live) + _dead` entries `(priority, sequence, item)` and is a binary min-heap;
  * an entry is live exactly when `_live.get(item) == sequence`.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Any

from engine.core.errors import InvariantError


class KeyedHeap:
    """Distinct hashable items, each with a fixed, comparable priority; the smallest comes out first."""

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, Hashable]] = []
        self._live: dict[Hashable, int] = {}  # item -> sequence number of its live entry
        self._dead = 0  # entries in _heap whose item was removed (or pushed again since)
        self._pushes = 0  # sequence numbers: break priority ties by push order

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._live

    def __iter__(self) -> Iterator[Hashable]:
        """The live items, in no particular order."""
        return iter(self._live)

    def push(self, item: Hashable, priority: Any) -> None:
        """Add `item` with `priority`.

        Raises:
            ValueError: `item` is already in the heap.
        """
        if item in self._live:
            raise ValueError(f"{item!r} is already in the heap")
        self._pushes += 1
        self._live[item] = self._pushes
        heapq.heappush(self._heap, (priority, self._pushes, item))

    def remove(self, item: Hashable) -> None:
        """Take `item` out.

        Raises:
            KeyError: `item` is not in the heap.
        """
        del self._live[item]
        self._dead += 1
        if self._dead > len(self._live) + 32:
            self._heap = [entry for entry in self._heap if self._live.get(entry[2]) == entry[1]]
            heapq.heapify(self._heap)
            self._dead = 0

    def discard(self, item: Hashable) -> None:
        """Take `item` out if it is in the heap."""
        if item in self._live:
            self.remove(item)

    def peek(self) -> Hashable:
        """The item with the smallest priority (the earliest pushed among equals).

        Raises:
            IndexError: the heap is empty.
        """
        heap, live = self._heap, self._live
        while heap:
            _, sequence, item = heap[0]
            if live.get(item) == sequence:
                return item
            heapq.heappop(heap)
            self._dead -= 1
        raise IndexError("peek into an empty heap")

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless the module docstring's invariants hold."""
        live_entries = {entry[2]: entry[1] for entry in self._heap if self._live.get(entry[2]) == entry[1]}
        if live_entries != self._live:
            raise InvariantError("a heap item has no live entry, or an entry is live for a removed item")
        if len(self._heap) != len(self._live) + self._dead:
            raise InvariantError(f"{len(self._heap)} entries for {len(self._live)} live and {self._dead} dead")
        for child in range(1, len(self._heap)):
            if self._heap[child] < self._heap[(child - 1) // 2]:
                raise InvariantError("the heap array is not a min-heap")
