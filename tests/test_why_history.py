"""The miss diagnosis end to end: requests through the engine, the history written as the console writes it,
and `python -m cli why` reading it back, with exact expectations per cause."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from analysis.why import Cause, Decoder, diagnose
from cli.__main__ import main
from engine.core.arith import common_prefix
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.engine import Engine
from serving.prompts import encode_chat, encode_text
from storage.db import db_engine
from storage.read.why import find_request, latest_eviction, requests_before
from storage.write.recorder import record_engine
from storage.write.writer import EventWriter

ROOT = Path(__file__).resolve().parent.parent
BS = 8
SYSTEM = ("You are the on-call assistant of the prefix-cache console team. Answer in one sentence and name "
          "the blocks you used. Date:")  # fmt: skip
ONE_TOKEN = SamplingParams(max_new_tokens=1)


@dataclass
class History:
    engine: Engine
    url: str
    writer: EventWriter

    def submit(self, prompt: list[int], **kwargs) -> str:
        request_id = self.engine.submit(prompt, ONE_TOKEN, **kwargs)
        self.engine.run_until_idle()
        return request_id

    def why(self, request_id: str) -> dict:
        """`python -m cli why --json` for the request, after the writer caught up."""
        self.writer.flush(timeout_s=30)
        out = io.StringIO()
        with redirect_stdout(out):
            status = main(["why", "--db", self.url, "--request", request_id, "--json",
                           "--data-dir", str(self.engine.config.resolved_data_dir)])  # fmt: skip
        assert status == 0
        return json.loads(out.getvalue())


@pytest.fixture
def history(tmp_path: Path, test_data_dir: Path):
    def make(num_blocks: int = 128) -> History:
        engine = Engine(EngineConfig(model="tiny-chat", device="cpu", block_size=BS, num_blocks=num_blocks,
                                     data_dir=test_data_dir))  # fmt: skip
        url = f"sqlite:///{tmp_path / 'history.sqlite'}"
        writer = EventWriter(url)
        record_engine(engine, writer)
        made.append(writer)
        return History(engine, url, writer)

    made: list[EventWriter] = []
    yield make
    for writer in made:
        writer.close()


def test_two_system_prompts_that_differ_only_in_their_date_diverge_at_the_dates_first_token(history) -> None:
    h = history()
    tokenizer = h.engine.tokenizer
    first_ids = encode_text(tokenizer, SYSTEM + "2024-06-03. What is cached?")
    second_ids = encode_text(tokenizer, SYSTEM + "1999-12-31. What is cached?")
    date_at = len(encode_text(tokenizer, SYSTEM))
    assert common_prefix(first_ids, second_ids) == date_at and date_at >= 2 * BS  # the test's own premise
    first = h.submit(first_ids)
    second = h.submit(second_ids)
    answer = h.why(second)
    assert answer["cause"] == "diverged" and answer["analyzer_reason"] == "compulsory"
    assert answer["cached_tokens"] == date_at // BS * BS == answer["position"]
    assert answer["match"] == {"request_id": first, "run_id": answer["run_id"], "shared_tokens": date_at}
    assert answer["divergence"]["position"] == date_at
    assert answer["divergence"]["ours"].startswith("1999-12-31")
    assert answer["divergence"]["theirs"].startswith("2024-06-03")
    assert answer["divergence"]["before"].endswith("Date:")
    assert answer["divergence"]["same_text"] is False and answer["eviction"] is None


def test_the_same_prompt_after_its_chain_was_evicted_from_a_small_pool_names_the_eviction(history) -> None:
    h = history(num_blocks=12)
    prompt = encode_text(h.engine.tokenizer, SYSTEM + " the eviction test, forty tokens or so of it.")
    first = h.submit(prompt)
    for seed in range(3):  # each flood prompt fills most of the pool: every block of the first is evicted
        h.submit([(7 * seed + i) % 400 + 1000 for i in range(10 * BS)])
    again = h.submit(prompt)
    answer = h.why(again)
    assert answer["cause"] == "evicted" and answer["analyzer_reason"] == "capacity"
    assert answer["position"] == answer["cached_tokens"] == h.engine.get(again).cached_tokens == 0
    assert answer["reusable_tokens"] == (len(prompt) - 1) // BS * BS
    assert answer["match"]["request_id"] == first
    view = h.engine.get(again)
    assert answer["eviction"]["reason"] == "lru"
    assert h.engine.get(first).finish_time < answer["eviction"]["at"] < view.arrival_time


def test_the_same_prompt_under_another_cache_salt_is_a_namespace_miss(history) -> None:
    h = history()
    prompt = encode_text(h.engine.tokenizer, SYSTEM + " tenants keep their caches apart.")
    first = h.submit(prompt, salt="tenant-a")
    second = h.submit(prompt, salt="tenant-b")
    answer = h.why(second)
    assert answer["cause"] == "namespace" and answer["cached_tokens"] == 0
    assert answer["match"]["request_id"] == first and answer["match"]["shared_tokens"] == len(prompt)
    assert answer["namespace"] == {"salt": ["tenant-b", "tenant-a"]}


def test_one_prompt_sent_as_plain_text_and_as_chat_diverges_with_the_template_tokens_called_out(history) -> None:
    h = history()
    words = "Which request evicted block seven, and why was it chosen?"
    plain = h.submit(encode_text(h.engine.tokenizer, words))
    chat = h.submit(encode_chat(h.engine.tokenizer, [{"role": "user", "content": words}]))
    answer = h.why(chat)
    assert answer["cause"] == "diverged" and answer["position"] == 0
    assert answer["match"] == {"request_id": plain, "run_id": answer["run_id"], "shared_tokens": 0}
    template = answer["divergence"]["template_tokens"]
    assert template["theirs"] == [] and "<|im_start|>" in template["ours"]
    assert any("template" in note for note in answer["divergence"]["notes"])


def test_two_identical_long_prompts_in_one_step_the_second_hits_the_first_in_flight(history) -> None:
    """The second shares the blocks the first computes in the same step: a hit, with no wait."""
    h = history()
    prompt = encode_text(h.engine.tokenizer, SYSTEM + " " + "a long shared context. " * 20)
    first = h.engine.submit(prompt, ONE_TOKEN)
    second = h.engine.submit(prompt, ONE_TOKEN)
    h.engine.run_until_idle()
    view = h.engine.get(second)
    assert view.cached_tokens == (len(prompt) - 1) // BS * BS
    assert view.first_token_time == h.engine.get(first).first_token_time  # the same step
    answer = h.why(second)
    assert answer["cause"] == "hit" and answer["missed_tokens"] == 0 and answer["wait"] is None


def test_a_runs_summary_counts_the_tokens_missed_by_cause(history) -> None:
    h = history()
    tokenizer = h.engine.tokenizer
    h.submit(encode_text(tokenizer, SYSTEM + "2024-06-03. Summary?"))
    diverged = h.submit(encode_text(tokenizer, SYSTEM + "1999-12-31. Summary?"))
    h.writer.flush(timeout_s=30)
    run_id = find_request(db_engine(h.url), diverged).run_id
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["why", "--db", h.url, "--run", run_id, "--summary", "--json"]) == 0
    summary = json.loads(out.getvalue())
    assert summary["requests"] == 2 and summary["by_cause"]["new"]["requests"] == 1
    assert summary["by_cause"]["diverged"]["requests"] == 1
    diverged_view = h.engine.get(diverged)
    missed = (diverged_view.num_prompt_tokens - 1) // BS * BS - diverged_view.cached_tokens
    assert summary["by_cause"]["diverged"]["missed_tokens"] == missed


def test_the_python_diagnosis_and_the_cli_agree(history) -> None:
    h = history()
    first = h.submit(encode_text(h.engine.tokenizer, SYSTEM + "2024-06-03."))
    second = h.submit(encode_text(h.engine.tokenizer, SYSTEM + "1999-12-31."))
    answer = h.why(second)
    db = db_engine(h.url)
    request = find_request(db, second)
    direct = diagnose(request, requests_before(db, request.arrival_time), lambda *key: latest_eviction(db, *key),
                      Decoder.of(h.engine.tokenizer))  # fmt: skip
    db.dispose()
    assert direct.as_json() == answer and direct.cause is Cause.DIVERGED and answer["match"]["request_id"] == first


def test_a_chats_next_turn_is_compared_with_the_reply_the_engine_generated(history) -> None:
    """Issue 47 item 9: turn 2 holds turn 1's prompt and reply, and the cache serves both; the diagnosis
    compared prompts only and said "diverged where turn 1's prompt ended, theirs: (nothing)"."""
    h = history()
    tokenizer = h.engine.tokenizer
    turn_1 = encode_chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}])
    first = h.engine.submit(turn_1, SamplingParams(max_new_tokens=12, ignore_eos=True))
    h.engine.run_until_idle()
    reply = list(h.engine.get(first).output_token_ids)
    next_question = "<|im_end|>\n<|im_start|>user\nAnd which blocks did you use?<|im_end|>\n<|im_start|>assistant\n"
    turn_2 = turn_1 + reply + list(tokenizer(next_question, add_special_tokens=False)["input_ids"])
    second = h.submit(turn_2)
    computed = len(turn_1) + len(reply) - 1  # the reply's last token was sampled after the last forward
    assert h.engine.get(second).cached_tokens == computed // BS * BS  # the test's own premise
    answer = h.why(second)
    assert answer["cause"] == "extended" and answer["analyzer_reason"] == "compulsory"
    assert answer["match"] == {"request_id": first, "run_id": answer["run_id"], "shared_tokens": computed}
    assert answer["divergence"]["position"] == computed and answer["divergence"]["theirs"] == ""
    assert answer["reusable_tokens"] == answer["cached_tokens"] == computed // BS * BS
    assert answer["cached_tokens"] + answer["missed_tokens"] + answer["never_served_tokens"] == len(turn_2)


def test_two_chats_through_one_template_are_not_said_to_differ_in_their_template(history) -> None:
    """Issue 47 item 10: a short and a long user message through the same template: the special tokens of
    unequal windows (and of the shared prefix) were compared, and a template "on one side" was reported."""
    h = history()
    tokenizer = h.engine.tokenizer

    def chat(question: str) -> list[int]:
        return encode_chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

    long = chat("Walk me through, in many careful words and with examples of blocks, keys and chains, what you did")
    first = h.submit(long)
    second = h.submit(chat("Why?"))
    answer = h.why(second)
    assert answer["cause"] == "diverged" and answer["match"]["request_id"] == first
    assert not any("template" in note for note in answer["divergence"]["notes"])
    assert "<|im_end|>" in answer["divergence"]["template_tokens"]["ours"]  # the short side's window ends its turn
    assert answer["divergence"]["template_tokens"]["theirs"] == []
    assert answer["divergence"]["template"] is None
    db = db_engine(h.url)
    request = find_request(db, second)
    direct = diagnose(request, requests_before(db, request.arrival_time), lambda *key: latest_eviction(db, *key),
                      Decoder.of(tokenizer))  # fmt: skip
    db.dispose()
    assert direct.as_json() == answer  # the CLI's tokenizer-file decoder decodes as the model's tokenizer


def test_a_fork_child_names_its_parent_and_no_wait(history) -> None:
    """Issue 47 item 11: after the guided scenario, child-b was "hit, cached 12/14, reusable 8" and "waited
    for child-a to compute the shared prefix"; a fork shares its parent's blocks."""
    h = history()
    parent = h.engine.submit(list(range(100, 112)), SamplingParams(max_new_tokens=1, ignore_eos=True), retain=True)
    h.engine.run_until_idle()
    children = h.engine.fork_many(parent, [[5], [6]], SamplingParams(max_new_tokens=2, ignore_eos=True), retain=True)
    h.engine.run_until_idle()
    answer = h.why(children[1])
    assert answer["cause"] == "fork" and answer["wait"] is None
    assert answer["match"] == {"request_id": parent, "run_id": answer["run_id"], "shared_tokens": 12}
    assert (answer["prompt_tokens"], answer["cached_tokens"], answer["reusable_tokens"]) == (14, 12, 12)
    assert (answer["missed_tokens"], answer["never_served_tokens"]) == (0, 2)
    for rid in (parent, *children):
        h.engine.release(rid)


def test_the_why_command_imports_neither_torch_nor_transformers(history) -> None:
    """Issue 47 item 12: `cli why` took 8-12 s, importing torch and transformers to load the tokenizer."""
    h = history()
    tokenizer = h.engine.tokenizer
    h.submit(encode_text(tokenizer, SYSTEM + "2024-06-03."))
    second = h.submit(encode_text(tokenizer, SYSTEM + "1999-12-31."))
    h.writer.flush(timeout_s=30)
    data_dir = str(h.engine.config.resolved_data_dir)
    script = ("import json, sys; from cli.__main__ import main; "
              f"status = main(['why', '--db', {h.url!r}, '--request', {second!r}, '--data-dir', {data_dir!r}]); "
              "print(json.dumps([status, 'torch' in sys.modules, 'transformers' in sys.modules]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    *shown, verdict = done.stdout.strip().splitlines()
    assert json.loads(verdict) == [0, False, False], done.stderr
    assert any(line.startswith("  diverged at token") for line in shown) and "1999-12-31" in "\n".join(shown)
