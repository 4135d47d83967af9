"""The disk tier's files: one directory, opened once, checked against the engine that opens it.

    DIR/kv-tier.json   the identity: the cache namespace (model, weights, dtype, block size, attention spec,
                       KV layout) and the geometry (slot shape, slot count); written once, when the tier is made
    DIR/kv-tier.data   uint8 [num_slots, slot_bytes], read and written a slot at a time (pread/pwrite at
                       slot * slot_bytes: no page faults on a mapping, and the GIL let go while the kernel
                       copies): slot s holds one block's K/V of every full-attention layer, laid out as the
                       runner's block ([layer, K|V, kv_head, slot, dim])
    DIR/kv-tier.meta   numpy memmap, one record per slot: valid flag, chain key, parent key, the block's
                       token ids, the bytes' xxh3-64 checksum and the store's stamp (the LRU order)
    DIR/kv-tier.lock   a POSIX write lock held while an engine process has the tier open (its pid inside):
                       an engine in another process is refused until the first `close`s it or exits (the
                       kernel drops the lock with the process). POSIX locks belong to the process, so
                       engines of one process (a console restarting its own engine, tests) are not refused:
                       they hand the tier over in order (the old one stopped and closed first, app/hosting.py)

Crash-consistent per slot: a store clears the slot's valid flag, writes the bytes, then the record with its
checksum and the flag; a torn store leaves the slot invalid (ignored at start), and bytes changed after
their record was written fail their checksum when loaded (reported, recomputed, never served). A tier whose
identity differs from the engine's (another model, weights, dtype, block size or size) is refused at start
with an error naming what differs; so is a directory that is missing and cannot be made, or read-only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.core.errors import KVTierError
from engine.core.kv_tier import TierEntry, TierStore
from engine.core.namespace import CacheNamespace

FORMAT = "prefix-console kv tier 1"
HEADER, DATA, META, LOCK = "kv-tier.json", "kv-tier.data", "kv-tier.meta", "kv-tier.lock"
KEY_BYTES = 16
GIB = 1 << 30


class TierUnavailableError(KVTierError):
    """The disk tier's directory cannot be used (missing and uncreatable, read-only, or out of space)."""


class TierMismatchError(KVTierError):
    """The disk tier's directory holds a tier made by an engine of another model, dtype, block size or size."""


@dataclass(frozen=True)
class TierGeometry:
    """What one slot holds: one block of the full-attention layers, as the runner lays it out."""

    block_shape: tuple[int, ...]  # [layer, K|V, kv_head, slot, head_dim] of one block
    itemsize: int  # bytes per value of the KV dtype
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.itemsize

    @classmethod
    def sized(cls, block_shape: tuple[int, ...], itemsize: int, gib: float) -> TierGeometry:
        """As many slots as `gib` GiB hold.

        Raises:
            TierUnavailableError: not even one block fits.
        """
        slot_bytes = int(np.prod(block_shape)) * itemsize
        num_slots = round(gib * GIB) // slot_bytes  # to the byte: a size given as a float may fall just short
        if num_slots < 1:
            raise TierUnavailableError(f"offload_gib={gib} holds no block of {slot_bytes} bytes")
        return cls(tuple(block_shape), itemsize, num_slots)


def meta_dtype(block_size: int) -> np.dtype:
    """One slot's record in kv-tier.meta."""
    return np.dtype(
        [
            ("valid", "u1"),
            ("key", "u1", (KEY_BYTES,)),
            ("parent", "u1", (KEY_BYTES,)),
            ("checksum", "<u8"),
            ("stamp", "<u8"),
            ("tokens", "<i4", (block_size,)),
        ]
    )


