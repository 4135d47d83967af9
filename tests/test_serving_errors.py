"""Bad input gets OpenAI's error body with its status, and the server keeps serving (raw HTTP)."""

from __future__ import annotations

import http.client
import json

import pytest

from serving.api import ApiLimits
from tests.engine_support import tokens
from tests.serving_support import MODEL, Served, post_json, post_raw, serve, shut, wait_until_ended

BODY_LIMIT = 64 * 1024
GOOD = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def served(test_data_dir) -> Served:
    served = serve(test_data_dir, ApiLimits(max_body_bytes=BODY_LIMIT, max_in_flight=2))
    yield served
    shut(served)


def completion(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


BAD = {
    "malformed JSON": ("/v1/completions", b'{"model": "tiny-chat", "prompt": [1, 2', 400, None),
    "a body that is not an object": ("/v1/completions", b"[1, 2, 3]", 400, None),
    "a prompt of the wrong type": ("/v1/completions", completion(prompt=12), 400, "prompt"),
    "max_tokens as a string": ("/v1/completions", completion(max_tokens="ten"), 400, "max_tokens"),
    "a negative max_tokens": ("/v1/completions", completion(max_tokens=-1), 400, "max_tokens"),
    "max_tokens over the limit": ("/v1/completions", completion(max_tokens=100_000), 400, "max_tokens"),
    "a prompt over the context": ("/v1/completions", completion(prompt=tokens(2048, seed=1)), 400, "prompt"),
    "token ids outside the vocabulary": ("/v1/completions", completion(prompt=[10**9]), 400, "prompt"),
    "n over its bound": ("/v1/completions", completion(n=100), 400, "n"),
    "a temperature out of range": ("/v1/completions", completion(temperature=-3), 400, None),
    "an unknown model": ("/v1/completions", completion(model="gpt-5"), 404, "model"),
    "chat without messages": ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400,
                              "messages"),
    "a body over the size bound": ("/v1/completions", completion(prompt="x" * BODY_LIMIT), 413, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_input_gets_its_status_and_the_next_good_request_succeeds(served: Served, case: str) -> None:
    path, body, status, param = BAD[case]
    got, answer = post_raw(served.server, path, body)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert post_raw(served.server, "/v1/completions", completion())[0] == 200


def test_a_body_streamed_past_the_bound_without_a_length_is_refused_with_413(served: Served) -> None:
    connection = http.client.HTTPConnection(served.server.host, served.server.port, timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.putheader("Content-Type", "application/json")
    connection.endheaders()
    chunk = b"x" * 8192
    try:
        for _ in range(BODY_LIMIT // len(chunk) + 2):
            connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        connection.send(b"0\r\n\r\n")
    except OSError:
        pass  # the server may answer and close before the whole body is sent
    response = connection.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()
    assert post_raw(served.server, "/v1/completions", completion())[0] == 200


def test_requests_past_the_in_flight_bound_get_429_until_one_finishes(served: Served) -> None:
    long = [
        served.client.completions.create(model=MODEL, prompt=tokens(30, seed=20 + i), max_tokens=1900, temperature=0,
                                         extra_body={"ignore_eos": True}, stream=True)  # fmt: skip
        for i in range(2)
    ]
    firsts = [next(iter(stream)) for stream in long]
    status, answer = post_json(served.server, "/v1/completions", GOOD)
    assert status == 429 and answer["error"]["type"] == "rate_limit_error"
    for stream, first in zip(long, firsts):
        stream.close()
        wait_until_ended(served.engine, first.id)
    assert post_raw(served.server, "/v1/completions", completion())[0] == 200


def test_a_model_without_a_tokenizer_takes_token_ids_and_refuses_text_and_stop_sequences(test_data_dir) -> None:
    served = serve(test_data_dir, num_blocks=32, model="tiny-llama")
    try:
        good = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        status, answer = post_json(served.server, "/v1/completions", good)
        assert status == 200 and answer["choices"][0]["text"] == "" and len(answer["choices"][0]["token_ids"]) == 3
        status, answer = post_json(served.server, "/v1/completions", {**good, "prompt": "some text"})
        assert status == 400 and "tokenizer" in answer["error"]["message"]
        status, answer = post_json(served.server, "/v1/completions", {**good, "stop": ["x"]})
        assert status == 400 and answer["error"]["param"] == "stop"
    finally:
        shut(served)
