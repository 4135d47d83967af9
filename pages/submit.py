"""Submit & fork: find any request in the table at the top; write a prompt, see its exact token ids, submit
it, fork it, watch the output stream."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app.frames import requests_frame
from app.hosting import get_host
from app.ownership import claim, is_mine, owned_by_text
from app.prompting import CHAT, MODES, PRESETS, TEXT, TOKEN_IDS, decode, encode_prompt, parse_suffixes, token_pieces
from app.ui import REFRESH_S, expect_in_history, fmt_duration, kept, plural
from engine.core.arith import common_prefix
from engine.core.kv_groups import max_hit_blocks
from engine.core.request import SamplingParams
from engine.core.snapshot import newest_first
from engine.engine import RequestRejected

host = get_host()
console = host.console
engine = console.engine
tokenizer = console.tokenizer
block_size = console.config.block_size
state = st.session_state
FINISH_PX = 152  # the finish column: an abort reason as long as "the client disconnected" (136 px), whole
TABLE_PX = 250  # the Requests table's most height: about six rows, the rest scrolls

available_modes = [
    m for m in MODES if m == TOKEN_IDS or (tokenizer is not None and (m != CHAT or getattr(tokenizer, "chat_template", None)))
]
if state.get("submit_mode") not in available_modes:  # a restart may have loaded a model without a tokenizer
    state["submit_mode"] = available_modes[0]
state.setdefault("submit_last_ids", None)


def apply_preset() -> None:
    preset = PRESETS.get(state["submit_preset"])
    if preset is None:
        return
    state["submit_mode"] = preset.mode if preset.mode in available_modes else available_modes[0]
    state["submit_system"] = preset.system
    state["submit_text"] = preset.text


st.title("Submit & fork")

# ---------------------------------------------------------------- requests (every request, found by id)


REQUEST_TABLE_COLUMNS = {  # compact headers and pixel widths, in the table's order: all 14 columns fit the
    # 979 px of main area a 1,440 px window leaves beside the sidebar (measured)
    "request": st.column_config.TextColumn("request", width=120),  # whole ids ("scenario-3-child-1")
    "parent": st.column_config.TextColumn("parent", width=108),
    "status": st.column_config.TextColumn("status", width=68),
    "finish": st.column_config.TextColumn(
        "finish", width=FINISH_PX, help="Why it ended: length, eos, stop, or why it was aborted or refused"
    ),
    "retain": st.column_config.CheckboxColumn("kept", width=40, help="Retained: keeps its blocks after it finishes"),
    "prompt tokens": st.column_config.NumberColumn("prompt", width=56, help="Prompt tokens (a fork's inherited context included)"),
    "output tokens": st.column_config.NumberColumn("output", width=54),
    "hit position": st.column_config.NumberColumn("hit", width=40, help="Hit position h: tokens reused at its first schedule"),
    "computed tokens": st.column_config.NumberColumn("computed", width=68, help="Prefill tokens run through the model"),
    "hit source": st.column_config.TextColumn("source", width=56, help="prefix (index hit), fork, or none"),
    "cow copies": st.column_config.NumberColumn("CoW", width=40, help="Copy-on-write copies its writes made"),
    "preemptions": st.column_config.NumberColumn("preempt", width=62),
    "TTFT ms": st.column_config.NumberColumn("TTFT ms", width=64, format="%.0f"),
    "blocks": st.column_config.NumberColumn("blocks", width=48, help="Blocks it holds (or ended with)"),
}


@st.fragment(run_every=REFRESH_S)
def request_table() -> None:
    """Every request of the engine, newest first; those whose id or parent holds the search text."""
    frame = requests_frame(engine.requests())
    wanted = state.get("submit_find", "").strip().lower()
    if wanted:
        frame = frame[frame["request"].str.lower().str.contains(wanted, regex=False)
                      | frame["parent"].str.lower().str.contains(wanted, regex=False)]  # fmt: skip
    if frame.empty:
        st.caption(f"No request's id or parent's id holds “{wanted}”." if wanted else "No requests yet.")
    else:
        st.dataframe(frame, hide_index=True, height=min(TABLE_PX, 38 + 35 * len(frame)),
                     column_config=REQUEST_TABLE_COLUMNS, column_order=list(REQUEST_TABLE_COLUMNS))  # fmt: skip


with st.container(key="submit_requests"):  # first on the page: every request, in one place
    st.subheader("Requests")
    st.columns([2, 3])[0].text_input(
        "Find a request", placeholder="part of its id or its parent's: req-3, chatcmpl-dana", **kept("submit_find", "")
    )
    request_table()

# ---------------------------------------------------------------- prompt editor
st.subheader("Prompt")
left, right = st.columns([3, 2])
with left:
    st.selectbox("Preset", ["(none)", *PRESETS], **kept("submit_preset", "(none)"), on_change=apply_preset)
    mode = st.radio("Format", available_modes, **kept("submit_mode", available_modes[0]), horizontal=True)
    system = ""
    if mode == CHAT:
        system = st.text_area("System prompt", **kept("submit_system", ""), height=120)
    label = {TEXT: "Prompt", CHAT: "User message", TOKEN_IDS: "Token ids (comma or space separated)"}[mode]
    text = st.text_area(label, **kept("submit_text", ""), height=140, max_chars=200_000)

try:
    prompt_ids: list[int] | None = encode_prompt(tokenizer, mode, text=text, system=system, vocab_size=engine.vocab_size)
    preview_problem = None
except ValueError as exc:
    prompt_ids, preview_problem = None, str(exc)

with right:
    st.markdown("**Token ids the model will see**")
    if prompt_ids is None:
        st.caption(f"Nothing to show: {preview_problem}.")
    else:
        st.caption(
            f"{plural(len(prompt_ids), 'token')} · {plural(len(prompt_ids) // block_size, 'full block')} of "
            f"{block_size} (only full blocks enter the prefix cache)"
        )
        st.code(", ".join(map(str, prompt_ids)), language=None, wrap_lines=True, height=160)
        requests = newest_first(engine.requests())
        targets = {"(nothing)": None}
        if state["submit_last_ids"]:
            targets["my previous submission"] = state["submit_last_ids"]
        for r in requests[:200]:
            targets[r.request_id] = list(r.prompt_token_ids) + list(r.output_token_ids)
        if state.get("submit_compare") not in targets:
            state["submit_compare"] = "(nothing)"
        statuses = {r.request_id: r.status for r in requests}
        other_label = st.selectbox(
            "Compare with",
            list(targets),
            **kept("submit_compare", "(nothing)"),
            format_func=lambda t: f"{t} (prompt + output)" if t in statuses else t,  # no status: it changes
        )
        other = targets.get(other_label)
        if other is not None:
            d = common_prefix(prompt_ids, other)
            reusable = min(d // block_size, max_hit_blocks(len(prompt_ids), block_size))
            if d == len(prompt_ids) == len(other):
                st.info("Identical token ids.")
            else:
                ours = token_pieces(tokenizer, prompt_ids[d : d + 1]) or ["(end)"]
                theirs = token_pieces(tokenizer, other[d : d + 1]) or ["(end)"]
                st.info(
                    f"Shares the first **{d}** tokens ({reusable} full blocks reusable); diverges at position "
                    f"**{d}**: this prompt has `{ours[0]!r}`, the other has `{theirs[0]!r}`."
                )
        with st.expander("Tokens by block"):
            pieces = token_pieces(tokenizer, prompt_ids)
            st.dataframe(
                pd.DataFrame(
                    {
                        "block": [i // block_size for i in range(len(prompt_ids))],
                        "position": range(len(prompt_ids)),
                        "token id": prompt_ids,
                        "text": pieces,
                    }
                ),
                hide_index=True,
                height=240,
            )

# ---------------------------------------------------------------- sampling
st.subheader("Sampling")
# No bounds on the number boxes: a value out of range reaches SamplingParams, which refuses it with the
# reason (a bounded box shows it red and submits its previous value instead).
c = st.columns(5)
c[0].number_input("Max new tokens", step=1, **kept("submit_max_new", 32))
c[1].number_input("Temperature", step=0.1, **kept("submit_temperature", 0.0), help="0 is greedy")
c[2].number_input("Top-p", step=0.05, **kept("submit_top_p", 1.0))
c[3].number_input("Seed", step=1, **kept("submit_seed", None), placeholder="engine default")
c[4].checkbox("Ignore EOS", **kept("submit_ignore_eos", False), help="Always generate max new tokens")


def sampling() -> SamplingParams:
    """The submit section's sampling, from session state (a button's callback runs before the page does)."""
    seed = state["submit_seed"]
    return SamplingParams(
        max_new_tokens=int(state["submit_max_new"]),
        temperature=float(state["submit_temperature"]),
        top_p=float(state["submit_top_p"]),
        seed=None if seed is None else int(seed),
        ignore_eos=bool(state["submit_ignore_eos"]),
    )


# ---------------------------------------------------------------- submit
# Every action runs in its button's callback and leaves its outcome in session state, shown on every run
# until the next action of that section. Each section is one container, so the live fragments below sit
# at the same place in the page's element tree whatever a run draws (a fragment redrawn while a full run
# moved it crashed Streamlit's frontend: "Bad delta path index").


def show_outcome(key: str) -> None:
    """The section's last outcome, until its next action replaces it."""
    outcome = state.get(key)
    if outcome is not None:
        (st.success if outcome[0] == "success" else st.error)(outcome[1])


