"""What a cache capacity in tokens costs to buy: tokens -> GiB of KV -> accelerators -> money per hour.

    shape = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2, weight_bytes=269_060_736)
    offer = Accelerator(memory_gib=80, usable_share=0.9, price_per_hour=2.5)
    purchase(1_000_000, shape, offer)   # Purchase(kv_gib=21.46, accelerators=1, price_per_hour=2.5, ...)

KV bytes per token = 2 (K and V) × layers × KV heads × head size × dtype bytes. Every accelerator holds a
whole copy of the weights (data-parallel replicas, no tensor parallelism), so each one offers
`memory × usable_share − weights` bytes of KV; the count is the capacity over that, rounded up, and never
zero (a cache needs a model to serve it). No torch: the planner page and the CLI can both call it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The facts of a model that decide its KV footprint and its weights' footprint."""

    num_layers: int  # layers that keep KV (every layer of a full-attention model)
    num_kv_heads: int  # key/value heads per layer (fewer than query heads under GQA)
    head_dim: int  # head size
    dtype_bytes: int  # bytes per KV element (2 for bfloat16/float16, 4 for float32)
    weight_bytes: int  # bytes the weights take on each accelerator

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if self.weight_bytes < 0:
            raise ValueError(f"weight bytes must be 0 or more, got {self.weight_bytes}")

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) × layers × KV heads × head size × dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Accelerator:
    """One accelerator an operator could buy or rent."""

    memory_gib: float  # its memory
    usable_share: float  # of that memory, what the server may use (vLLM's gpu_memory_utilization)
    price_per_hour: float  # what one costs per hour, in the operator's currency

    def __post_init__(self) -> None:
        if not self.memory_gib > 0:
            raise ValueError(f"accelerator memory must be above 0 GiB, got {self.memory_gib}")
        if not 0 < self.usable_share <= 1:
            raise ValueError(f"usable share must be in (0, 1], got {self.usable_share}")
        if self.price_per_hour < 0:
            raise ValueError(f"price per hour must be 0 or more, got {self.price_per_hour}")


@dataclass(frozen=True)
class Purchase:
    """What one capacity takes."""

    capacity_tokens: int
    kv_bytes: int  # capacity × KV bytes per token
    kv_bytes_per_accelerator: int  # usable memory left after the weights, on each accelerator
    accelerators: int  # accelerators needed (at least 1)
    price_per_hour: float  # accelerators × the price of one

    @property
    def kv_gib(self) -> float:
        return self.kv_bytes / GIB


def kv_room(shape: ModelShape, accelerator: Accelerator) -> int:
    """Bytes of KV one accelerator holds after the weights.

    Raises:
        ValueError: the weights alone fill the usable memory (this model needs a larger accelerator).
    """
    usable = int(accelerator.memory_gib * accelerator.usable_share * GIB)
    room = usable - shape.weight_bytes
    if room <= 0:
        raise ValueError(
            f"the weights ({shape.weight_bytes / GIB:.1f} GiB) fill the usable {usable / GIB:.1f} GiB of a "
            f"{accelerator.memory_gib:g} GiB accelerator: choose a larger one"
        )
    return room


def purchase(capacity_tokens: int, shape: ModelShape, accelerator: Accelerator) -> Purchase:
    """What holding `capacity_tokens` tokens of KV takes on `accelerator`s running `shape`.

    Raises:
        ValueError: a negative capacity, or weights that leave no room for KV (see `kv_room`).
    """
    if capacity_tokens < 0:
        raise ValueError(f"capacity must be 0 tokens or more, got {capacity_tokens}")
    room = kv_room(shape, accelerator)
    kv_bytes = capacity_tokens * shape.kv_bytes_per_token
    count = max(1, math.ceil(kv_bytes / room))
    return Purchase(capacity_tokens, kv_bytes, room, count, count * accelerator.price_per_hour)
