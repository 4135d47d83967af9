"""The console attached to an engine server it did not start (`make run`'s way, or `make run ENGINE=URL`):
API requests show in its pages and its history, the console restarting never stops the engine or a stream,
and a restart of the engine from the console is followed by the API and the console alike."""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest
import streamlit as st

from app.hosting import ENV_ENGINE, AttachedHost, engine_url_from_env
from storage.read.why import find_request
from tests.browser_support import engine_server
from tests.test_app_support import app, console_env, host, no_exceptions, wait_for  # noqa: F401


def test_the_engine_url_is_an_http_url() -> None:
    assert engine_url_from_env({}) is None
    assert engine_url_from_env({ENV_ENGINE: "http://127.0.0.1:8000/"}) == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match=ENV_ENGINE):
        engine_url_from_env({ENV_ENGINE: "127.0.0.1:8000"})


@pytest.fixture
def attached(console_env, monkeypatch, tmp_path):  # noqa: F811
    with engine_server(tmp_path / "history.sqlite", num_blocks=64) as (url, _pid):
        monkeypatch.setenv(ENV_ENGINE, url)
        monkeypatch.setenv("PREFIX_CONSOLE_DB_URL", f"sqlite:///{tmp_path / 'history.sqlite'}")
        st.cache_resource.clear()
        yield url
        st.cache_resource.clear()


def test_api_requests_show_in_the_attached_console_and_its_history(attached) -> None:
    console = host()
    assert isinstance(console, AttachedHost) and console.api_url == attached
    client = openai.OpenAI(base_url=f"{attached}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Which blocks are cached?"}]
    first = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0,
                                           user="bob")  # fmt: skip
    client.close()
    assert first.id.startswith("chatcmpl-bob-")
    assert console.console.engine.get(first.id).status == "finished"
    assert first.id in {view.request_id for view in console.console.engine.requests()}
    wait_for(lambda: find_request(console.db, first.id) is not None, "the API request in the history")
    assert find_request(console.db, first.id).run_id == console.console.run_id
    for page in ("overview", "blocks", "submit", "prefix_tree", "replay", "why", "settings", "capacity_planner"):
        at = app()
        at.switch_page(f"../pages/{page}.py") if page != "overview" else None
        no_exceptions(at.run())


def test_the_console_restarting_never_stops_the_engine_or_a_stream(attached) -> None:
    host()
    client = openai.OpenAI(base_url=f"{attached}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny-chat", prompt="a long story", max_tokens=64, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = [next(iter(stream))]
    st.cache_resource.clear()  # the console goes away (its host shut down)
    chunks += list(stream)
    assert sum(len(chunk.choices[0].token_ids) for chunk in chunks if chunk.choices) == 64
    assert chunks[-1].choices[0].finish_reason == "length"
    again = host()  # a new console attaches to the same engine
    assert again.console.engine.get(chunks[0].id).status == "finished"
    client.close()


def test_a_restart_from_the_console_is_followed_by_the_api_and_the_console(attached) -> None:
    console = host()
    old_boot, old_run = console.console.engine.boot_id, console.console.run_id
    restarted = console.restart(replace(console.console.config, num_blocks=32))
    assert restarted.engine.boot_id != old_boot and restarted.run_id != old_run
    assert restarted.engine.num_blocks == 32
    client = openai.OpenAI(base_url=f"{attached}/v1", api_key="unused", max_retries=0, timeout=60)
    second = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2, temperature=0)  # fmt: skip
    client.close()
    assert console.console.engine.get(second.id).status == "finished"
    wait_for(lambda: find_request(console.db, second.id) is not None, "the request in the new run's history")
    assert find_request(console.db, second.id).run_id == restarted.run_id
