"""The first visit's "loading the model…" notice. Imports nothing heavy: it must show before torch loads.

The console's first script run imports torch and transformers, loads the model (on the very first start
the packaged SmolLM2 GGUF is converted to safetensors first), allocates the KV pool, starts the history
writer and warms the model up: seconds to tens of seconds of a blank page unless something says so.
"""

from __future__ import annotations

import os
import threading

import streamlit as st

from engine.core.config import DEFAULT_MODEL

ENV_MODEL = "PREFIX_CONSOLE_MODEL"  # as app.hosting reads it (that module loads torch, this one must not)
HOST_STARTED = threading.Event()  # set by app.hosting once this server process has built its engine host


def loading_notice():
    """An `st.empty` slot that holds the notice while the engine host is not built yet (and nothing after).

    The entry script clears it once `get_host()` returns.
    """
    slot = st.empty()
    if not HOST_STARTED.is_set():
        model = os.environ.get(ENV_MODEL) or DEFAULT_MODEL
        slot.info(
            f"**Loading the model and starting the engine…**  \n"
            f"This happens once per server start: importing torch and transformers, loading **{model}** "
            "(on the very first start the packaged SmolLM2 weights are converted to safetensors, about "
            "30 s), allocating the KV block pool, starting the history writer and running one warm-up "
            "forward so that the first request is as fast as later ones. Later pages open at once.",
            icon=":material/hourglass_top:",
        )
    return slot