def submit_prompt() -> None:
    """The submit button's action: refused with the reason, or submitted with exactly what was typed."""
    retain = bool(state["submit_retain"])
    try:
        ids = encode_prompt(
            tokenizer, state["submit_mode"], text=state["submit_text"], system=state.get("submit_system", ""),
            vocab_size=engine.vocab_size,
        )  # fmt: skip
        wanted = state["submit_request_id"].strip() or None
        rid = engine.submit(ids, sampling(), request_id=wanted, retain=retain)
    except RequestRejected as exc:
        state["submit_outcome"] = ("error", f"Rejected: {exc}")
    except ValueError as exc:
        state["submit_outcome"] = ("error", f"Not submitted: {exc}")
    else:
        claim(console.run_id, rid)
        state["submit_last_ids"] = ids
        state["submit_watch"] = [rid]
        if retain:  # the newest request this tab retains is the one it means to fork
            state["submit_fork_parent"] = rid
            state["submit_release_pick"] = rid
        state["submit_outcome"] = ("success", f"Submitted **{rid}** ({len(ids)} prompt tokens).")


with st.container():
    c = st.columns([2, 1, 1])
    c[0].text_input("Request id (optional)", **kept("submit_request_id", ""), placeholder="assigned by the engine")
    c[1].checkbox("Retain as fork base", **kept("submit_retain", False), help="Keep its blocks after it finishes, to fork from")
    c[2].button("Submit", type="primary", key="submit_go", on_click=submit_prompt)
    show_outcome("submit_outcome")

