"""The console's "Why did it miss?" page: a date-diverged request shows both dates, and a run's summary."""

from __future__ import annotations

from engine.core.request import SamplingParams
from serving.prompts import encode_text
from storage.read.why import find_request
from tests.test_app_support import console_env, host, open_page, wait_for  # noqa: F401

SYSTEM = "You are the support bot of Example Corp, answering questions about invoices and refunds. Today is "


def test_the_why_page_shows_the_dates_where_a_timestamped_system_prompt_diverged(console_env):  # noqa: F811
    engine = host().console.engine
    one_token = SamplingParams(max_new_tokens=1)
    first = engine.submit(encode_text(engine.tokenizer, SYSTEM + "2026-12-03. Be brief."), one_token)
    wait_for(lambda: engine.get(first).status == "finished", "the first request")
    second = engine.submit(encode_text(engine.tokenizer, SYSTEM + "1999-12-04. Be brief."), one_token)
    wait_for(lambda: engine.get(second).status == "finished", "the second request")
    host().writer.flush(timeout_s=30)
    wait_for(lambda: find_request(host().db, second) is not None, "the second request in the history")
    at = open_page("why")
    at.text_input(key="why_typed").set_value(second).run()
    assert not at.exception
    assert at.metric[0].value == "diverged"
    shown = [block.value for block in at.code]
    assert shown[0].startswith("1999-12-04") and shown[1].startswith("2026-12-03")
    assert any(first in md.value for md in at.markdown)
