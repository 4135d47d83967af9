"""prefix-console: the operator console of a paged prefix KV cache.

Run from the repository root with `streamlit run app`. This entry lists the pages (each a module in
`pages/`), starts the shared engine on first use and shows its status in the sidebar.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run app` puts only app/ on the path; the pages import engine/, storage/
    sys.path.insert(0, str(ROOT))
# Before torch loads (OpenMP reads it once): workers spin briefly where the kernel reports CPU pressure
# (the engine then drops threads while the Streamlit server, the writer child or another process wants a
# core), and sleep (PASSIVE) elsewhere; see engine/openmp.py.
from engine.openmp import set_openmp_defaults  # noqa: E402  (stdlib only)

set_openmp_defaults()

import streamlit as st  # noqa: E402

from app.loading import loading_notice  # noqa: E402  (light: the heavy imports come after the notice)

PAGES = ROOT / "pages"

st.set_page_config(page_title="prefix-console", page_icon=":material/memory:", layout="wide")
notice = loading_notice()  # shown only while the engine is not up yet: the first visit waits seconds

from app.hosting import get_host  # noqa: E402  (imports torch and transformers)
from app.ui import health_banners, plural  # noqa: E402

navigation = st.navigation(
    {
        "Cache": [
            st.Page(PAGES / "overview.py", title="Overview", icon=":material/monitoring:", default=True),
            st.Page(PAGES / "submit.py", title="Submit & fork", icon=":material/call_split:"),
            st.Page(PAGES / "blocks.py", title="Blocks", icon=":material/grid_view:"),
            st.Page(PAGES / "prefix_tree.py", title="Prefix tree", icon=":material/account_tree:"),
            st.Page(PAGES / "replay.py", title="Replay", icon=":material/replay:"),
        ],
        "History": [
            st.Page(PAGES / "evictions.py", title="Evictions", icon=":material/delete_sweep:"),
            st.Page(PAGES / "why.py", title="Why did it miss?", icon=":material/help:"),
        ],
        "Plan": [st.Page(PAGES / "capacity_planner.py", title="Capacity planner", icon=":material/insights:")],
        "Fleet": [
            st.Page(PAGES / "fleet_pods.py", title="Pods", icon=":material/dns:"),
            st.Page(PAGES / "fleet_tree.py", title="Fleet prefix tree", icon=":material/lan:"),
            st.Page(PAGES / "fleet_evictions.py", title="Fleet evictions", icon=":material/timelapse:"),
            st.Page(PAGES / "fleet_route.py", title="Route a prompt", icon=":material/alt_route:"),
        ],
        "Admin": [st.Page(PAGES / "settings.py", title="Settings", icon=":material/settings:")],
    },
    expanded=True,  # every page listed: Streamlit would fold those past the tenth under "View N more"
)

try:
    host = get_host()
except Exception as exc:  # a bad environment or a model that fails to load: say so, run no page
    notice.empty()
    st.error(f"The engine could not start: {exc}")
    st.stop()
notice.empty()

with st.container():  # one element whatever it holds: the page's live fragments keep their place in the tree
    health_banners(host)  # first: an attached engine server that does not answer stops the page here
console = host.console
threads = console.engine.forward_threads()
with st.sidebar:
    st.caption(  # named as this console's own engine: the Fleet pages show other servers
        "This console's own engine (not a fleet pod): "
        f"**{console.engine.loaded.model_id}** · {console.engine.num_blocks} blocks × "
        f"{console.config.block_size} tokens · {console.config.dtype} on {console.engine.loaded.device}, "
        f"{plural(threads, 'thread')}  \n"
        f"run `{console.run_id}`  \n"
        + (f"API: `{host.api_url}/v1`" if host.api_url else "no API (embedded engine: `make run` serves one)")
    )
    # Live panels rerun every second or so; Streamlit's "Running… / Stop" indicator would flicker with each.
    st.markdown("<style>[data-testid='stStatusWidget'] {visibility: hidden;}</style>", unsafe_allow_html=True)
    if console.engine.loaded.model_id.startswith("tiny-"):  # the test presets: seeded random weights
        st.caption(f"**{console.engine.loaded.model_id}** has random weights: its output is gibberish by design.")
navigation.run()
