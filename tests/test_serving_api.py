"""The OpenAI-compatible API driven by the official openai SDK against a real server on a loopback port."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from serving.prompts import encode_chat
from tests.engine_support import tokens
from tests.serving_support import (
    BLOCK_SIZE,
    MODEL,
    Served,
    no_block_referenced,
    post_json,
    python_api_tokens,
    serve,
    shut,
    wait_until_ended,
)

NO_EOS = {"ignore_eos": True}  # vLLM's extension, as the SDK sends it
SYSTEM = ("You are the operator's assistant for a prefix-cache console. Answer in one short sentence, cite the "
          "block ids you used, and never invent numbers that the engine did not report.")  # fmt: skip


@pytest.fixture(scope="module")
def served(test_data_dir) -> Served:
    served = serve(test_data_dir)
    yield served
    shut(served)


def chat(served: Served, user_text: str, **kwargs):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_text}]
    return served.client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_the_model_list_names_the_engines_model(served: Served) -> None:
    assert [model.id for model in served.client.models.list().data] == [MODEL]


def test_a_shared_system_prompts_second_request_reports_exactly_the_tokens_the_engine_served(served: Served) -> None:
    first = chat(served, "How many blocks are cached?", max_tokens=2, temperature=0)
    second = chat(served, "Which request evicted block 7?", max_tokens=2, temperature=0)
    tokenizer = served.engine.tokenizer
    ids = [encode_chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])
           for text in ("How many blocks are cached?", "Which request evicted block 7?")]  # fmt: skip
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    expected = min(shared // BLOCK_SIZE, (len(ids[1]) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert expected >= 2 * BLOCK_SIZE  # the system prompt spans blocks: the test can see a partial reuse
    assert second.usage.prompt_tokens == len(ids[1])
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert served.engine.get(second.id).cached_tokens == expected
    assert first.usage.prompt_tokens_details.cached_tokens == served.engine.get(first.id).cached_tokens


def test_streaming_and_non_streaming_give_the_python_apis_greedy_tokens(served: Served) -> None:
    prompt = tokens(40, seed=11)
    expected = python_api_tokens(served.engine, prompt, 12)
    create = served.client.completions.create
    whole = create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS)
    streamed = []
    for chunk in served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                  extra_body={"ignore_eos": True}, stream=True):  # fmt: skip
        for choice in chunk.choices:
            streamed += choice.token_ids
    assert whole.choices[0].token_ids == expected
    assert streamed == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].text == served.engine.tokenizer.decode(expected, skip_special_tokens=True)


def test_the_response_id_is_the_engine_request_id_named_after_the_user(served: Served) -> None:
    response = chat(served, "hello", max_tokens=1, temperature=0, user="alice@example")
    assert response.id.startswith("chatcmpl-alice@example-")
    assert served.engine.get(response.id).status == "finished"


def test_n_3_choices_share_the_prompts_blocks(served: Served) -> None:
    prompt = tokens(5 * BLOCK_SIZE + 3, seed=12)
    stream = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1900, temperature=0.8, seed=5,
                                              n=3, extra_body={"ignore_eos": True}, stream=True)  # fmt: skip
    seen: set[int] = set()
    for chunk in stream:
        seen |= {choice.index for choice in chunk.choices if choice.token_ids}
        if seen == {0, 1, 2}:
            break
    snapshot = served.engine.snapshot()
    stream.close()
    ids = [chunk.id, f"{chunk.id}.1", f"{chunk.id}.2"]
    tables = {view.request_id: view.block_table for view in snapshot.requests if view.request_id in ids}
    shared = tables[ids[0]][:5]
    assert all(table[:5] == shared for table in tables.values())
    by_id = {(block.group, block.block_id): block for block in snapshot.blocks}
    assert [by_id[("full", block)].ref_count for block in shared] == [3] * 5
    assert sorted(by_id[("full", shared[0])].holders) == sorted(ids)


def test_a_client_that_disconnects_mid_stream_aborts_its_request_and_frees_its_blocks(served: Served) -> None:
    stream = served.client.completions.create(model=MODEL, prompt=tokens(50, seed=13), max_tokens=1900,
                                              temperature=0, extra_body={"ignore_eos": True}, stream=True)  # fmt: skip
    first = next(iter(stream))
    stream.close()
    wait_until_ended(served.engine, first.id)
    view = served.engine.get(first.id)
    assert view.status == "aborted" and view.finish_reason == "the client disconnected"
    assert len(view.output_token_ids) < 1900
    served.engine.check_invariants()
    deadline = time.monotonic() + 10
    while not no_block_referenced(served.engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert no_block_referenced(served.engine)


def test_a_stop_sequence_ends_the_choice_before_it_and_frees_the_request(served: Served) -> None:
    prompt = tokens(20, seed=14)
    create = served.client.completions.create
    free_run = create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=NO_EOS)
    stop = free_run.choices[0].text[len(free_run.choices[0].text) // 2 :][:3]
    stopped = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True}, stop=[stop])  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free_run.choices[0].text[: free_run.choices[0].text.find(stop)]
    wait_until_ended(served.engine, stopped.id)


def test_tokenize_returns_the_ids_the_engine_sees_for_messages_and_text(served: Served) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    status, body = post_json(served.server, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and body["tokens"] == encode_chat(served.engine.tokenizer, messages)
    status, body = post_json(served.server, "/tokenize", {"prompt": "hi there"})
    assert status == 200 and body["count"] == len(served.engine.tokenizer("hi there")["input_ids"])


def test_metrics_are_served_on_the_api_port_under_vllm_names(served: Served) -> None:
    import urllib.request

    chat(served, "warm the cache", max_tokens=1, temperature=0)
    chat(served, "warm the cache again", max_tokens=1, temperature=0)
    with urllib.request.urlopen(f"{served.server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    hits = next(line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))
    assert float(hits.rsplit(" ", 1)[1]) == served.engine.stats().prefix_hit_tokens > 0


def test_the_server_binds_the_loopback_address_by_default(served: Served) -> None:
    assert served.server.host == "127.0.0.1"


# Issue 47 item 4: logprobs, penalties and logit_bias are implemented, no longer accepted and ignored.
def test_chat_logprobs_give_each_tokens_logprob_and_its_top_alternatives_whole_and_streamed(served: Served) -> None:
    asked = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2, "extra_body": NO_EOS}
    whole = chat(served, "name a block", **asked)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0.0
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = [entry for chunk in chat(served, "name a block", stream=True, **asked) for choice in chunk.choices
                if choice.logprobs is not None for entry in choice.logprobs.content]  # fmt: skip
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs_take_the_legacy_shape(served: Served) -> None:
    create = served.client.completions.create
    whole = create(model=MODEL, prompt=tokens(20, seed=15), max_tokens=5, temperature=0, logprobs=3, extra_body=NO_EOS)
    choice = whole.choices[0]
    logprobs = choice.logprobs
    assert logprobs.tokens == [served.engine.tokenizer.decode([token]) for token in choice.token_ids]
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) <= 3 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs,
                                                                              logprobs.token_logprobs))  # fmt: skip
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    plain = create(model=MODEL, prompt=tokens(20, seed=15), max_tokens=5, temperature=0, extra_body=NO_EOS)
    assert plain.choices[0].logprobs is None and plain.choices[0].token_ids == choice.token_ids


def test_a_logit_bias_of_100_makes_greedy_decoding_repeat_that_token(served: Served) -> None:
    create = served.client.completions.create
    favoured = 1234
    response = create(model=MODEL, prompt=tokens(20, seed=16), max_tokens=4, temperature=0,
                      logit_bias={str(favoured): 100}, extra_body=NO_EOS)  # fmt: skip
    assert response.choices[0].token_ids == [favoured] * 4


def test_a_presence_penalty_counts_a_token_once_and_a_frequency_penalty_every_time(served: Served) -> None:
    # Two tokens biased far above the rest (tiny-chat's own logits lie within a few tenths of each other):
    # greedy repeats the likelier one; a presence penalty of 2 moves it once to the other, after which both
    # are present and equally penalized; a frequency penalty of 2 grows with each use, so the two alternate.
    def greedy(**penalties) -> list[int]:
        return served.client.completions.create(
            model=MODEL, prompt=tokens(20, seed=17), max_tokens=8, temperature=0, logit_bias={"1234": 100, "2345": 100},
            extra_body=NO_EOS, **penalties).choices[0].token_ids  # fmt: skip

    plain = greedy()
    first, other = plain[0], ({1234, 2345} - {plain[0]}).pop()
    assert plain == [first] * 8
    assert greedy(presence_penalty=2.0) == [first, other] + [first] * 6
    assert greedy(frequency_penalty=2.0) == [first, other] * 4


# Issue 47 item 8: with include_usage every chunk carries `usage`, null until the last, as OpenAI sends it.
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_with_include_usage_carry_a_null_usage_until_the_last(served: Served, path: str) -> None:
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    prompt = {"prompt": [5, 6, 7]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body.update(prompt)
    connection = http.client.HTTPConnection(served.server.host, served.server.port, timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        lines = connection.getresponse().read().decode().splitlines()
    finally:
        connection.close()
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    # A token chunk or more (a reader that falls a step behind gets two steps' tokens in one), then the usage.
    assert len(chunks) >= 2 and all("usage" in chunk for chunk in chunks)
    assert sum(len(choice.get("token_ids", [])) for chunk in chunks for choice in chunk["choices"]) == 3
    assert [chunk["usage"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []


def test_return_token_ids_is_vllms_switch_for_the_token_ids_the_choices_carry(served: Served) -> None:
    """vLLM's clients send `return_token_ids`: taken (not refused as an unknown field), and false drops them."""
    common = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
    status, body = post_json(served.server, "/v1/completions", {**common, "return_token_ids": True})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 2
    status, body = post_json(served.server, "/v1/completions", {**common, "return_token_ids": False})
    assert status == 200 and "token_ids" not in body["choices"][0]
