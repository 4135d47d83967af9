"""Integer arithmetic the bookkeeping shares (pure Python, no imports)."""

from __future__ import annotations


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer >= numerator / denominator, exactly (no float): how many blocks of
    `denominator` slots hold `numerator` tokens. `denominator` must be positive; a numerator <= 0 gives
    0 or less, as the division does."""
    return -(-numerator // denominator)
