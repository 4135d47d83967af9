"""Route a prompt: each pod's longest cached prefix of it, the way llm-d's prefix scorer picks a pod."""

from __future__ import annotations

import time

import streamlit as st

from app.fleet_hosting import get_fleet_host
from app.fleet_prompts import chat_token_ids, encode_with, local_chat_template, local_tokenizer, parse_chat_messages
from app.fleet_prompts import prompt_token_ids
from app.fleet_tiers import served_sentence, tier_route_frame
from app.fleet_view import index_from_history, media_and_groups, route_frame
from app.hosting import get_host
from app.ui import LIVE, fleet_source, kept, read_history

CONSOLE_TOKENIZER = "Text, this console's tokenizer"
LOCAL_TOKENIZER = "Text, tokenizer.json of a local model directory"
CHAT = "Chat messages, a local model directory's chat template"
TOKEN_IDS = "Token ids"
MODES = (CONSOLE_TOKENIZER, LOCAL_TOKENIZER, CHAT, TOKEN_IDS)
PROMPT_LABELS = {
    TOKEN_IDS: "Token ids (commas or spaces)",
    CHAT: 'Messages: lines "system: ...", "user: ...", "assistant: ...", or an OpenAI request\'s JSON array',
}

host = get_host()
fleet = get_fleet_host()
state = st.session_state

st.title("Route a prompt")
st.caption(
    "Each pod's longest run of cached blocks from the prompt's start (parent by parent, tokens block "
    "by block): a longest-prefix scorer such as llm-d's sends the request to the pod with the most. The "
    "pods' tokenizer must be the one used here, or the blocks will not match."
)
watch = fleet.watch
view = fleet_source(st, "fleet_route_view", live=watch is not None)
mode = st.radio("Prompt as", MODES, horizontal=True, **kept("fleet_route_mode", CONSOLE_TOKENIZER))
directory = ""
if mode == LOCAL_TOKENIZER:
    directory = st.text_input("Model directory (holding tokenizer.json)", max_chars=4096, **kept("fleet_route_dir", ""))
elif mode == CHAT:
    directory = st.text_input(
        "Model directory (the pods' model: tokenizer.json and its chat template)", max_chars=4096,
        **kept("fleet_route_chat_dir", ""),
    )  # fmt: skip
prompt = st.text_area(
    PROMPT_LABELS.get(mode, "Prompt"),
    height=160,
    max_chars=400_000,
    **kept("fleet_route_prompt", ""),
)
go = st.button("Route", type="primary", key="fleet_route_go")

if go or state.get("fleet_route_done"):
    state["fleet_route_done"] = True
    try:
        if mode == TOKEN_IDS:
            token_ids = prompt_token_ids(prompt)
        elif mode == LOCAL_TOKENIZER:
            token_ids = encode_with(local_tokenizer(directory), prompt)
        elif mode == CHAT:
            token_ids = chat_token_ids(local_chat_template(directory), parse_chat_messages(prompt))
        else:
            token_ids = encode_with(host.console.tokenizer, prompt)
    except ValueError as exc:
        st.error(f"Not routed: {exc}")
        st.stop()
    now = time.time()
    index = watch.index if view == LIVE and watch is not None else read_history(index_from_history, host.db, now, fleet.stale_after_s)
    if index is None:
        st.stop()
    places = media_and_groups(index.pods(now)) or [("GPU", 0)]
    labels = {place: f"{place[0]} · group {place[1]}" for place in places}
    if state.get("fleet_route_place") not in places:
        state["fleet_route_place"] = places[0]
    medium, group_idx = st.selectbox(
        "Medium and KV group", places, format_func=labels.get, **kept("fleet_route_place", places[0])
    )
    result = index.route(token_ids, medium, group_idx, now)
    best = result.best_pods
    if best:
        top = result.matches[0]
        st.success(
            f"Route to **{', '.join(best)}**: {top.matched_tokens:,} of {result.num_prompt_tokens:,} prompt tokens "
            f"cached ({top.matched_blocks} blocks)."
        )
        st.caption(
            "At most the prompt's length less one token: vLLM always recomputes the last token, so a fully "
            "cached prompt of whole blocks reuses one block less. The figure is what vLLM reports as cached_tokens."
        )
    else:
        st.info(f"No pod holds the first block of this {result.num_prompt_tokens:,}-token prompt: any pod will do.")
    stale = [match.pod for match in result.matches if match.stale]
    if stale:
        st.warning(f"Stale pods (their blocks as last seen): {', '.join(stale)}")
    st.dataframe(
        route_frame(result),
        hide_index=True,
        column_config={"share of prompt": st.column_config.ProgressColumn("share of prompt", format="percent")},
        key="fleet_route_table",
    )
    tiers = index.route_tiers(token_ids, group_idx, now)
    if len({medium for medium, group in places if group == group_idx}) > 1:  # some pod has a second tier
        st.subheader(f"Which tier would serve it (group {group_idx})")
        st.caption(
            "Per pod, its fastest tier from the prompt's start, then each slower tier from where the faster "
            "ones stopped: how vLLM's offloading connector and this engine's disk tier continue a pool's hit."
        )
        st.markdown("\n".join(f"- {served_sentence(match)}" for match in tiers.matches))
        st.dataframe(
            tier_route_frame(tiers),
            hide_index=True,
            column_config={"share of prompt": st.column_config.ProgressColumn("share of prompt", format="percent")},
            key="fleet_route_tiers",
        )
    st.caption(f"{len(token_ids):,} token ids: {token_ids[:24]}{' …' if len(token_ids) > 24 else ''}")
