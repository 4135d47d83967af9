"""What the API keeps per request is let go when the request ends: after a few hundred requests (finished,
stopped by a stop sequence, abandoned mid-stream, refused) the gateway routes nothing, the engine client
waits for no reply, and the engine lists no more than its live requests and its ring of recent ones.
(The long run is benchmarks/soak.py, `make soak`.)"""

from __future__ import annotations

import pytest

from engine.core.request_table import RECENT_ENDED
from tests.serving_support import MODEL, Served, serve, shut

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def served(test_data_dir):
    served = serve(test_data_dir)
    yield served
    shut(served)


def test_a_few_hundred_requests_leave_nothing_behind_in_the_api_or_the_engine(served: Served) -> None:
    client = served.client
    for index in range(300):
        kind = index % 4
        if kind == 0:
            client.completions.create(model="tiny-chat", prompt=f"item {index}", max_tokens=2, temperature=0)
        elif kind == 1:
            client.completions.create(model="tiny-chat", prompt=f"item {index}", max_tokens=8, temperature=0,
                                      stop=["e"])  # fmt: skip
        elif kind == 2:
            stream = client.completions.create(model="tiny-chat", prompt=f"story {index}", max_tokens=64,
                                               stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            next(iter(stream))
            stream.close()  # the client leaves: the engine request is aborted
        else:
            with pytest.raises(Exception):
                client.completions.create(model="tiny-chat", prompt=[10**6], max_tokens=2)  # out of vocabulary
    binding = served.server._app.state.bindings.current()
    engine_client = binding.engine
    deadline_views = served.engine.requests()
    assert binding.gateway.in_flight == 0
    assert not engine_client._pending
    assert len(deadline_views) <= RECENT_ENDED
    assert len(engine_client.stats_history) <= engine_client.stats_history.maxlen
    served.engine.check_invariants()


def test_the_console_routes_refuse_what_does_not_decode_and_raise_the_engines_own_refusals(served: Served) -> None:
    import http.client

    from engine.core.request import SamplingParams

    connection = http.client.HTTPConnection(served.server.host, served.server.port, timeout=60)
    connection.request("POST", "/engine/submit", body=b"\xc1 not msgpack")
    assert connection.getresponse().status == 400
    connection.close()
    with pytest.raises(ValueError, match="vocab|outside"):
        served.engine.submit([10**6], SamplingParams(max_new_tokens=1))  # the engine's own check, raised here
    with pytest.raises(KeyError):
        served.engine.get("no-such-request")
    served.engine.check_invariants()


def test_a_non_streaming_client_that_gives_up_is_noticed_within_a_step(served: Served) -> None:
    """Issue 47 item 2: the disconnect was polled only while no token arrived, so a non-streaming request's
    engine request ran to its end (1,500 tokens nobody read) after its client had gone."""
    import http.client
    import json
    import time

    body = {"model": "tiny-chat", "prompt": "Tell me a very long story", "max_tokens": 1500, "ignore_eos": True,
            "user": "quitter"}  # fmt: skip
    connection = http.client.HTTPConnection(served.server.host, served.server.port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while not (ours := [v for v in served.engine.requests() if v.request_id.startswith("cmpl-quitter-")]):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)
    connection.sock.shutdown(2)  # the client gives up (curl -m)
    connection.close()
    rid = ours[0].request_id
    while (view := served.engine.get(rid)).status in ("waiting", "running"):
        assert time.monotonic() < deadline, "the engine request is still running"
        time.sleep(0.02)
    assert view.status == "aborted" and view.finish_reason == "the client disconnected"
    assert len(view.output_token_ids) < 1500


def test_response_ids_are_random_so_no_two_runs_share_one() -> None:
    """Issue 47 item 6: ids were "cmpl-0", "cmpl-1", ... again after every restart on the same history."""
    import re

    from serving.gateway import new_request_id

    ids = {new_request_id("cmpl", None) for _ in range(1000)} | {new_request_id("chatcmpl", "bob") for _ in range(1000)}
    assert len(ids) == 2000
    assert all(re.fullmatch(r"(cmpl|chatcmpl-bob)-[0-9a-f]{24}", rid) for rid in ids)


def test_the_first_request_finds_the_tokenizer_loaded(test_data_dir, monkeypatch) -> None:
    """Regression: the API process loaded the tokenizer (importing transformers and torch) on its first text
    request, on the event loop: that request waited 8-9 s (benchmarks/serving_peer.py's 1x16 p99) and every
    other stream with it. It loads while the engine process starts now; the request path never loads it."""
    import engine.runner.model_loading

    served = serve(test_data_dir)
    try:
        def refuse(_config):
            raise AssertionError("a request loaded the tokenizer")

        monkeypatch.setattr(engine.runner.model_loading, "load_tokenizer", refuse)
        answer = served.client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hello"}])
        assert answer.choices[0].message.content is not None
    finally:
        shut(served)
