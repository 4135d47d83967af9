"""The console's "Why did it miss?" page: a date-diverged request shows both dates, the picked and the typed
request are one choice, and a request the history does not hold yet is explained once it lands."""

from __future__ import annotations

from unittest import mock

import streamlit.testing.v1.local_script_runner as local_script_runner
from streamlit.testing.v1 import AppTest

from engine.core.request import SamplingParams
from serving.prompts import encode_text
from storage.read.why import find_request
from tests.test_app_support import console_env, host, open_page, wait_for  # noqa: F401

SYSTEM = "You are the support bot of Example Corp, answering questions about invoices and refunds. Today is "
ONE_TOKEN = SamplingParams(max_new_tokens=1)


def submit_and_store(prompt_text: str, request_id: str | None = None) -> str:
    """Submit a one-token request, wait until it finished and the history holds it; returns its id."""
    engine = host().console.engine
    rid = engine.submit(encode_text(engine.tokenizer, prompt_text), ONE_TOKEN, request_id=request_id)
    wait_for(lambda: engine.get(rid).status == "finished", f"request {rid}")
    host().writer.flush(timeout_s=30)
    wait_for(lambda: find_request(host().db, rid) is not None, f"{rid} in the history")
    return rid


def tick_fragments(at: AppTest) -> AppTest:
    """Run the page's fragments alone, as their `run_every` timers do in a browser (no full run, no Refresh).

    AppTest has no public way to do this: the run's rerun data gets the registered fragments' ids, as
    Streamlit's auto-rerun sends them. Fails when the page registered no fragment."""
    fragment_ids = list(at._fragment_storage._fragments)
    assert fragment_ids, "the page registered no fragment that could look again by itself"
    rerun_data = local_script_runner.RerunData

    def fragment_run(**kwargs):
        return rerun_data(**kwargs, fragment_id_queue=fragment_ids, is_auto_rerun=True)

    with mock.patch.object(local_script_runner, "RerunData", fragment_run):
        return at.run()


def test_the_why_page_shows_the_dates_where_a_timestamped_system_prompt_diverged(console_env):  # noqa: F811
    first = submit_and_store(SYSTEM + "2026-12-03. Be brief.")
    second = submit_and_store(SYSTEM + "1999-12-04. Be brief.")
    at = open_page("why")
    at.text_input(key="why_typed").set_value(second).run()
    assert not at.exception
    assert at.metric[0].value == "diverged"
    shown = [block.value for block in at.code]
    assert shown[0].startswith("1999-12-04") and shown[1].startswith("2026-12-03")
    assert any(first in md.value for md in at.markdown)
    assert all(block.proto.wrap_lines for block in at.code)  # issue 47 item 12: the panes cut lines off


def test_the_counts_shown_add_up_to_the_prompt(console_env):  # noqa: F811
    """Issue 47 item 12: "16 / 119 cached, missed 96": the tokens never served were not shown."""
    submit_and_store(SYSTEM + "2026-12-03. Be brief.")
    second = submit_and_store(SYSTEM + "1999-12-04. Be brief, and name the date you were given.")
    at = open_page("why")
    at.text_input(key="why_typed").set_value(second).run()
    metrics = {metric.label: metric.value for metric in at.metric}
    cached, prompt = (int(part) for part in metrics["Cached"].split(" / "))
    assert cached + int(metrics["Missed"]) + int(metrics["Never served"]) == prompt
    assert int(metrics["Never served"]) >= 1  # the last prompt token, at least


def test_a_typed_id_is_the_choice_and_the_list_says_so(console_env):  # noqa: F811
    """Issue 47 item 12: typing an id left "Request of this run" showing another request."""
    first = submit_and_store(SYSTEM + "2026-12-03. Be brief.")
    second = submit_and_store(SYSTEM + "1999-12-04. Be brief.")
    at = open_page("why")
    assert at.selectbox(key="why_pick").value == second and at.metric[0].value == "diverged"
    at.text_input(key="why_typed").set_value(first).run()
    assert at.selectbox(key="why_pick").value == "(type one)"
    assert at.metric[0].value == "new"  # the typed request is the one explained
    at.selectbox(key="why_pick").set_value(second).run()
    assert at.text_input(key="why_typed").value == "" and at.metric[0].value == "diverged"


def test_a_request_not_in_the_history_yet_is_explained_once_it_lands_without_refresh(console_env):  # noqa: F811
    """Issue 47 item 12b: under load the page said "not in the history (yet)" and still said so 242 s later;
    only Refresh cleared it."""
    at = open_page("why")
    at.text_input(key="why_typed").set_value("later-1").run()
    assert any("not in the history (yet)" in warning.value for warning in at.warning)
    assert not at.metric
    submit_and_store(SYSTEM + "2026-12-03. Be brief.", request_id="later-1")
    at = tick_fragments(at)
    assert not at.exception
    assert at.metric[0].value == "new"
    assert not any("not in the history" in warning.value for warning in at.warning)


def test_the_runs_misses_by_cause_have_plain_column_headers(console_env):  # noqa: F811
    """Regression (issue 47, item 15): the summary's header read `missed_tokens`, a raw JSON key."""
    engine = host().console.engine
    request = engine.submit(encode_text(engine.tokenizer, SYSTEM + "2026-12-03. Be brief."), SamplingParams(max_new_tokens=1))
    wait_for(lambda: engine.get(request).status == "finished", "the request")
    host().writer.flush(timeout_s=30)
    wait_for(lambda: find_request(host().db, request) is not None, "the request in the history")
    at = open_page("why")
    assert not at.exception
    assert list(at.dataframe[0].value.columns) == ["cause", "requests", "missed tokens"]
