"""Small pieces every page shares: health banners, history-read guarding, number formatting."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TypeVar

import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from app.hosting import ConsoleHost

T = TypeVar("T")

REFRESH_S = 1.0  # live panels (metrics, request output)
SLOW_REFRESH_S = 5.0  # panels that read the history database


def kept(key: str, default: object) -> dict[str, object]:
    """Widget arguments for a value that survives switching pages (and code may also set).

    The starting value goes through session state, never a `value=` argument, so pages can assign
    the key (after a submit, a click on the grid) without Streamlit's default-and-state warning.
    """
    st.session_state.setdefault(key, default)
    return {"key": key, "persist_state": "session"}


def read_history(query: Callable[..., T], *args, **kwargs) -> T | None:
    """Run a storage query; on a database error show it (st.error) and return None."""
    try:
        return query(*args, **kwargs)
    except SQLAlchemyError as exc:
        st.error(f"History database unavailable ({type(exc).__name__}): {exc.__cause__ or exc}")
        return None


def health_banners(host: ConsoleHost) -> None:
    """Errors an operator must see on every page: a dead engine loop, a database the writer can't use."""
    console = host.console
    if console.engine.failure is not None:
        st.error(
            f"The engine loop stopped after an error: {console.engine.failure!r}. "
            "Restart the engine from Settings."
        )
    stats = host.writer_stats()
    if stats.dropped or stats.failed_batches:
        st.warning(
            f"History writer lost data: {stats.dropped} rows dropped, {stats.failed_batches} batches failed"
            + (f" (last error: {stats.last_error})" if stats.last_error else "")
        )
    elif not stats.schema_ready and stats.last_error:
        st.warning(f"History database not ready: {stats.last_error}")


def fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return "—"
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_clock(epoch: float | None) -> str:
    """Time of day in UTC to the millisecond ("23:14:18.042"): the events of one block are close together."""
    if epoch is None:
        return "—"
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%H:%M:%S.%f")[:12]


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def age(epoch: float, now: float | None = None) -> str:
    return fmt_duration((now or time.time()) - epoch)
