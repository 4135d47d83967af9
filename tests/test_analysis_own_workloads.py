"""This project's own workloads as traces: run-trace files keyed as the engine keys them, and the history of
real engine runs; namespace misses; bad lines named by their number."""

from __future__ import annotations

import io
import json

import pytest

from analysis.analyzer import AnalysisConfig, analyze
from analysis.breakdown import MissBreakdown, hit_bounds, miss_breakdown
from analysis.errors import TraceError
from analysis.own_workloads import Keying, history_trace, key_ids, read_run_trace
from analysis.policies import Policy
from analysis.trace import PartialBlocks, TraceFormat
from engine.core.block_pool import BlockPool
from engine.core.config import EngineConfig
from engine.engine import Engine
from engine.core.events import EventLog
from engine.core.full_attention_manager import FullAttentionManager
from engine.runner.model_loading import smollm2_tokenizer
from engine.core.namespace import CacheNamespace
from serving.prompts import encode_chat, encode_text
from engine.core.request import SamplingParams
from storage.read import queries
from storage.db import db_engine
from storage.write.recorder import record_engine
from storage.write.writer import EventWriter
from tests.manager_support import root_key
from tests.own_workload_support import NAMESPACE, token_prompts, write_run_trace

KEYING = Keying(NAMESPACE, None)


def run_trace(*lines: dict | str, keying: Keying = KEYING):
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return read_run_trace(io.BytesIO(text.encode()), keying)


def submit(rid: str, tokens: list[int], **fields) -> dict:
    return {"op": "submit", "id": rid, "tokens": tokens, **fields}


def test_block_ids_are_the_chain_keys_the_kv_cache_manager_computes():
    tokens = list(range(10, 23))  # three full blocks of 4 and one token
    trace = run_trace(submit("a", tokens, salt="t"))
    log = EventLog()
    manager = FullAttentionManager(BlockPool(8, 4, log), NAMESPACE, log)
    manager.allocate("a", tokens, root_key=root_key(manager, "t"))
    manager.cache_full_blocks("a")
    assert trace.block_ids.tolist() == list(key_ids(b"".join(manager.chain_keys("a"))))
    assert trace.partial_blocks is PartialBlocks.DROPPED and trace.format is TraceFormat.RUN_TRACE
    assert trace.input_lengths.tolist() == [13] and trace.blocks_per_request.tolist() == [3]


def test_the_same_tokens_under_another_salt_are_namespace_misses():
    tokens = list(range(10, 19))  # two full blocks and one token
    trace = run_trace(submit("a", tokens), submit("b", tokens, salt="tenant"), submit("c", tokens, salt="tenant"))
    bounds = hit_bounds(trace)
    assert bounds.infinite.tolist() == [0, 0, 2] and bounds.any_namespace.tolist() == [0, 2, 2]
    # a: 8 compulsory; b: its 8 were cached for another tenant; c hits them; every tail token is partial.
    assert miss_breakdown(trace, bounds.infinite, bounds) == MissBreakdown(8, 0, 3, 0, 8)
    assert [hits.request_type for hits in analyze(trace, AnalysisConfig((64,))).max_by_type] == ["tenant"]


def test_a_run_trace_of_random_workloads_analyses_with_every_policy(tmp_path):
    trace = read_run_trace(write_run_trace(tmp_path, token_prompts()).open("rb"), KEYING)
    analysis = analyze(trace, AnalysisConfig((12, 24, 48), tuple(Policy)))
    for point in analysis.curve:
        assert point.hit_tokens + point.misses.total == trace.input_tokens
    assert analysis.unavoidable.namespace > 0


