"""Small pieces every page shares: health banners, history-read guarding, read-your-writes, number formatting.

Read-your-writes: after an action whose rows the operator will look up at once (a reset, a release, a
finished request, a restart), the page calls `expect_in_history(host, what)`; every page that reads the
history calls `wait_for_history(host)` first, which waits (with a spinner) until the writer has stored
those rows, up to `HISTORY_WAIT_S`. Past that the page says so, shows what is stored, and reruns by itself
once the rows are in. The mark lives in the operator's session: other operators never wait for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TypeVar

import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from app.hosting import ConsoleHost

T = TypeVar("T")

REFRESH_S = 1.0  # live panels (metrics, request output)
SLOW_REFRESH_S = 5.0  # panels that read the history database
HISTORY_WAIT_S = 10.0  # longest a page waits for the writer to store what its operator just did (bound: 5 s)
PENDING_WRITE = "history_pending_write"  # session key of the operator's PendingWrite


@dataclass(frozen=True)
class PendingWrite:
    """Rows of an operator's action that the history pages wait for."""

    mark: int  # the writer's mark right after the action (see storage.write.writer: mark, wait)
    what: str  # what the rows are, as a page says it ("the reset's evictions")
    waited: bool = False  # a page already waited HISTORY_WAIT_S for them: later reads only look


def kept(key: str, default: object) -> dict[str, object]:
    """Widget arguments for a value that survives switching pages (and code may also set).

    The starting value goes through session state, never a `value=` argument, so pages can assign
    the key (after a submit, a click on the grid) without Streamlit's default-and-state warning.
    """
    st.session_state.setdefault(key, default)
    return {"key": key, "persist_state": "session"}


LIVE = "This console's collector"  # a Fleet page's source: the index this console's collector keeps live
HISTORY = "History database (every collector)"  # or what every collector sharing the database stored


def fleet_source(container, key: str, live: bool) -> str:
    """The Fleet pages' source radio in `container`: LIVE (offered only while this console's collector
    runs) or HISTORY; a remembered choice that is no longer offered falls back to the first."""
    views = [LIVE, HISTORY] if live else [HISTORY]
    if st.session_state.get(key) not in views:
        st.session_state[key] = views[0]
    return container.radio("Source", views, horizontal=True, **kept(key, views[0]))


def read_history(query: Callable[..., T], *args, **kwargs) -> T | None:
    """Run a storage query; on a database error show it (st.error) and return None."""
    try:
        return query(*args, **kwargs)
    except SQLAlchemyError as exc:
        st.error(f"History database unavailable ({type(exc).__name__}): {exc.__cause__ or exc}")
        return None


def health_banners(host: ConsoleHost) -> None:
    """What an operator must see on every page: a dead engine loop, a history database the writer cannot
    write (locked, full, read-only, unreachable), a writer process that had to be restarted, lost rows."""
    console = host.console
    unreachable = getattr(host, "engine_error", None)  # an attached engine server that does not answer
    if unreachable is not None:
        st.error(f"The engine server at {host.api_url} does not answer: {unreachable}. The console reconnects "
                 "by itself once it is back (a restarted server is picked up within seconds).")  # fmt: skip
        st.stop()
    if console.engine.failure is not None:
        st.error(
            f"The engine loop stopped after an error: {console.engine.failure!r}. "
            "Restart the engine from Settings."
        )
    stats = host.writer_stats()
    if stats.retrying:
        st.error(
            f"History database unavailable: {stats.last_error}. The writer keeps retrying; {stats.queued:,} rows "
            f"wait (the oldest for {fmt_duration(stats.lag_s)}). The engine keeps serving."
        )
    elif not stats.schema_ready and stats.last_error:
        st.warning(f"History database not ready: {stats.last_error}")
    if stats.restarts:
        st.warning(
            f"The history writer process stopped unexpectedly and was restarted "
            f"({stats.restarts} time{'s' if stats.restarts > 1 else ''}); the history goes on."
        )
    if stats.dropped or stats.failed_batches:
        st.warning(
            f"History writer lost data: {stats.dropped:,} rows dropped, {stats.failed_batches:,} batches failed"
            + (f" (last error: {stats.last_error})" if stats.last_error else "")
        )


def expect_in_history(host: ConsoleHost, what: str) -> None:
    """Call after an action: this operator's next history read waits until its rows are stored."""
    st.session_state[PENDING_WRITE] = PendingWrite(host.writer.mark(), what)


def wait_for_history(host: ConsoleHost) -> None:
    """Call before reading the history: wait until the rows of this operator's last action are stored.

    Shows a spinner while it waits, at most HISTORY_WAIT_S once per action; then (and on later reads until
    the rows are in) a warning that says what is missing and how far behind the writer is, and a check
    that reruns the page once the rows are stored.
    """
    pending: PendingWrite | None = st.session_state.get(PENDING_WRITE)
    if pending is None:
        return
    stored = host.writer.wait(pending.mark, timeout_s=0)
    if not stored and not pending.waited:
        with st.spinner(f"Waiting for the history writer to store {pending.what}…"):
            stored = host.writer.wait(pending.mark, timeout_s=HISTORY_WAIT_S)
        if not stored:
            pending = replace(pending, waited=True)
            st.session_state[PENDING_WRITE] = pending
    if stored:
        if st.session_state.get(PENDING_WRITE) == pending:
            del st.session_state[PENDING_WRITE]
        return
    lag = fmt_duration(host.writer_stats().lag_s)
    st.warning(
        f"The history writer has not stored {pending.what} yet (its oldest unwritten row is {lag} old). This "
        "page shows what is stored so far and reloads once it is in."
    )
    _reload_once_stored(host, pending)


@st.fragment(run_every=REFRESH_S)
def _reload_once_stored(host: ConsoleHost, pending: PendingWrite) -> None:
    if host.writer.wait(pending.mark, timeout_s=0):
        st.rerun()  # the whole page; its wait_for_history then finds the rows stored


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


def plural(count: int, word: str, many: str | None = None) -> str:
    """A count with its noun in agreement: "1 thread", "4 threads", "1,024 full blocks"."""
    return f"{count:,} {word if count == 1 else many or word + 's'}"


def threads_text(now: int, seconds_at: dict[int, float]) -> str:
    """The forward's thread count now and, where a governor moves it, the stepping time at each count:
    "2 now; stepped 41 s on 2, 3 s on 1" (issue 47 item 16: the governor's choices were invisible)."""
    spent = [f"{fmt_duration(seconds)} on {threads}" for threads, seconds in sorted(seconds_at.items(), reverse=True)
             if seconds > 0]  # fmt: skip
    return f"{now} now" + (f"; stepped {', '.join(spent)}" if spent else "")


def api_text(url: str | None) -> str:
    """Where clients send OpenAI requests (the API's routes are under /v1), or "no API"."""
    return "no API" if url is None else f"{url}/v1"


def age(epoch: float, now: float | None = None) -> str:
    return fmt_duration((now or time.time()) - epoch)
