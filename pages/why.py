"""Why did it miss: one request's cause from the history (analysis/why.py), and a run's misses by cause.

A request the history does not hold yet (the writer stores it within seconds; longer under load) is looked
for again by a fragment every RECHECK_S, for RECHECK_FOR_S at most, and explained once it lands: the page
never stays stale until someone presses Refresh. The picked and the typed request are one choice: typing an
id sets the list to "(type one)", picking one from the list clears the typed id.
"""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from analysis.why import Decoder, WhyError, diagnose, summarize
from analysis.why_tiers import TierLookups, tier_words
from app.hosting import get_host
from app.ui import fmt_time, kept, read_history, wait_for_history
from engine.core.snapshot import newest_first
from serving.prompts import load_tokenizer
from storage.read.tier_history import request_promotions, tier_fate
from storage.read.why import find_request, latest_eviction, requests_before, run_requests

RECHECK_S = 2.0  # how often the page looks for a request the history does not hold yet
RECHECK_FOR_S = 600.0  # and for how long, after which Refresh looks again
CAUSES = {
    "hit": "Everything reusable was served (the last prompt token and a partial tail are always computed).",
    "fork": "A fork child: it shares its parent's blocks (a partial tail too), so all the parent held was served.",
    "new": "No earlier request shared even the first block: nothing could have been reused.",
    "extended": "This prompt continues an earlier request's whole cached context (its prompt and its reply, as a "
                "chat's next turn does): all of it was served; the tokens after it were never computed.",
    "diverged": "An earlier request shared the first tokens, then the prompt differed.",
    "evicted": "An earlier request's blocks held these tokens, and they were evicted before this request came.",
    "both_tiers": "Evicted from both tiers: an earlier request's blocks held these tokens, the pool evicted them and "
                  "then the disk tier did too (or did not take them) before this request came. A larger disk tier "
                  "would have served them.",
    "namespace": "The same tokens are cached under another namespace (tenant salt, model, weights, dtype).",
    "window": "Sliding-window state was not ready: the request replayed from the window's boundary.",
}

host = get_host()
console = host.console
state = st.session_state

st.title("Why did it miss?")
st.caption(
    "Pick a request (the console's own, or an API response's id) to see why its prompt tokens were or were not "
    "served from the prefix cache, down to the token. Read from the history, so earlier runs count too."
)
if host.api_url is not None:
    st.caption(f"OpenAI-compatible API: `{host.api_url}/v1` (a response's `id` is its request id here).")

TYPE_ONE = "(type one)"


def picked_from_the_list() -> None:
    if state["why_pick"] != TYPE_ONE:
        state["why_typed"] = ""  # the list's choice replaces a typed id


options = [TYPE_ONE, *(view.request_id for view in newest_first(console.engine.requests()))]
if str(state.get("why_typed", "")).strip():  # a typed id is the choice: the list says so
    state["why_pick"] = TYPE_ONE
elif state.get("why_pick") not in options:  # a restart, or the first visit: the newest request
    state["why_pick"] = options[1] if len(options) > 1 else TYPE_ONE
c = st.columns([2, 2, 1])
picked = c[0].selectbox("Request of this run", options, on_change=picked_from_the_list, **kept("why_pick", TYPE_ONE))
typed = c[1].text_input("Or any request id", **kept("why_typed", ""))
c[2].button("Refresh", key="why_refresh")
request_id = typed.strip() or (picked if picked != TYPE_ONE else None)


TIERS = TierLookups(lambda *request: request_promotions(host.db, *request), lambda *key: tier_fate(host.db, *key))


def decoder_for(model: str) -> Decoder:
    if model == str(console.engine.loaded.model_id):
        return Decoder.of(console.tokenizer)
    return Decoder.of(load_tokenizer(model, console.config.resolved_data_dir))


