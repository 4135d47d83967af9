"""Submit & fork page: prompts become exact token ids, requests run, forks fan out, bad input changes nothing."""

from __future__ import annotations

import json

from engine.core.request import SamplingParams
from serving.prompts import encode_chat, encode_text
from tests.test_app_support import (  # noqa: F401  (console_env is a fixture)
    console_env,
    errors,
    host,
    no_exceptions,
    open_page,
    texts,
    wait_for,
    wait_idle,
)

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def page_with_retained_request():
    """The Submit page once PROMPT, submitted with retain, has finished as req-0 (and the page re-ran)."""
    at = submit(open_page("submit"), PROMPT, retain=True)
    engine = host().console.engine
    wait_for(lambda: engine.get("req-0").status == "retained", "req-0 to be retained")
    at.run()
    return at, engine


def submit(at, text: str, *, retain: bool = False, max_new: int = 4):
    at.text_area(key="submit_text").input(text)
    at.number_input(key="submit_max_new").set_value(max_new)
    at.checkbox(key="submit_ignore_eos").check()
    if retain:
        at.checkbox(key="submit_retain").check()
    return at.button(key="submit_go").click().run()


def test_preview_shows_the_exact_token_ids(console_env):
    at = open_page("submit")
    at.text_area(key="submit_text").input(PROMPT).run()
    ids = encode_text(host().console.tokenizer, PROMPT)
    assert ", ".join(map(str, ids)) in [c.value for c in at.code]
    assert f"{len(ids)} tokens" in texts(at)


