"""Reuse on the real SmolLM2-135M-Instruct weights: chat-templated prompts, prefix hits, forks, CoW."""

from __future__ import annotations

from engine.core.config import EngineConfig
from engine.engine import Engine
from serving.prompts import encode_chat
from engine.core.request import SamplingParams
from tests.conftest import load_cpu_model
from tests.engine_reference import LogitSpy, assert_matches_reference

SYSTEM = "You are a concise assistant for an LLM-serving team. " * 6
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def chat(engine: Engine, question: str) -> list[int]:
    return encode_chat(engine.tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def test_prefix_hit_and_fork_match_reference_on_smollm2(smollm2_pair):
    engine, spy, reference = smollm2_pair
    a = engine.submit(chat(engine, "What is a KV cache?"), GREEDY, retain=True)
    engine.run_until_idle()
    b = engine.submit(chat(engine, "Why share prefixes?"), GREEDY)
    engine.run_until_idle()
    view_b = engine.get(b)
    assert view_b.hit_source == "prefix" and view_b.cached_tokens >= 64
    assert view_b.cached_tokens + view_b.computed_tokens == view_b.num_prompt_tokens

    suffix = engine.tokenizer(" And in one word?", add_special_tokens=False)["input_ids"]
    c1 = engine.fork(a, suffix, GREEDY)
    c2 = engine.fork(a, suffix[:-1], GREEDY)
    engine.run_until_idle()
    assert engine.get(c1).computed_tokens == 1 + len(suffix)
    assert engine.get(c1).cow_copies == 1 and engine.get(c2).cow_copies == 1
    for rid in (a, b, c1, c2):
        assert_matches_reference(engine, spy, reference, rid)
    engine.release(a)
    engine.check_invariants()


def test_smollm2_as_hybrid_model_exact_replay_matches_ministral_reference(test_data_dir):
    override = "hybrid:32"
    reference = load_cpu_model("smollm2", test_data_dir, attention_override=override)
    engine = Engine(EngineConfig(model="smollm2", device="cpu", block_size=16, num_blocks=64, data_dir=test_data_dir,
                                 attention_override=override))
    spy = LogitSpy(engine)
    assert [g.name for g in engine.runner.groups] == ["full", "sliding"]
    text = engine.tokenizer("Prefix caching shares the KV of a common prompt between requests. " * 8)["input_ids"]
    short, long = text[:48], text[:112]
    for prompt in (short, long):  # window state cached at 48 (short's end) and at 112 (long's end)
        engine.submit(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        engine.run_until_idle()
    rid = engine.submit(long[:96] + text[:5], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.run_until_idle()
    view = engine.get(rid)
    assert view.cached_tokens == 96 and view.replay_mode == "exact" and view.replay_from == 48
    assert_matches_reference(engine, spy, reference, rid)
    engine.check_invariants()
