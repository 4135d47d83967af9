"""KV memory arithmetic, without torch: what a pool of blocks costs before any tensor exists.

The console sizes pools with it before it loads a model (and the model runner allocates exactly this
much per block), so the estimate and the allocation cannot drift apart.
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per element, by dtype name


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int) -> int:
    """Bytes one block of `block_size` token slots takes over `num_layers` layers, K and V.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
