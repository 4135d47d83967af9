"""Which browser tab of this console submitted which request, so a page can name a request's owner before
an operator acts on it (releasing or forking another tab's request).

    tab = this_tab()                       # "tab 2": this browser session's label, kept in its session state
    claim(run_id, "req-4")                 # this tab submitted (or forked) req-4 in that run
    owner(run_id, "req-4")                 # "tab 2"; None for a request no tab of this console submitted

One registry per server process (`st.cache_resource`), shared by every session and guarded by a lock.
Requests that came another way (the guided scenario, the HTTP API) have no owner here.
"""

from __future__ import annotations

import itertools
import threading

import streamlit as st

TAB_KEY = "console_tab"  # session key of this tab's label


class Owners:
    """Tab labels, handed out in order, and the tab that claimed each (run, request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tabs = itertools.count(1)
        self._owners: dict[tuple[str, str], str] = {}

    def new_tab(self) -> str:
        with self._lock:
            return f"tab {next(self._tabs)}"

    def claim(self, run_id: str, request_id: str, tab: str) -> None:
        with self._lock:
            self._owners[(run_id, request_id)] = tab

    def owner(self, run_id: str, request_id: str) -> str | None:
        with self._lock:
            return self._owners.get((run_id, request_id))


@st.cache_resource
def owners() -> Owners:
    return Owners()


def this_tab() -> str:
    """This browser session's label ("tab 1", "tab 2", ...), handed out on its first call."""
    if TAB_KEY not in st.session_state:
        st.session_state[TAB_KEY] = owners().new_tab()
    return st.session_state[TAB_KEY]


def claim(run_id: str, request_id: str) -> None:
    owners().claim(run_id, request_id, this_tab())


def owner(run_id: str, request_id: str) -> str | None:
    return owners().owner(run_id, request_id)


def is_mine(run_id: str, request_id: str) -> bool:
    return owner(run_id, request_id) == this_tab()


def owned_by_text(run_id: str, request_id: str) -> str:
    """Who submitted a request, as a sentence names it: "this tab", "tab 3", or "no tab of this console"."""
    who = owner(run_id, request_id)
    if who is None:
        return "no tab of this console (the scenario or the API)"
    return "this tab" if who == this_tab() else who