def test_chat_preset_renders_through_the_template(console_env):
    at = open_page("submit")
    at.selectbox(key="submit_preset").select("Long shared system prompt").run()
    assert at.radio(key="submit_mode").value == "Chat template"
    system = at.text_area(key="submit_system").value
    user = at.text_area(key="submit_text").value
    ids = encode_chat(host().console.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": user}])
    assert ", ".join(map(str, ids)) in [c.value for c in at.code]


def test_submitted_prompt_runs_to_the_end_and_streams_its_output(console_env):
    at = open_page("submit")
    at = submit(at, PROMPT, max_new=6)
    no_exceptions(at)
    assert not errors(at)
    assert "Submitted **req-0**" in texts(at)
    engine = host().console.engine
    wait_for(lambda: engine.get("req-0").status == "finished", "req-0 to finish")
    at.run()
    assert at.multiselect(key="submit_watch").value == ["req-0"]
    assert "**req-0** · `finished` (length)" in texts(at)
    assert "6/6 new tokens" in [p.proto.text for p in at.get("progress")]
    table = at.dataframe[0].value  # the Requests table, first on the page
    row = table[table["request"] == "req-0"].iloc[0]
    assert (row["status"], row["output tokens"], row["hit source"]) == ("finished", 6, "none")


def test_compare_shows_where_two_prompts_diverge(console_env):
    at = open_page("submit")
    at = submit(at, PROMPT)
    wait_idle()
    at.text_area(key="submit_text").input(PROMPT + "Then it sleeps.").run()
    at.selectbox(key="submit_compare").select("my previous submission").run()
    tokenizer = host().console.tokenizer
    a, b = encode_text(tokenizer, PROMPT + "Then it sleeps."), encode_text(tokenizer, PROMPT)
    d = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the last token of PROMPT re-tokenizes
    assert 0 < d < len(b)
    assert f"Shares the first **{d}** tokens ({d // 16} full blocks reusable)" in texts(at)


def test_fork_makes_one_child_per_suffix_line_in_one_action(console_env):
    at, engine = page_with_retained_request()
    assert at.selectbox(key="submit_fork_parent").value == "req-0"
    at.text_area(key="submit_fork_suffixes").input(" in French.\n in German.\n\n in Dutch.")
    at.button(key="submit_fork_go").click().run()
    assert not errors(at)
    assert "Forked req-0 into 3 children: req-1, req-2, req-3." in texts(at)
    wait_idle()
    children = [engine.get(f"req-{i}") for i in (1, 2, 3)]
    assert all(c.parent_id == "req-0" and c.hit_source == "fork" for c in children)
    assert all(c.cached_tokens == engine.get("req-0").num_prompt_tokens + 4 - 1 for c in children)
    at.run()
    assert at.multiselect(key="submit_watch").value == ["req-1", "req-2", "req-3"]


def test_the_parent_box_labels_are_request_ids_and_the_live_status_is_beside_them(console_env):
    """Regression: the parent box's labels carried the status ("req-0 · waiting"). Streamlit's frontend
    sends a selectbox's value back as its label, so once req-0 finished the box still said "waiting" and
    the fork failed: "unknown parent request 'req-0 · waiting'" (tests/test_browser.py hit it under load)."""
    at, engine = page_with_retained_request()
    assert at.selectbox(key="submit_fork_parent").options == ["req-0"]  # labels that never change
    assert "**req-0** · `retained`: holds" in texts(at)
    compare = at.selectbox(key="submit_compare").options
    assert "req-0 (prompt + output)" in compare and not any("retained" in label for label in compare)


def test_children_sample_with_the_fork_sections_own_settings_and_the_retain_choice_shown_at_the_button(console_env):
    """Regression: forks silently reused the submit section's sampling, and children were not retained by
    default with nothing at the fork button saying so (they vanished from the Blocks page in seconds)."""
    at, engine = page_with_retained_request()  # submitted with 4 new tokens
    at.text_area(key="submit_fork_suffixes").input(" one\n two")
    at.run()
    assert at.button(key="submit_fork_go").label == "Fork children (2, not retained)"
    assert "Not retained: each child frees its blocks as soon as it finishes" in texts(at)
    at.number_input(key="submit_fork_max_new").set_value(2)
    at.checkbox(key="submit_fork_ignore_eos").check()
    at.checkbox(key="submit_fork_retain").check().run()
    assert at.button(key="submit_fork_go").label == "Fork children (2, retained)"
    at.button(key="submit_fork_go").click().run()
    wait_idle()
    children = [engine.get(rid) for rid in ("req-1", "req-2")]
    assert [(c.max_new_tokens, c.status, len(c.output_token_ids)) for c in children] == [(2, "retained", 2)] * 2


def test_the_release_box_stops_offering_what_it_released(console_env):
    """Regression: the release box still offered a released id."""
    at, engine = page_with_retained_request()
    assert at.selectbox(key="submit_release_pick").options == ["req-0"]
    at.button(key="submit_release_go").click().run()
    assert engine.get("req-0").status == "released"
    assert "No retained request holds blocks." in texts(at)
    assert all(box.key != "submit_release_pick" for box in at.selectbox)


def test_the_requests_table_sets_a_width_for_every_column(console_env):
    """Regression: the 14-column requests table was cut off at 1,500 px; every column now has a compact
    header and a width (their sum fits a 1,440 px window with the sidebar open)."""
    at, _ = page_with_retained_request()
    table = at.dataframe[0]  # the Requests table leads the page
    columns = json.loads(table.proto.columns)
    widths = {name: column["width"] for name, column in columns.items() if not column.get("hidden")}
    assert set(widths) == set(table.value.columns) and len(widths) == 14
    assert sum(widths.values()) <= 979  # the main area of a 1,440 px window beside the sidebar
    # Regression (issue 47, item 15): "finish" was 56 px, "the client disconnected" showed as "the clien…";
    # now it is whole, beside the status.
    assert widths["finish"] >= 152  # the reason's 136 px of 14 px text and the cell's padding
    assert list(table.proto.column_order)[2:4] == ["status", "finish"]


def test_the_requests_table_leads_the_page_and_finds_a_request_by_id(console_env):
    """Regression (issue 47, item 14b): the table sat at the bottom of the page, about 1,600 px down,
    with no way to look one request up."""
    engine = host().console.engine
    for number in range(12):
        engine.submit(list(range(10 + number, 30 + number)), SamplingParams(max_new_tokens=1))
    wait_idle()
    at = open_page("submit")
    no_exceptions(at)
    assert [h.value for h in at.subheader][:2] == ["Requests", "Prompt"]
    assert len(at.dataframe[0].value) == 12
    at.text_input(key="submit_find").input("REQ-11").run()
    assert at.dataframe[0].value["request"].tolist() == ["req-11"]
    at.text_input(key="submit_find").input("nobody").run()
    assert "No request's id or parent's id holds “nobody”." in texts(at)


def test_bad_inputs_show_an_error_and_change_nothing(console_env):
    console_env(num_blocks=8)
    at = open_page("submit")
    engine = host().console.engine
    stats_before = engine.stats()

    at = submit(at, "")  # empty prompt
    assert errors(at) == ["Not submitted: the prompt is empty"]

    at.radio(key="submit_mode").set_value("Token ids").run()
    at = submit(at, " ".join(["5"] * 3000))  # longer than the model's 2048 positions
    assert len(errors(at)) == 1 and "fit the model's 2048 positions" in errors(at)[0]

    at = submit(at, "1 2 99999999")  # outside the vocabulary
    assert len(errors(at)) == 1 and "outside this model's vocabulary" in errors(at)[0]
    assert engine.requests() == []

    at = submit(at, " ".join(["5"] * 200))  # 13 blocks with its new tokens; the pool has 8
    assert len(errors(at)) == 1 and "rejected: needs 13 blocks" in errors(at)[0]
    assert [r.status for r in engine.requests()] == ["rejected"]
    assert engine.stats() == stats_before  # no block moved


def test_forking_a_released_request_shows_an_error(console_env):
    at, engine = page_with_retained_request()
    assert at.selectbox(key="submit_fork_parent").value == "req-0"
    at.text_area(key="submit_fork_suffixes").input("more")
    at.button(key="submit_release_go").click().run()
    assert "Released req-0" in texts(at)
    assert engine.get("req-0").status == "released"
    assert all(box.key != "submit_fork_parent" for box in at.selectbox)  # a released request is not offered
    at.session_state["submit_fork_parent"] = "req-0"  # as another tab's release leaves a box picked before it
    at.button(key="submit_fork_go").click().run()
    assert errors(at) == [
        "Not forked: cannot fork 'req-0': it is released; only running or retained requests hold KV to share"
    ]
    assert len(engine.requests()) == 1


def test_empty_fork_suffixes_show_an_error(console_env):
    at = open_page("submit")
    at = submit(at, PROMPT, retain=True)
    wait_idle()
    at.run()
    at.text_area(key="submit_fork_suffixes").input("\n  \n")
    at.button(key="submit_fork_go").click().run()
    assert errors(at) == ["Not forked: give at least one suffix (one per line)"]
    assert len(host().console.engine.requests()) == 1


def test_out_of_range_sampling_is_refused_with_the_reason_and_nothing_runs(console_env):
    """Regression: a bounded number box showed 99999999 red and submitted its previous value (32)."""
    at = open_page("submit")
    engine = host().console.engine
    at.text_area(key="submit_text").input(PROMPT)
    at.number_input(key="submit_max_new").set_value(99_999_999)
    at.button(key="submit_go").click().run()
    assert errors(at) == ["Not submitted: max_new_tokens must be an integer in [1, 4096], got 99999999"]
    at.number_input(key="submit_max_new").set_value(8)
    at.number_input(key="submit_top_p").set_value(-0.5)
    at.button(key="submit_go").click().run()
    assert errors(at) == ["Not submitted: top_p must be in (0, 1], got -0.5"]
    assert engine.requests() == []


def test_another_tabs_request_is_released_only_after_its_owner_is_named_and_confirmed(console_env):
    at, engine = page_with_retained_request()
    other = open_page("submit")  # a second browser tab: req-0 is not its own
    assert other.selectbox(key="submit_release_pick").value == "req-0"
    assert "**req-0** · submitted by tab 1" in texts(other)
    other.button(key="submit_release_go").click().run()
    assert engine.get("req-0").status == "retained"
    assert "**req-0** was submitted by tab 1, not this tab. Release it anyway?" in texts(other)
    other.button(key="submit_release_confirm_go").click().run()
    assert engine.get("req-0").status == "released"
    assert "Released req-0: its blocks return to the pool (cached blocks stay for hits)." in texts(other)
    other.run()
    assert "Released req-0: its blocks return to the pool (cached blocks stay for hits)." in texts(other)  # it stays


def test_a_new_retained_submit_becomes_the_fork_parent_and_the_release_default(console_env):
    at, engine = page_with_retained_request()
    at = submit(at, "A second prompt, retained too. " * 3, retain=True)
    wait_for(lambda: engine.get("req-1").status == "retained", "req-1 to be retained")
    at.run()
    assert at.selectbox(key="submit_fork_parent").value == "req-1"
    assert at.selectbox(key="submit_release_pick").value == "req-1"
