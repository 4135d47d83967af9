"""Time buckets that mean the same on every backend.

A bucket index is floor(time / seconds). SQLite has no floor() unless built with math functions, and
PostgreSQL rounds when it casts a float to an integer, so each gets its own expression.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ColumnElement, Integer, cast, func
from sqlalchemy.engine import Dialect


def bucket_index(dialect: Dialect, time_column: ColumnElement[float], seconds: float) -> ColumnElement[int]:
    """floor(time_column / seconds) as an integer, for non-negative times (epoch seconds).

    Raises:
        ValueError: seconds is not positive.
    """
    if seconds <= 0:
        raise ValueError(f"bucket seconds must be positive, got {seconds}")
    scaled = time_column / float(seconds)
    if dialect.name == "sqlite":
        return cast(scaled, Integer)  # truncation is floor for non-negative values
    return cast(func.floor(scaled), BigInteger)