class TierFiles:
    """The opened tier: its data file (by slot), its records (`meta`, a memmap) and the entries a previous
    engine left (`restored`)."""

    def __init__(self, directory: Path, namespace: CacheNamespace, geometry: TierGeometry) -> None:
        """Open (or make) the tier in `directory` for an engine of `namespace`.

        Raises:
            TierUnavailableError: the directory is missing and cannot be made, is read-only, the disk
                has no room for the tier's files, or another engine has the tier open.
            TierMismatchError: it holds a tier of another identity.
        """
        self.directory = directory
        self.geometry = geometry
        self.block_size = namespace.block_size
        _check_writable(directory)
        self._lock_fd: int | None = _take_lock(directory)
        try:
            self._open(namespace, geometry)
        except BaseException:
            self._release_lock()
            raise

    def _open(self, namespace: CacheNamespace, geometry: TierGeometry) -> None:
        directory = self.directory
        identity = {
            "format": FORMAT,
            "namespace": {**asdict(namespace), "attention_spec": list(namespace.attention_spec)},
            "block_shape": list(geometry.block_shape),
            "itemsize": geometry.itemsize,
            "num_slots": geometry.num_slots,
        }
        header = directory / HEADER
        fresh = not header.exists()
        if not fresh:
            _check_identity(header, identity)
        records = meta_dtype(self.block_size)
        self._data_fd = _open_data(directory / DATA, geometry.num_slots * geometry.slot_bytes, fresh)
        self.meta = _memmap(directory / META, records, (geometry.num_slots,), fresh)
        if fresh:  # the header last: a tier whose files were never made whole is made again
            header.write_text(json.dumps(identity, indent=1, sort_keys=True))
        self.restored = [] if fresh else self._written_entries()

    def _written_entries(self) -> list[TierEntry]:
        """The slots whose record says written, as ready entries (a key met twice keeps its newer store)."""
        meta = self.meta
        found: dict[bytes, TierEntry] = {}
        for slot in np.flatnonzero(meta["valid"] == 1).tolist():
            record = meta[slot]
            key = record["key"].tobytes()
            entry = TierEntry(
                key=key,
                parent_key=record["parent"].tobytes(),
                token_ids=tuple(int(t) for t in record["tokens"]),
                slot=slot,
                checksum=int(record["checksum"]),
                stamp=int(record["stamp"]),
            )
            if key not in found or found[key].stamp < entry.stamp:
                found[key] = entry
        return list(found.values())

    def write_slot(self, store: TierStore, raw: np.ndarray, checksum: int) -> None:
        """Write one block's bytes into its slot, crash-consistently: the record's flag cleared, the bytes,
        then the record with its checksum and the flag.

        Raises:
            OSError: the disk refused the bytes (the slot is left invalid).
        """
        record = self.meta[store.slot]
        record["valid"] = 0
        _pwrite_all(self._data_fd, raw, store.slot * self.geometry.slot_bytes)
        record["key"] = np.frombuffer(store.key, np.uint8)
        record["parent"] = np.frombuffer(store.parent_key, np.uint8)
        record["tokens"] = store.token_ids
        record["checksum"] = checksum
        record["stamp"] = store.stamp
        record["valid"] = 1

    def read_slot(self, slot: int, out: np.ndarray) -> None:
        """Read slot `slot`'s bytes into `out` (uint8, `slot_bytes` long).

        Raises:
            OSError: the read failed or came back short (a truncated file).
        """
        offset, done = slot * self.geometry.slot_bytes, 0
        view = memoryview(out).cast("B")
        while done < len(view):
            got = os.preadv(self._data_fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"the KV tier's data file ends inside slot {slot}")
            done += got

    def flush(self) -> None:
        """Push the data file's and the records' dirty pages to the disk."""
        os.fdatasync(self._data_fd)
        self.meta.flush()

    def close(self) -> None:
        """Flush, close the data file and give up the directory's lock, so another engine may open the tier
        (an engine being replaced). Nothing is read or written afterwards. Safe to call twice."""
        if self._lock_fd is None:
            return
        self.flush()
        os.close(self._data_fd)
        self._data_fd = -1  # a late read or write fails (EBADF), never lands in a file that reused the number
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the lock
            self._lock_fd = None


def _take_lock(directory: Path) -> int:
    """Hold the tier's lock file exclusively (its descriptor), with this process's pid written in it.

    Raises:
        TierUnavailableError: another engine holds it.
    """
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            os.close(fd)
            raise TierUnavailableError(f"the KV tier in {directory} cannot be locked: {exc}") from exc
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TierUnavailableError(
            f"the KV tier in {directory} is open in another engine process (pid {holder}): stop it first, "
            "or give this one another directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _pwrite_all(fd: int, raw: np.ndarray, offset: int) -> None:
    view, done = memoryview(raw).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _check_writable(directory: Path) -> None:
    """Make the directory if it is missing and prove a file can be made in it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise TierUnavailableError(
            f"offload_dir {str(directory)!r} is not a writable directory (missing and uncreatable, or "
            f"read-only): {exc.strerror or exc}"
        ) from exc


def _check_identity(header: Path, identity: dict[str, object]) -> None:
    """Refuse a tier whose identity differs from this engine's, naming the fields that differ."""
    try:
        found = json.loads(header.read_text())
    except (OSError, ValueError) as exc:
        raise TierMismatchError(f"{header} is unreadable ({exc}): remove the directory or choose another") from exc
    if found == identity:
        return
    mine: dict[str, object] = {**identity.pop("namespace"), **identity}  # type: ignore[dict-item]
    theirs = {**found.pop("namespace", {}), **found} if isinstance(found, dict) else {}
    differ = sorted(name for name in mine.keys() | theirs.keys() if mine.get(name) != theirs.get(name))
    detail = ", ".join(f"{name}: tier {theirs.get(name)!r}, engine {mine.get(name)!r}" for name in differ)
    raise TierMismatchError(
        f"offload_dir {str(header.parent)!r} holds a KV tier of another engine ({detail}); "
        "use another directory, or remove this one to start an empty tier"
    )


def _memmap(path: Path, dtype: np.dtype, shape: tuple[int, ...], fresh: bool) -> np.memmap:
    """The file as a writable memmap (made first when fresh, `_reserve`)."""
    size = int(np.prod(shape)) * dtype.itemsize
    try:
        _reserve(path, size, fresh)
        return np.memmap(path, dtype=dtype, mode="r+", shape=shape)
    except OSError as exc:
        raise _unavailable(path, size, exc) from exc


def _open_data(path: Path, size: int, fresh: bool) -> int:
    """The data file opened for reading and writing by offset (made first when fresh, `_reserve`)."""
    try:
        _reserve(path, size, fresh)
        return os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _unavailable(path, size, exc) from exc


def _reserve(path: Path, size: int, fresh: bool) -> None:
    """Make the file at its full size with its blocks reserved (`posix_fallocate`) when it is fresh or not
    that size, so a full disk refuses the tier now instead of failing a write later."""
    if fresh or not path.exists() or path.stat().st_size != size:
        with open(path, "wb") as file:
            os.posix_fallocate(file.fileno(), 0, size)


def _unavailable(path: Path, size: int, exc: OSError) -> TierUnavailableError:
    return TierUnavailableError(f"cannot make the KV tier file {path} of {size} bytes: {exc.strerror or exc}")
