"""Integer arithmetic the bookkeeping shares (pure Python, the standard library only)."""

from __future__ import annotations

from collections.abc import Sequence


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer >= numerator / denominator, exactly (no float): how many blocks of
    `denominator` slots hold `numerator` tokens. `denominator` must be positive; a numerator <= 0 gives
    0 or less, as the division does."""
    return -(-numerator // denominator)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` have in common (token ids, block ids). Compares the shorter
    length's slices at once first: equal prefixes, the common case, take no Python loop."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