# ---------------------------------------------------------------- fork


def fork_sampling() -> SamplingParams:
    """How the children sample: the fork section's own settings, not the submit section's."""
    return SamplingParams(
        max_new_tokens=int(state["submit_fork_max_new"]),
        temperature=float(state["submit_fork_temperature"]),
        ignore_eos=bool(state["submit_fork_ignore_eos"]),
    )


def fork_children() -> None:
    """The fork button's action: every child or none (Engine.fork_many checks them all first)."""
    parent = state.get("submit_fork_parent")
    try:
        if parent is None:
            raise ValueError("no request holds KV to fork: submit one (retained, or still running) first")
        suffixes = parse_suffixes(tokenizer, state["submit_fork_mode"], state["submit_fork_suffixes"], engine.vocab_size)
        created = engine.fork_many(parent, suffixes, fork_sampling(), retain=bool(state["submit_fork_retain"]))
    except RequestRejected as exc:
        state["submit_fork_outcome"] = ("error", f"Rejected: {exc} (no child was created)")
    except ValueError as exc:
        state["submit_fork_outcome"] = ("error", f"Not forked: {exc}")
    else:
        for child in created:
            claim(console.run_id, child)
        state["submit_watch"] = created
        whose = "" if is_mine(console.run_id, parent) else f" ({owned_by_text(console.run_id, parent)}'s request)"
        state["submit_fork_outcome"] = (
            "success", f"Forked {parent}{whose} into {len(created)} children: {', '.join(created)}.",
        )  # fmt: skip


