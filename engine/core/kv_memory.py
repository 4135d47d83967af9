"""KV memory arithmetic, without torch: what a pool of blocks costs before any tensor exists, how many
blocks a configuration gets, and when a pool is too large for the machine.

The console sizes pools with it before it loads a model (and the model runner allocates exactly this
much per block), so the estimate and the allocation cannot drift apart. The engine sizes its pool with
`pool_num_blocks`; the console refuses a restart with `check_pool_fits` before the engine is built.
"""

from __future__ import annotations

import os

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per element, by dtype name
DEFAULT_NUM_BLOCKS = 1024  # blocks per KV group pool when a configuration gives neither size
MACHINE_MEMORY_SHARE = 0.8  # the largest share of the machine's memory a KV pool may take (CPU)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int) -> int:
    """Bytes one block of `block_size` token slots takes over `num_layers` layers, K and V.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


def pool_num_blocks(num_blocks: int | None, kv_memory_mb: int | None, bytes_per_block: int) -> int:
    """Blocks per KV group pool: `num_blocks` when given, else as many as `kv_memory_mb` MiB hold at
    `bytes_per_block` bytes each (every layer's K and V), else `DEFAULT_NUM_BLOCKS`.

    Raises:
        ValueError: `kv_memory_mb` holds less than one block.
    """
    if num_blocks is not None:
        return num_blocks
    if kv_memory_mb is None:
        return DEFAULT_NUM_BLOCKS
    num = kv_memory_mb * 2**20 // bytes_per_block
    if num < 1:
        raise ValueError(f"kv_memory_mb={kv_memory_mb} holds less than one block")
    return num


def pool_bytes(num_blocks: int, bytes_per_block: int) -> int:
    """Bytes of a pool of `num_blocks` blocks per KV group: each group keeps its own layers' K and V, so
    the groups together take `bytes_per_block` (over every layer) per block index."""
    return num_blocks * bytes_per_block


def machine_memory_bytes() -> int | None:
    """The machine's physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits(num_blocks: int, bytes_per_block: int, machine_bytes: int | None) -> None:
    """Refuse a pool in host memory that would take more than `MACHINE_MEMORY_SHARE` of the machine's
    `machine_bytes` (None: unknown, nothing refused).

    Raises:
        ValueError: the pool is too large, with both sizes.
    """
    needed = pool_bytes(num_blocks, bytes_per_block)
    if machine_bytes is not None and needed > MACHINE_MEMORY_SHARE * machine_bytes:
        raise ValueError(
            f"a pool of {num_blocks:,} blocks needs about {needed / 2**30:,.1f} GiB of KV memory; this "
            f"machine has {machine_bytes / 2**30:,.1f} GiB"
        )