def show(answer: dict) -> None:
    top = st.columns(6)
    top[0].metric("Cause", answer["cause"])
    top[1].metric("First token not served", answer["position"])
    top[2].metric("Cached", f"{answer['cached_tokens']} / {answer['prompt_tokens']}",
                  help="prompt tokens served from the prefix cache, of the prompt's tokens")  # fmt: skip
    top[3].metric("Missed", answer["missed_tokens"], help="cacheable prompt tokens the cache did not serve")
    top[4].metric("Never served", answer["never_served_tokens"],
                  help="the last prompt token and the partial block before it: always computed, never looked up "
                       "(cached + missed + never served = the prompt)")  # fmt: skip
    top[5].metric("Reusable", answer["reusable_tokens"], help="what a cache that never evicted would have served")
    st.info(CAUSES[answer["cause"]])
    if answer.get("disk"):
        d = answer["disk"]
        st.markdown(f"**Served from disk: {d['tokens']} tokens** (tokens {d['start']}–{d['end'] - 1}, read from "
                    f"tier slots {d['slots']} into pool blocks {d['blocks']}); {d['memory_tokens']} from "
                    "memory.")  # fmt: skip
    if answer["match"]:
        m = answer["match"]
        shared = m["shared_tokens"]
        if answer["cause"] == "fork":
            st.markdown(f"A fork of **{m['request_id']}**: it shares the parent's **{shared}** tokens of KV.")
        else:
            st.markdown(f"Earlier request **{m['request_id']}** (run `{m['run_id']}`) shared **{shared}** tokens "
                        "(its prompt and its output).")  # fmt: skip
    if answer["divergence"]:
        d = answer["divergence"]
        extended = answer["cause"] == "extended"
        where = "Its cached context ends at token" if extended else "Diverged at token"
        st.markdown(f"{where} **{d['position']}**, after `{d['before']}`")
        left, right = st.columns(2)
        left.caption("This request")
        left.code(d["ours"] or "(nothing)", language=None, wrap_lines=True)
        right.caption(f"{answer['match']['request_id']}")
        right.code(d["theirs"] or ("(its cached context ends here)" if extended else "(nothing)"), language=None,
                   wrap_lines=True)  # fmt: skip
        if d["template"] is not None:  # a template on one side only
            st.caption(f"Template tokens after the divergence: this request {d['template_tokens']['ours']}, "
                       f"the other {d['template_tokens']['theirs']}")  # fmt: skip
        for note in d["notes"]:
            st.warning(note)
    if answer["eviction"]:
        e = answer["eviction"]
        st.markdown(f"Evicted at **{fmt_time(e['at'])}** ({e['reason']}), block {e['block']} of group {e['group']}.")
    tier = answer.get("tier")
    if tier and tier["lost"]:
        st.markdown(f"**{tier_words(tier, fmt_time)}**.")
    if answer["namespace"]:
        differs = [{"field": k, "this request": v[0], "the other": v[1]} for k, v in answer["namespace"].items()]
        st.table(pd.DataFrame(differs))
    if answer["wait"]:
        w = answer["wait"]
        waited = f"{w['seconds'] * 1000:.1f} ms"
        st.markdown(f"Waited **{waited}** for **{w['request_id']}** to compute the shared prefix, then hit it.")
    if answer["window"]:
        st.markdown(f"Sliding-window state replayed from token **{answer['window']['r']}**.")
    for note in answer["notes"]:
        st.caption(note)


def explain(request_id: str) -> bool:
    """Show the request's diagnosis (kept in the session for `look_again`); False when the history does not
    hold the request yet."""
    request = read_history(find_request, host.db, request_id)
    if request is None:
        return False
    earlier = read_history(requests_before, host.db, request.arrival_time) or []
    try:
        evictions = lambda *key: latest_eviction(host.db, *key)  # noqa: E731
        diagnosis = diagnose(request, earlier, evictions, decoder_for(request.model), TIERS)
    except WhyError as exc:
        st.warning(str(exc))
    else:
        state["why_answer"] = (request_id, diagnosis.as_json())
        show(diagnosis.as_json())
    return True


@st.fragment(run_every=RECHECK_S)
def look_again(request_id: str) -> None:
    """A request not in the history yet: look for it every RECHECK_S (one indexed query), for RECHECK_FOR_S
    at most, and explain it here once it lands; later ticks show that answer without reading again."""
    answered = state.get("why_answer")
    if answered is not None and answered[0] == request_id:
        show(answered[1])
        return
    since = state.get("why_missing")
    if since is None or since[0] != request_id:
        since = state["why_missing"] = (request_id, time.time())
    waited = time.time() - since[1]
    if waited > RECHECK_FOR_S:
        st.warning(f"{request_id} is still not in the history after {waited / 60:.0f} min: check the id "
                   "(Refresh looks again).")  # fmt: skip
    elif not explain(request_id):
        st.warning(f"{request_id} is not in the history (yet): the writer stores a request within seconds. "
                   f"This page looks again every {RECHECK_S:.0f} s.")  # fmt: skip


wait_for_history(host)
if request_id is None:
    st.caption("Pick a request from the list, or type any request id." if len(options) > 1 else
               "No request yet: submit one (or send one through the API).")  # fmt: skip
else:
    state.pop("why_answer", None)  # a full run (Refresh) reads afresh and looks again for RECHECK_FOR_S
    if not explain(request_id):
        state.pop("why_missing", None)
        look_again(request_id)

with st.expander("This run's misses by cause"):
    requests = read_history(run_requests, host.db, console.run_id) or []
    if not requests:
        st.caption("No request of this run is in the history yet.")
    else:
        before = read_history(requests_before, host.db, requests[-1].arrival_time) or []
        others = [r for r in before if r.run_id != console.run_id]
        summary, _ = summarize(console.run_id, requests, others, lambda *key: latest_eviction(host.db, *key),
                               decoder_for(requests[0].model), TIERS)  # fmt: skip
        rows = [{"cause": cause, "requests": counts["requests"], "missed tokens": counts["missed_tokens"]}
                for cause, counts in summary.by_cause.items() if counts["requests"]]  # fmt: skip
        st.dataframe(pd.DataFrame(rows), hide_index=True)
        disk = f" ({summary.disk_cached_tokens} from disk)" if summary.disk_cached_tokens else ""
        st.caption(f"{summary.requests} requests, {summary.prompt_tokens} prompt tokens: {summary.cached_tokens} "
                   f"served from the cache{disk}, {summary.missed_tokens} missed, {summary.never_served_tokens} never "
                   "served (each prompt's last token and partial block).")  # fmt: skip
