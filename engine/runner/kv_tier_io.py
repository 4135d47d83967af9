"""The disk tier's byte copies: a step's stores and loads (engine/core/kv_tier.py decides them), and the writer thread.

Before a step's forward (engine/forward.py), in this order:

1. stores: the K/V of every block the pool evicted while scheduling is copied out of the runner's block
   memory (the forward may rewrite those blocks next) into a free row of the staging buffer, and the row
   is handed to the writer thread. With no free row the store is dropped at once (reported to the index,
   counted): the step never waits for the disk. An engine stopping (`write_back`) waits for rows instead.
2. loads: each promoted block's bytes are read from the data file into the load buffer and checked
   against their checksum; good ones are written into their fresh pool block on every full-attention
   layer, and a bad one (or one the file could not give back whole) is zeroed there and reported (its
   request recomputes it; engine/core/scheduler.py's `postprocess`).

    staging rows:  free --store (the step)--> queued --written or failed (the writer)--> free

The staging buffer is allocated once, `queue_blocks` rows of one block each: the step's copy-out touches
memory that is already mapped (a fresh gather of 66 SmolLM2 blocks, 47 MB, paid ~4 ms a block in page
faults on a 2-core VM), and rows free + queued + being written always equals `queue_blocks`, so what the
writer holds is bounded by construction.

The writer thread writes each store into its slot (engine/runner/kv_tier_files.py: flag cleared, bytes,
then the record with the checksum and the flag), reports it to the index's queue (`TierWrite`) and frees
its row. A write that fails (the disk) is reported as dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import numpy as np
import torch
import xxhash

from engine.core.kv_tier import TierLoad, TierStore, TierTransfers, TierWrite
from engine.runner.kv_tier_files import TierFiles

logger = logging.getLogger(__name__)

WRITE_QUEUE_BYTES = 64 << 20  # bytes of stores the writer may have waiting; more are dropped, never waited for
WRITE_BACK_WAIT_S = 60.0  # how long an engine stopping waits for one staging row before it drops the store


class DiskTier:
    """The torch side of one engine's disk tier, over the full-attention group's block memory."""

    def __init__(self, files: TierFiles, kv: torch.Tensor, *, queue_blocks: int | None = None) -> None:
        """Args:
            files: the opened tier.
            kv: the full-attention group's block memory, [layer, K|V, kv_head, block, slot, head_dim].
            queue_blocks: staging rows, the most stores waiting for the writer (default: as many as
                `WRITE_QUEUE_BYTES` hold, and no more than the tier has slots; >= 1).
        """
        geometry = files.geometry
        shape = (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[5])
        if tuple(geometry.block_shape) != shape or geometry.itemsize != kv.element_size():
            raise ValueError(f"the tier's slots hold {geometry.block_shape}, the runner's blocks {shape}")
        default = min(geometry.num_slots, max(1, WRITE_QUEUE_BYTES // geometry.slot_bytes))
        rows = queue_blocks if queue_blocks is not None else default
        if rows < 1:
            raise ValueError(f"the writer queue holds at least one block, got {rows}")
        self.files = files
        self.kv = kv
        self.writes: queue.SimpleQueue[TierWrite] = queue.SimpleQueue()  # reports, drained by the index
        pinned = kv.device.type == "cuda"  # host memory the device copies into without a bounce
        self._staging = torch.empty((rows, *shape), dtype=kv.dtype, pin_memory=pinned)
        self._staging_bytes = self._staging.view(torch.uint8).view(rows, -1).numpy()
        self._free_rows: queue.SimpleQueue[int] = queue.SimpleQueue()
        for row in range(rows):
            self._free_rows.put(row)
        self._queue: queue.Queue[tuple[TierStore, int] | None] = queue.Queue()  # bounded by the rows it carries
        self._load_bytes = np.empty(geometry.slot_bytes, np.uint8)
        self._copy_out, self._copy_in = self._block_copies()
        self._thread = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def _block_copies(self) -> tuple[Callable[[int, int], object], Callable[[int], object]]:
        """(copy pool block b into staging row r, copy the load buffer into pool block b).

        On the CPU they are numpy copies over the same memory: one thread each. A torch copy runs an OpenMP
        region per block, and on a busy 2-core machine each region waits for both threads to be scheduled
        (66 blocks' copies measured 16-130 ms with torch, 12-20 ms with numpy, at a load average of 9).
        """
        kv, shape = self.kv, tuple(self._staging.shape[1:])
        if kv.device.type != "cpu":
            loaded = torch.from_numpy(self._load_bytes).view(kv.dtype).view(shape)
            return (
                lambda row, block: self._staging[row].copy_(kv[:, :, :, block]),
                lambda block: kv[:, :, :, block].copy_(loaded),
            )
        pool = kv.view(torch.uint8).numpy()  # [layer, K|V, kv_head, block, slot, head_dim * itemsize]
        block_bytes = pool.shape[:3] + pool.shape[4:]
        staging = self._staging_bytes.reshape(len(self._staging_bytes), *block_bytes)
        loaded_bytes = self._load_bytes.reshape(block_bytes)
        return (
            lambda row, block: np.copyto(staging[row], pool[:, :, :, block]),
            lambda block: np.copyto(pool[:, :, :, block], loaded_bytes),
        )

    @torch.inference_mode()
    def execute(self, transfers: TierTransfers) -> list[TierLoad]:
        """The step's stores, then its loads. Returns the loads whose bytes failed their checksum.

        Raises:
            RuntimeError: the tier is closed and the step has transfers for it.
        """
        if (transfers.stores or transfers.loads) and self.closed:
            raise RuntimeError("the disk tier was closed (its engine was retired)")
        for store in transfers.stores:
            self._store(store, wait_s=None)
        return [load for load in transfers.loads if not self._load(load)]

    @torch.inference_mode()
    def write_back(self, transfers: TierTransfers) -> None:
        """An engine stopping: every store, waiting for staging rows as the writer frees them (up to
        `WRITE_BACK_WAIT_S` each), then every store written and the files flushed. Takes no loads."""
        if transfers.loads:
            raise ValueError("a write-back takes stores only")
        for store in transfers.stores:
            self._store(store, wait_s=WRITE_BACK_WAIT_S)
        self.drain()

    def _store(self, store: TierStore, wait_s: float | None) -> None:
        """Copy one block into a free staging row and queue it for the writer; with no free row (after
        `wait_s` seconds, None: at once) the store is dropped."""
        try:
            row = self._free_rows.get(timeout=wait_s) if wait_s is not None else self._free_rows.get_nowait()
        except queue.Empty:
            self.writes.put(TierWrite(store.slot, store.key, None))
            return
        self._copy_out(row, store.block_id)
        self._queue.put((store, row))

    def _load(self, load: TierLoad) -> bool:
        """Read one slot into its pool block; False (block zeroed) when the file cannot give it back whole or
        its checksum does not match."""
        try:
            self.files.read_slot(load.slot, self._load_bytes)
            good = xxhash.xxh3_64_intdigest(self._load_bytes) == load.checksum
        except OSError as exc:
            logger.warning("disk tier slot %d could not be read (%s): recomputing its block", load.slot, exc)
            good = False
        else:
            if not good:
                logger.warning("disk tier slot %d failed its checksum: recomputing its block", load.slot)
        if not good:
            self.kv[:, :, :, load.block_id] = 0
            return False
        self._copy_in(load.block_id)
        return True

    def _write_loop(self) -> None:
        """The writer thread: each queued store into its slot, reported, its row freed; until `close`."""
        while True:
            item = self._queue.get()
            if item is None:  # `close`: everything before it is written
                self._queue.task_done()
                return
            store, row = item
            try:
                raw = self._staging_bytes[row]
                checksum = xxhash.xxh3_64_intdigest(raw)
                self.files.write_slot(store, raw, checksum)
                self.writes.put(TierWrite(store.slot, store.key, checksum))
            except (OSError, ValueError) as exc:
                logger.warning("disk tier write of slot %d failed (%s): dropped", store.slot, exc)
                self.writes.put(TierWrite(store.slot, store.key, None))
            finally:
                self._free_rows.put(row)
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every queued store is written, then flush the files (an engine stopping)."""
        self._queue.join()
        self.files.flush()

    def close(self) -> None:
        """Write what is queued, end the writer thread and close the files (an engine retired: another engine
        may open the tier now). A closed tier takes no transfers. Safe to call twice."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join()
        self.files.close()

    @property
    def closed(self) -> bool:
        return not self._thread.is_alive()