def mine_first(request_ids: list[str]) -> list[str]:
    """`request_ids` (newest first) with this tab's own requests ahead of the others'."""
    return sorted(request_ids, key=lambda rid: not is_mine(console.run_id, rid))


@st.fragment(run_every=REFRESH_S)
def fork_parent_picker() -> None:
    """The parent box: only requests that hold KV (a finished one cannot be forked), this tab's newest
    first, re-listed every second so a request that finishes leaves it."""
    holding = mine_first([r.request_id for r in newest_first(engine.requests()) if r.holds_blocks])
    if not holding:
        state.pop("submit_fork_parent", None)
        st.caption("No request holds KV to fork: submit one (retained, or still running).")
        return
    if state.get("submit_fork_parent") not in holding:
        state["submit_fork_parent"] = holding[0]
    # Plain ids: Streamlit keeps a selectbox's value as its formatted label, so a label that changes
    # (a status in it) would turn the kept value into a stale label the next run cannot map back.
    parent = st.selectbox(
        "Parent (running or retained requests hold KV to share)", holding, **kept("submit_fork_parent", holding[0])
    )
    view = engine.get(parent)
    st.caption(  # the status and the owner live here, redrawn every second, never in the box's labels
        f"**{parent}** · `{view.status}`: holds {view.num_computed_tokens} tokens in {len(view.block_table)} "
        f"blocks; every child shares them and computes only what follows. Submitted by "
        f"{owned_by_text(console.run_id, parent)}."
    )


with st.container():
    st.subheader("Fork")
    c = st.columns([3, 1])
    with c[0]:
        fork_parent_picker()
    suffix_modes = [m for m in (TEXT, TOKEN_IDS) if m == TOKEN_IDS or tokenizer is not None]
    if state.get("submit_fork_mode") not in suffix_modes:
        state["submit_fork_mode"] = suffix_modes[0]
    c[1].radio("Suffix format", suffix_modes, **kept("submit_fork_mode", suffix_modes[0]))
    suffix_text = st.text_area(
        "Suffixes, one child per line", **kept("submit_fork_suffixes", ""), height=100,
        placeholder=" Answer in French.\n Answer in German.",
    )  # fmt: skip
    st.markdown("**The children's sampling** (their own: the submit section's settings are not used)")
    c = st.columns([1, 1, 1, 2])
    c[0].number_input("New tokens per child", step=1, **kept("submit_fork_max_new", 16))
    c[1].number_input("Child temperature", step=0.1, **kept("submit_fork_temperature", 0.0), help="0 is greedy")
    c[2].checkbox("Children skip EOS", **kept("submit_fork_ignore_eos", False), help="Always generate every new token")
    retain_children = c[3].checkbox(
        "Retain children", **kept("submit_fork_retain", False),
        help="Retained children keep their blocks after they finish (to inspect or fork again) until released",
    )  # fmt: skip
    num_children = sum(1 for line in suffix_text.splitlines() if line.strip())
    kept_or_not = "retained" if retain_children else "not retained"
    st.button(f"Fork children ({num_children}, {kept_or_not})", key="submit_fork_go", on_click=fork_children)
    st.caption(
        "Retained: they keep their blocks until you release them."
        if retain_children
        else "Not retained: each child frees its blocks as soon as it finishes, so its private blocks vanish "
        "from the Blocks page within seconds. Tick the box above to keep them."
    )
    show_outcome("submit_fork_outcome")

# ---------------------------------------------------------------- live output