def test_text_and_chat_are_tokenized_as_run_trace_tokenizes_them(test_data_dir):
    tokenizer = smollm2_tokenizer(test_data_dir)
    chat = [{"role": "user", "content": "What is a prefix cache?"}]
    trace = run_trace(
        {"op": "submit", "id": "t", "text": "Operators share one long system prompt across requests."},
        {"op": "submit", "id": "c", "chat": chat, "max_new_tokens": 3},
        keying=Keying(NAMESPACE, tokenizer),
    )
    text_tokens = encode_text(tokenizer, "Operators share one long system prompt across requests.")
    assert trace.input_lengths.tolist() == [len(text_tokens), len(encode_chat(tokenizer, chat))]
    assert trace.output_lengths.tolist() == [SamplingParams().max_new_tokens, 3]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([submit("a", [1, 2, 3, 4]), '{"op": "submit", "id": "b", "tokens": [1, 2'], "line 2: not valid JSON"),
        ([submit("a", [1, 2, 3, 4]), {"op": "fork", "id": "b", "parent": "a", "suffix_tokens": [5]}],
         "line 2: a fork's context includes its parent's generated tokens"),
        ([{"op": "run"}, {"op": "bake"}], "line 2: unknown op 'bake'"),
        ([{"op": "submit", "tokens": [1, 2]}], "line 1: submit needs a non-empty string 'id'"),
        ([{"op": "submit", "id": "a", "text": "hello"}], "line 1: this model has no tokenizer"),
        ([submit("a", [1, -2])], "line 1: token ids must be in"),
        ([submit("a", [1, 2], max_new_tokens=0)], "line 1: max_new_tokens must be an integer in"),
        ([{"op": "run"}, {"op": "reset"}], "no submit lines"),
    ],
)  # fmt: skip
def test_a_bad_run_trace_line_is_named_by_its_number(lines, message):
    with pytest.raises(TraceError, match=message):
        run_trace(*lines)


def recorded_history(tmp_path, runs: list[dict], prompts: list[list[int]]) -> str:
    """A SQLite history of real engine runs (tiny-llama, 4-token blocks): every prompt once per run."""
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    for fields in runs:
        config = EngineConfig(**{"model": "tiny-llama", "device": "cpu", "block_size": 4, "num_blocks": 64,
                                 "data_dir": tmp_path, **fields})  # fmt: skip
        engine = Engine(config)
        writer = EventWriter(url)
        record_engine(engine, writer)
        for tokens in prompts:
            engine.submit(tokens, SamplingParams(max_new_tokens=2, ignore_eos=True))
            engine.run_until_idle()
        assert writer.close()
    return url


def test_the_history_holds_the_engines_own_keys_and_tells_namespace_misses_across_runs(tmp_path):
    prompts = [list(range(10, 23)), list(range(10, 19)) + [7, 7, 7]]  # share two blocks
    url = recorded_history(tmp_path, [{"seed": 0}, {"seed": 1}], prompts)  # other weights: another namespace
    database = db_engine(url)
    rows = queries.prompt_chains(database)
    database.dispose()
    trace = history_trace(rows.to_dict("records"))
    assert trace.format is TraceFormat.HISTORY and len(trace) == 4 and trace.block_size == 4

    engine = Engine(EngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=64, data_dir=tmp_path))
    first_run = run_trace(*(submit(str(i), tokens) for i, tokens in enumerate(prompts)),
                          keying=Keying(engine.namespace, None))  # fmt: skip
    assert trace.block_ids[: first_run.num_references].tolist() == first_run.block_ids.tolist()
    bounds = hit_bounds(trace)
    assert bounds.infinite.tolist() == [0, 2, 0, 2]  # within a run, the shared blocks hit
    assert bounds.any_namespace.tolist() == [0, 2, 3, 3]  # the second run's tokens were all seen under the first
    assert miss_breakdown(trace, bounds.infinite, bounds).namespace == (3 + 1) * 4


def test_a_history_of_several_block_sizes_needs_one_chosen(tmp_path):
    prompt = list(range(10, 30))
    url = recorded_history(tmp_path, [{"block_size": 4}, {"block_size": 8}], [prompt])
    database = db_engine(url)
    rows = queries.prompt_chains(database).to_dict("records")
    database.dispose()
    with pytest.raises(TraceError, match=r"block sizes \[4, 8\]: choose one"):
        history_trace(rows)
    assert history_trace(rows, 8).blocks_per_request.tolist() == [2]
    with pytest.raises(TraceError, match="no finished requests with stored prompt keys at block size 16"):
        history_trace(rows, 16)


def test_an_empty_history_is_a_clear_error():
    with pytest.raises(TraceError, match="no finished requests"):
        history_trace([])


def test_a_namespace_is_every_field_the_keys_hang_from():
    other = CacheNamespace("tiny-llama", "rev-2", "float32", 4, ("full",))
    tokens = list(range(10, 18))
    first, second = run_trace(submit("a", tokens)), run_trace(submit("a", tokens), keying=Keying(other, None))
    assert first.block_ids.tolist() != second.block_ids.tolist()
    assert first.content_ids.tolist() == second.content_ids.tolist()
