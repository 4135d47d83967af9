"""The two KV tiers as the console shows them: the memory pool (engine/core/block_pool.py) and the disk tier
(engine/core/kv_tier.py). Plain functions from the engine's `PoolStats` and `TierView` to DataFrames and
sentences; the Blocks, Overview and Settings pages lay them out.

A tier that stores and never loads pays for its space without serving a hit: `idle_tier_warning` says so
once it has stored more than IDLE_TIER_STORES blocks (a few stores before the first prefix comes back are
normal). Cells of the tables are strings, so a "—" (a counter a tier does not have) never mixes types.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd

from app.prompting import decode
from engine.core.kv_tier import TierStats
from engine.core.snapshot import PoolStats
from engine.core.tier_view import TierView

IDLE_TIER_STORES = 32  # stores after which a tier that never loaded is flagged
MAX_CONSOLE_OFFLOAD_GIB = 1024  # the Settings field's bound (EngineConfig's own is wider)
NONE = "—"
TIER_OFF = (
    "The disk tier is off: a block the pool evicts is gone, and its prefix is computed again. Turn it on in "
    "Settings (*Disk KV tier*: a directory and its size in GiB), or start the engine server with "
    "`python -m cli serve --offload-dir DIR --offload-gib G`."
)


def fmt_bytes(num: int) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1 (B, KiB, MiB, GiB, TiB)."""
    value, unit = float(num), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{int(value)} B" if unit == "B" else f"{value:,.1f} {unit}"


def memory_hit_tokens(stats: PoolStats) -> int:
    """Prefix-hit tokens the pool's memory served (the rest of the prefix hits came from the disk tier)."""
    return stats.prefix_hit_tokens - stats.tier_hit_tokens


def hits_by_tier(stats: PoolStats) -> str | None:
    """The prefix-hit tokens by tier ("memory M · disk D tokens"), or None without a disk tier."""
    if stats.tier is None:
        return None
    return f"memory {memory_hit_tokens(stats):,} · disk {stats.tier_hit_tokens:,} tokens"


def tier_table(stats: PoolStats) -> pd.DataFrame:
    """One row per tier (the memory pool, then the disk tier when there is one): occupancy, hit tokens,
    stores and loads, bytes, drops, corrupt loads, evictions."""
    pool_evictions = stats.evictions - stats.window_evictions
    rows = [
        {
            "tier": "memory (KV pool)",
            "occupancy": f"{stats.num_blocks - stats.free_blocks:,} / {stats.num_blocks:,} blocks",
            "hit tokens": f"{memory_hit_tokens(stats):,}",
            "stores": NONE,
            "loads": NONE,
            "bytes written": NONE,
            "bytes read": NONE,
            "drops": NONE,
            "corrupt": NONE,
            "evictions": f"{pool_evictions:,}",
        }
    ]
    tier = stats.tier
    if tier is not None:
        rows.append(
            {
                "tier": "disk",
                "occupancy": f"{tier.ready_blocks + tier.writing_blocks:,} / {tier.num_slots:,} blocks",
                "hit tokens": f"{stats.tier_hit_tokens:,}",
                "stores": f"{tier.stores:,}",
                "loads": f"{tier.loads:,}",
                "bytes written": fmt_bytes(tier.bytes_written),
                "bytes read": fmt_bytes(tier.bytes_read),
                "drops": f"{tier.drops:,}",
                "corrupt": f"{tier.corrupt:,}",
                "evictions": f"{tier.evictions:,}",
            }
        )
    return pd.DataFrame(rows)


def idle_tier_warning(tier: TierStats | None) -> str | None:
    """The flag of a disk tier that stored more than IDLE_TIER_STORES blocks and loaded none; else None."""
    if tier is None or tier.stores <= IDLE_TIER_STORES or tier.loads:
        return None
    return (
        f"The disk tier stored {tier.stores:,} blocks ({fmt_bytes(tier.bytes_written)}) and loaded none: it is "
        "paying for its disk without serving a hit. The evicted prefixes have not come back while the tier "
        "held them: the workload does not revisit them, or the tier is too small to keep them until it does."
    )


def occupancy_text(tier: TierStats) -> str:
    """The tier's slots by state ("R ready · W being written · F free of S slots")."""
    free = tier.num_slots - tier.ready_blocks - tier.writing_blocks
    return f"{tier.ready_blocks:,} ready · {tier.writing_blocks:,} being written · {free:,} free of {tier.num_slots:,} slots"


def disk_blocks_frame(view: TierView, tokenizer) -> pd.DataFrame:
    """The tier's listed blocks, most recently used first: LRU rank (1: the last one the tier gives up), key
    prefix, slot, store order, first token ids and their text."""
    blocks = view.blocks
    return pd.DataFrame(
        {
            "LRU rank": range(1, len(blocks) + 1),
            "key": [b.key for b in blocks],
            "slot": [b.slot for b in blocks],
            "store order": [b.stamp for b in blocks],
            "first token ids": [", ".join(map(str, b.first_token_ids)) + " …" for b in blocks],
            "text": [decode(tokenizer, b.first_token_ids) + " …" for b in blocks],
        }
    )


def check_offload(directory: str, gib: float) -> tuple[Path, float] | None:
    """The disk tier a Settings form asks for: None for a blank directory (no tier), else (directory, GiB).

    Changes nothing on disk: the directory, or its nearest existing parent, must be a directory a file can
    be made in (a probe file is made and removed), and its disk must have room for `gib` GiB beside the
    files the directory holds already (a tier reopened in place reuses its own).

    Raises:
        ValueError: GiB outside (0, MAX_CONSOLE_OFFLOAD_GIB], a path that is not a directory, a directory
            that cannot be made or written, or a disk without the room.
    """
    text = directory.strip()
    if not text:
        return None
    if not 0 < gib <= MAX_CONSOLE_OFFLOAD_GIB:
        raise ValueError(f"the disk tier's size must be more than 0 and at most {MAX_CONSOLE_OFFLOAD_GIB:,} GiB, got {gib:g}")
    path = Path(text).expanduser().resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"the disk tier's directory {str(path)!r} cannot be made: {str(existing)!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"the disk tier's directory {str(path)!r} cannot be made or written: {exc.strerror or exc}") from None
    held = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0
    room = os.statvfs(existing)
    free = room.f_bavail * room.f_frsize + held
    if gib * 2**30 > free:
        raise ValueError(f"the disk under {str(path)!r} has {fmt_bytes(free)} free for the tier, not {gib:g} GiB")
    return path, float(gib)