@st.fragment(run_every=REFRESH_S)
def live_output() -> None:
    watched = st.session_state.get("submit_watch", [])
    if not watched:
        st.caption("Submit or fork to follow the output here.")
        return
    for rid in watched:
        try:
            view = engine.get(rid)
        except KeyError:
            continue
        done = len(view.output_token_ids)
        recorded = st.session_state.setdefault("submit_recorded", set())  # (run, request) seen done here
        if view.is_final and (console.run_id, rid) not in recorded:
            recorded.add((console.run_id, rid))  # its final record is with the writer now
            expect_in_history(host, f"{rid}'s record")
        with st.container(border=True):
            st.markdown(f"**{rid}** · `{view.status}`" + (f" ({view.finish_reason})" if view.finish_reason else ""))
            st.progress(min(1.0, done / view.max_new_tokens), text=f"{done}/{view.max_new_tokens} new tokens")
            st.text(decode(tokenizer, view.output_token_ids) or "…")
            st.caption(
                f"hit position {view.cached_tokens} of {view.num_prompt_tokens} · computed {view.computed_tokens} · "
                f"hit source {view.hit_source} · copy-on-write {view.cow_copies} · preemptions {view.preemptions} · "
                f"TTFT {fmt_duration(view.ttft_s)}"
            )


with st.container():
    st.subheader("Output")
    all_ids = [r.request_id for r in newest_first(engine.requests())]
    state["submit_watch"] = [rid for rid in state.get("submit_watch", []) if rid in all_ids]
    st.multiselect("Watch", all_ids, **kept("submit_watch", []), placeholder="Pick requests to follow")
    live_output()

# ---------------------------------------------------------------- release


def release(rid: str) -> None:
    try:
        engine.release(rid)
    except ValueError as exc:
        state["submit_release_outcome"] = ("error", f"Not released: {exc}")
    else:
        expect_in_history(host, f"the release of {rid}")
        state["submit_release_outcome"] = (
            "success", f"Released {rid}: its blocks return to the pool (cached blocks stay for hits).",
        )  # fmt: skip


def release_picked() -> None:
    """The release button's action (runs before the page draws, so the box never offers what it released).
    Another tab's request is released only once the operator confirms, having read whose it is."""
    rid = state.get("submit_release_pick")
    state.pop("submit_release_outcome", None)
    if rid is not None and not is_mine(console.run_id, rid):
        state["submit_release_confirm"] = rid
        return
    release(rid)


def release_confirmed() -> None:
    release(state.pop("submit_release_confirm"))


def release_cancelled() -> None:
    state.pop("submit_release_confirm", None)


@st.fragment(run_every=REFRESH_S)
def release_box() -> None:
    """Retained requests, this tab's newest first, re-listed every second (another operator may release one,
    or one may finish)."""
    releasable = mine_first([r.request_id for r in newest_first(engine.requests()) if r.releasable])
    pending = state.get("submit_release_confirm")
    if pending is not None and pending in releasable:
        st.warning(f"**{pending}** was submitted by {owned_by_text(console.run_id, pending)}, not this tab. Release it anyway?")
        c = st.columns([1, 1, 4])
        c[0].button("Confirm release", type="primary", key="submit_release_confirm_go", on_click=release_confirmed)
        c[1].button("Cancel", key="submit_release_cancel", on_click=release_cancelled)
    elif not releasable:
        st.caption("No retained request holds blocks.")
    else:
        if state.get("submit_release_pick") not in releasable:
            state["submit_release_pick"] = releasable[0]
        c = st.columns([3, 1])
        c[0].selectbox(
            "Retained request", releasable, key="submit_release_pick",
            help="This tab's requests first; another tab's is released only after you confirm",
        )  # fmt: skip
        c[1].button("Release", key="submit_release_go", on_click=release_picked)
        picked = state["submit_release_pick"]
        c[0].caption(f"**{picked}** · submitted by {owned_by_text(console.run_id, picked)}")
    show_outcome("submit_release_outcome")


with st.container():
    st.subheader("Release")
    release_box()
