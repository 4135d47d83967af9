"""The OpenAI-compatible API driven by the official openai SDK against a real server on a loopback port."""

from __future__ import annotations

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
