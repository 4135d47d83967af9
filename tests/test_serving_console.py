"""The console serves the API from its own embedded engine, follows a restart, and keeps it off by default."""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest

from app.hosting import ENV_API_PORT, api_port_from_env
from storage.read.why import find_request
from tests.ports import free_port
from tests.test_app_support import console_env, host, wait_for  # noqa: F401


def test_the_api_is_off_unless_its_port_is_set() -> None:
    assert api_port_from_env({}) is None
    assert api_port_from_env({ENV_API_PORT: "off"}) is None
    assert api_port_from_env({ENV_API_PORT: "8000"}) == 8000
    with pytest.raises(ValueError, match=ENV_API_PORT):
        api_port_from_env({ENV_API_PORT: "eight thousand"})


def test_api_requests_land_in_the_consoles_engine_with_their_user_label_and_follow_a_restart(
    console_env, monkeypatch  # noqa: F811
) -> None:
    monkeypatch.setenv(ENV_API_PORT, str(free_port()))
    console = host()
    assert console.api is not None and console.api.host == "127.0.0.1"
    client = openai.OpenAI(base_url=f"{console.api.url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Which blocks are cached?"}]
    first = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0,
                                           user="bob")  # fmt: skip
    assert first.id.startswith("chatcmpl-bob-")
    assert console.console.engine.get(first.id).status == "finished"
    wait_for(lambda: find_request(console.db, first.id) is not None, "the API request in the history")
    assert find_request(console.db, first.id).run_id == console.console.run_id
    old_engine = console.console.engine
    console.restart(replace(console.console.config, num_blocks=32))
    second = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0)
    assert console.console.engine is not old_engine
    assert console.console.engine.get(second.id).status == "finished"
    client.close()
