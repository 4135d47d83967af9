"""The disk tier's byte copies: a step's stores and loads (engine/core/kv_tier.py decides them), and the writer thread.

Before a step's forward (engine/forward.py), in this order:

1. stores: the K/V of every block the pool evicted while scheduling is copied out of the runner's block
   memory in one gather (the forward may rewrite those blocks next) and handed to the writer thread through
   a bounded queue. A full queue drops the store at once (reported to the index, counted): the step never
   waits for the disk.
2. loads: each promoted block's bytes are read from the data file and checked against their checksum; good
   ones are written into their fresh pool block on every full-attention layer, and a bad one is zeroed
   there and reported (its request recomputes it; engine/core/scheduler.py's `postprocess`).

The writer thread writes each store into its slot (flag cleared, bytes, then the record with the checksum
and the flag; engine/runner/kv_tier_files.py) and reports it to the index's queue (`TierWrite`). A write
that fails (the disk) is reported as dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Sequence

import numpy as np
import torch
import xxhash

from engine.core.kv_tier import TierLoad, TierStore, TierTransfers, TierWrite
from engine.runner.kv_tier_files import TierFiles

logger = logging.getLogger(__name__)

WRITE_QUEUE_BYTES = 64 << 20  # bytes of stores the writer may have waiting; more are dropped, never waited for


class DiskTier:
    """The torch side of one engine's disk tier, over the full-attention group's block memory."""

    def __init__(self, files: TierFiles, kv: torch.Tensor, *, queue_blocks: int | None = None) -> None:
        """Args:
            files: the opened tier.
            kv: the full-attention group's block memory, [layer, K|V, kv_head, block, slot, head_dim].
            queue_blocks: the writer queue's bound, in blocks (default: as many as `WRITE_QUEUE_BYTES` hold, >= 1).
        """
        shape = (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[5])
        if tuple(files.geometry.block_shape) != shape or files.geometry.itemsize != kv.element_size():
            raise ValueError(f"the tier's slots hold {files.geometry.block_shape}, the runner's blocks {shape}")
        self.files = files
        self.kv = kv
        self.writes: queue.SimpleQueue[TierWrite] = queue.SimpleQueue()  # reports, drained by the index
        bound = queue_blocks if queue_blocks is not None else max(1, WRITE_QUEUE_BYTES // files.geometry.slot_bytes)
        if bound < 1:
            raise ValueError(f"the writer queue holds at least one block, got {bound}")  # 0 would be unbounded
        self._queue: queue.Queue[tuple[TierStore, np.ndarray]] = queue.Queue(maxsize=bound)
        self._thread = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._thread.start()

    @torch.inference_mode()
    def execute(self, transfers: TierTransfers) -> list[TierLoad]:
        """The step's stores, then its loads. Returns the loads whose bytes failed their checksum."""
        if transfers.stores:
            self._store(transfers.stores)
        return [load for load in transfers.loads if not self._load(load)]

    def _store(self, stores: Sequence[TierStore]) -> None:
        """Copy the blocks out (one gather) and queue them for the writer; drop what does not fit."""
        ids = torch.tensor([store.block_id for store in stores], device=self.kv.device)
        blocks = self.kv.index_select(3, ids).movedim(3, 0).contiguous().cpu()
        raw = blocks.view(torch.uint8).reshape(len(stores), -1).numpy()
        for store, row in zip(stores, raw):
            try:
                self._queue.put_nowait((store, row))
            except queue.Full:
                self.writes.put(TierWrite(store.slot, store.key, None))

    def _load(self, load: TierLoad) -> bool:
        """Read one slot into its pool block; False (block zeroed) when its checksum does not match."""
        raw = np.array(self.files.data[load.slot])
        if xxhash.xxh3_64_intdigest(raw.data) != load.checksum:
            logger.warning("disk tier slot %d failed its checksum: recomputing its block", load.slot)
            self.kv[:, :, :, load.block_id] = 0
            return False
        block = torch.from_numpy(raw).view(self.kv.dtype).view(self.files.geometry.block_shape)
        self.kv[:, :, :, load.block_id] = block.to(self.kv.device)
        return True

    def _write_loop(self) -> None:
        """The writer thread: each queued store into its slot, reported; for ever (a daemon)."""
        files = self.files
        while True:
            store, row = self._queue.get()
            try:
                checksum = xxhash.xxh3_64_intdigest(row.data)
                record = files.meta[store.slot]
                record["valid"] = 0
                files.data[store.slot] = row
                record["key"] = np.frombuffer(store.key, np.uint8)
                record["parent"] = np.frombuffer(store.parent_key, np.uint8)
                record["tokens"] = store.token_ids
                record["checksum"] = checksum
                record["stamp"] = store.stamp
                record["valid"] = 1
                self.writes.put(TierWrite(store.slot, store.key, checksum))
            except (OSError, ValueError) as exc:
                logger.warning("disk tier write of slot %d failed (%s): dropped", store.slot, exc)
                self.writes.put(TierWrite(store.slot, store.key, None))
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every queued store is written, then flush the files (an engine stopping)."""
        self._queue.join()
        self.files.flush()
