"""Bad input gets OpenAI's error body with its status, and the server keeps serving (raw HTTP)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from serving.api import ApiLimits
from tests.engine_support import tokens
from tests.serving_support import MODEL, Served, post_json, post_raw, serve, shut, wait_until_ended

BODY_LIMIT = 64 * 1024
GOOD = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def served(test_data_dir) -> Served:
    served = serve(test_data_dir, ApiLimits(max_body_bytes=BODY_LIMIT, max_in_flight=2, body_idle_s=0.5))
    yield served
    shut(served)


def completion(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


def chat_body(**fields) -> bytes:
    messages = [{"role": "user", "content": "hi"}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2, **fields}).encode()


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
    "a temperature out of range": ("/v1/completions", completion(temperature=-3), 400, "temperature"),
    "an unknown model": ("/v1/completions", completion(model="gpt-5"), 404, "model"),
    "chat without messages": ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400,
                              "messages"),
    "a body over the size bound": ("/v1/completions", completion(prompt="x" * BODY_LIMIT), 413, None),
    # Issue 47 item 3: a lone surrogate was a 500 with a plain-text body (the tokenizer raises TypeError).
    "a lone surrogate in the prompt": ("/v1/completions", completion(prompt="x\ud800y"), 400, "prompt"),
    "a lone surrogate in a message": ("/v1/chat/completions", chat_body(messages=[
        {"role": "user", "content": "x\ud800y"}]), 400, "messages"),
    "a lone surrogate's raw bytes": ("/v1/completions", completion(prompt="x@y").replace(b"@", b"\xed\xa0\x80"), 400,
                                     "prompt"),
    # Issue 47 item 4: OpenAI's fields this server does not implement are refused by name, never ignored.
    "a JSON response_format": ("/v1/chat/completions", chat_body(response_format={"type": "json_object"}), 400,
                               "response_format"),
    "tools": ("/v1/chat/completions", chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
              "tools"),
    "a tool_choice": ("/v1/chat/completions", chat_body(tool_choice="auto"), 400, "tool_choice"),
    "functions": ("/v1/chat/completions", chat_body(functions=[{"name": "f"}]), 400, "functions"),
    "best_of over 1": ("/v1/completions", completion(best_of=2), 400, "best_of"),
    "a suffix": ("/v1/completions", completion(suffix="!"), 400, "suffix"),
    "a field no endpoint defines": ("/v1/completions", completion(top_k=5), 400, "top_k"),
    "top_logprobs over 20": ("/v1/chat/completions", chat_body(logprobs=True, top_logprobs=21), 400,
                             "top_logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", chat_body(top_logprobs=2), 400, "top_logprobs"),
    "completion logprobs over 20": ("/v1/completions", completion(logprobs=21), 400, "logprobs"),
    "a presence_penalty out of range": ("/v1/completions", completion(presence_penalty=2.5), 400, "presence_penalty"),
    "a frequency_penalty out of range": ("/v1/completions", completion(frequency_penalty=-3), 400,
                                         "frequency_penalty"),
    "a logit bias out of range": ("/v1/completions", completion(logit_bias={"5": 101}), 400, "logit_bias"),
    "a logit bias outside the vocabulary": ("/v1/completions", completion(logit_bias={"1000000": 1}), 400,
                                            "logit_bias"),
    "a logit bias keyed by a word": ("/v1/completions", completion(logit_bias={"hello": 1}), 400, "logit_bias"),
    "301 logit biases": ("/v1/completions", completion(logit_bias={str(i): 1 for i in range(301)}), 400,
                         "logit_bias"),
    # Issue 47 item 5: errors name the parameter that is wrong.
    "a cache_salt of 10 KB": ("/v1/completions", completion(cache_salt="s" * 10_000), 400, "cache_salt"),
    "a top_p out of range": ("/v1/completions", completion(top_p=1.5), 400, "top_p"),
    "a negative seed": ("/v1/completions", completion(seed=-1), 400, "seed"),
    "a negative seed with n = 2": ("/v1/completions", completion(seed=-1, n=2), 400, "seed"),
    "a seed over 2**63 - 1": ("/v1/completions", completion(seed=2**64), 400, "seed"),
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


def test_one_hundred_stop_strings_are_refused_naming_the_limit_of_4(served: Served) -> None:
    status, answer = post_raw(served.server, "/v1/completions", completion(stop=["x"] * 100))
    assert status == 400 and answer["error"]["param"] == "stop"
    assert "at most 4 stop sequences" in answer["error"]["message"]


def test_fields_whose_values_ask_for_nothing_are_accepted(served: Served) -> None:
    harmless = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "store": False,
                "logprobs": False, "best_of": None}  # fmt: skip
    status, answer = post_raw(served.server, "/v1/chat/completions", chat_body(**harmless))
    assert status == 200, answer


def test_a_content_length_longer_than_the_body_is_a_400_and_no_server_error(served: Served, caplog) -> None:
    body = completion()
    with socket.create_connection((served.server.host, served.server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body) + 500, body))  # fmt: skip
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = json.loads(response.read())
    assert response.status == 400
    announced = f"of the {len(body) + 500} its Content-Length announced"
    assert answer["error"]["message"] == f"the body stopped arriving after {len(body)} bytes {announced}"
    assert post_raw(served.server, "/v1/completions", completion())[0] == 200
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
