"""Engine tests on tiny random-weight models against the transformers reference (fp32, CPU).

Every scenario checks that reuse never changes outputs (logits within 1e-4, equal greedy tokens) and
that a hit skips work: cached + computed tokens equal the context length and the model never runs on
cached positions.
"""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.engine import Engine, RequestRejected
from engine.core.kv_groups import chain_keys_of
from engine.core.namespace import CONTENT_ROOT_KEY
from engine.core.request import SamplingParams
from engine.core.snapshot import RequestView
from tests.engine_reference import LogitSpy, assert_matches_reference
from tests.engine_support import tokens

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def make_engine(tmp_path, **overrides) -> tuple[Engine, LogitSpy]:
    fields = dict(model="tiny-llama", device="cpu", block_size=4, num_blocks=64, data_dir=tmp_path)
    fields.update(overrides)
    engine = Engine(EngineConfig(**fields))
    return engine, LogitSpy(engine)


def assert_work_skipped(engine: Engine, spy: LogitSpy, rid: str) -> None:
    view = engine.get(rid)
    if view.preemptions == 0:
        assert view.cached_tokens + view.computed_tokens == view.num_prompt_tokens
    assert min(spy.positions[rid]) >= view.cached_tokens, "the model ran on cached positions"


def test_cold_request_matches_reference(tmp_path, tiny_llama_reference):
    engine, spy = make_engine(tmp_path)
    rid = engine.submit(tokens(37, 1), GREEDY)
    engine.run_until_idle()
    view = engine.get(rid)
    assert (view.cached_tokens, view.computed_tokens, view.hit_source) == (0, 37, "none")
    assert len(view.output_token_ids) == 6
    assert_matches_reference(engine, spy, tiny_llama_reference, rid)
    engine.check_invariants()


def test_fork_computes_only_parent_last_token_and_suffix(tmp_path, tiny_llama_reference):
    engine, spy = make_engine(tmp_path)
    parent = engine.submit(tokens(37, 2), GREEDY, retain=True)
    engine.run_until_idle()
    assert engine.get(parent).status == "retained"
    child = engine.fork(parent, tokens(7, 3), GREEDY)
    engine.run_until_idle()
    view = engine.get(child)
    # The parent computed 37 prompt + 5 fed-back tokens; its 6th sampled token was never computed.
    assert view.hit_source == "fork"
    assert view.replay_mode == "full"  # a fork is a hit source; its state is ready, as a full-model hit's is
    assert view.num_prompt_tokens == 37 + 6 + 7
    assert view.cached_tokens == 42
    assert view.computed_tokens == 1 + 7
    assert_work_skipped(engine, spy, child)
    assert_matches_reference(engine, spy, tiny_llama_reference, parent)
    assert_matches_reference(engine, spy, tiny_llama_reference, child)
    engine.check_invariants()


def test_unrelated_request_hits_prefix_index(tmp_path, tiny_llama_reference):
    engine, spy = make_engine(tmp_path)
    shared = tokens(33, 4)
    a = engine.submit(shared + tokens(5, 5), GREEDY)
    engine.run_until_idle()
    b = engine.submit(shared + tokens(9, 6), GREEDY)
    engine.run_until_idle()
    view = engine.get(b)
    assert view.hit_source == "prefix"
    assert view.cached_tokens == 32  # 8 full blocks of 4 tokens inside the 33 shared ones
    assert view.computed_tokens == 42 - 32
    assert_work_skipped(engine, spy, b)
    assert_matches_reference(engine, spy, tiny_llama_reference, a)
    assert_matches_reference(engine, spy, tiny_llama_reference, b)


def test_two_forks_append_different_tokens_through_copy_on_write(tmp_path, tiny_llama_reference):
    engine, spy = make_engine(tmp_path)
    parent = engine.submit(tokens(34, 7), SamplingParams(max_new_tokens=1, ignore_eos=True), retain=True)
    engine.run_until_idle()
    # 34 computed tokens: 8 full blocks and a half-full tail shared by both children.
    c1 = engine.fork(parent, tokens(3, 8), GREEDY)
    c2 = engine.fork(parent, tokens(5, 9), GREEDY)
    engine.run_until_idle()
    v1, v2 = engine.get(c1), engine.get(c2)
    assert v1.cow_copies == 1 and v2.cow_copies == 1  # each copies the tail the parent still holds
    assert v1.block_table[:8] == v2.block_table[:8] == engine.get(parent).block_table[:8]
    assert v1.block_table[8] != v2.block_table[8]
    for rid in (parent, c1, c2):
        assert_matches_reference(engine, spy, tiny_llama_reference, rid)
    engine.check_invariants()


def test_request_reprefilled_after_its_blocks_were_evicted(tmp_path, tiny_llama_reference):
    engine, spy = make_engine(tmp_path, num_blocks=16)
    prompt = tokens(30, 10)
    a = engine.submit(prompt, GREEDY)
    engine.run_until_idle()
    for i in range(3):  # unrelated work large enough to evict everything a left cached
        engine.submit(tokens(40, 20 + i), GREEDY)
        engine.run_until_idle()
    assert engine.stats().evictions > 0
    again = engine.submit(prompt, GREEDY)
    engine.run_until_idle()
    view = engine.get(again)
    assert view.cached_tokens == 0 and view.computed_tokens == 30
    assert engine.get(again).output_token_ids == engine.get(a).output_token_ids
    assert_matches_reference(engine, spy, tiny_llama_reference, again)


def test_preempted_request_resumes_with_identical_output(tmp_path, tiny_llama_reference):
    engine, spy = make_engine(tmp_path, num_blocks=14)
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ids = [engine.submit(tokens(20, 30 + i), long) for i in range(3)]
    engine.run_until_idle()
    assert engine.stats().preemptions > 0
    assert any(engine.get(r).preemptions for r in ids)
    for rid in ids:
        assert len(engine.get(rid).output_token_ids) == 20
        assert_matches_reference(engine, spy, tiny_llama_reference, rid)
    engine.check_invariants()


def test_mixed_batch_of_chunked_prefills_and_decodes(tmp_path, tiny_llama_reference):
    engine, spy = make_engine(tmp_path, max_num_batched_tokens=16)
    ids = [engine.submit(tokens(n, 40 + n), GREEDY) for n in (5, 23, 41, 9)]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert steps > 6  # the 16-token budget forced chunked prefill interleaved with decodes
    for rid in ids:
        assert_matches_reference(engine, spy, tiny_llama_reference, rid)
        assert_work_skipped(engine, spy, rid)


def test_too_large_request_is_rejected_and_recorded(tmp_path):
    engine, _ = make_engine(tmp_path, num_blocks=4)
    with pytest.raises(RequestRejected):
        engine.submit(tokens(30, 1), GREEDY, request_id="big")
    assert engine.get("big").status == "rejected"
    assert not engine.has_work()
    engine.check_invariants()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e: e.submit([], GREEDY), "empty"),
        (lambda e: e.submit([999999], GREEDY), "vocabulary"),
        (lambda e: e.submit([5] * 2048, GREEDY), "positions"),
        (lambda e: e.fork("nope", [1], GREEDY), "unknown parent"),
        (lambda e: e.release("nope"), "unknown"),
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(tmp_path, call, message):
    engine, _ = make_engine(tmp_path)
    before = engine.stats()
    with pytest.raises(ValueError, match=message):
        call(engine)
    assert engine.stats() == before
    assert engine.requests() == []


def test_generated_ids_start_at_the_first_request_number_and_skip_a_named_one(tmp_path):
    fresh, _ = make_engine(tmp_path)
    assert fresh.submit(tokens(5, 1), GREEDY) == "req-0"
    config = EngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=64, data_dir=tmp_path)
    engine = Engine(config, loaded=fresh.loaded, first_request_number=10)
    assert engine.submit(tokens(5, 2), GREEDY, request_id="req-11") == "req-11"
    assert [engine.submit(tokens(5, 3 + i), GREEDY) for i in range(2)] == ["req-10", "req-12"]
    assert engine.next_request_number == 13


def test_a_negative_first_request_number_is_refused(tmp_path):
    config = EngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=64, data_dir=tmp_path)
    with pytest.raises(ValueError, match="first_request_number must be non-negative, got -1"):
        Engine(config, first_request_number=-1)


def test_fork_of_finished_request_is_refused(tmp_path):
    engine, _ = make_engine(tmp_path)
    a = engine.submit(tokens(10, 1), GREEDY)
    engine.run_until_idle()
    with pytest.raises(ValueError, match="finished"):
        engine.fork(a, [7], GREEDY)
    b = engine.submit(tokens(10, 2), GREEDY, retain=True)
    engine.run_until_idle()
    engine.release(b)
    with pytest.raises(ValueError, match="released"):
        engine.fork(b, [7], GREEDY)
    c = engine.submit(tokens(10, 3), GREEDY, retain=True)
    engine.run_until_idle()
    with pytest.raises(ValueError, match="empty"):
        engine.fork(c, [], GREEDY)
    engine.check_invariants()


def test_release_returns_blocks_and_reset_reports_honestly(tmp_path):
    engine, _ = make_engine(tmp_path)
    a = engine.submit(tokens(17, 1), GREEDY, retain=True)
    engine.run_until_idle()
    assert engine.stats().used_blocks == len(engine.get(a).block_table)
    result = engine.reset_cache()
    assert not result.ok and result.kept_blocks > 0  # a's full blocks are still held
    engine.release(a)
    assert engine.stats().used_blocks == 0
    assert engine.reset_cache().ok
    engine.check_invariants()


def test_seeded_sampling_is_reproducible(tmp_path):
    """Regression: this passed with temperature ignored (greedy decoding is reproducible too). Sampling
    must also differ from greedy, and from a draw with another seed."""
    engine, _ = make_engine(tmp_path)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    a = engine.submit(tokens(12, 1), params)
    b = engine.submit(tokens(12, 1), params)
    other_seed = engine.submit(tokens(12, 1), SamplingParams(**{**params.__dict__, "seed": 124}))
    greedy = engine.submit(tokens(12, 1), SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.run_until_idle()
    assert engine.get(a).output_token_ids == engine.get(b).output_token_ids
    assert engine.get(a).output_token_ids != engine.get(greedy).output_token_ids
    assert engine.get(a).output_token_ids != engine.get(other_seed).output_token_ids


def test_listeners_see_each_step_until_removed(tmp_path):
    engine, _ = make_engine(tmp_path)
    seen: list[tuple[int, int]] = []

    def listener(events, views):
        seen.append((len(events), len(views)))

    engine.add_listener(listener)
    rid = engine.submit(tokens(12, 1), GREEDY)
    engine.step()
    assert seen and seen[-1][1] == 1  # the step's events and the view of the request it ran
    calls = len(seen)
    engine.remove_listener(listener)
    engine.run_until_idle()
    assert len(seen) == calls
    assert engine.get(rid).status == "finished"


def test_a_request_view_carries_every_field_of_its_request_by_name(tmp_path):
    """RequestView.of builds its tuple positionally (it is on the hot path): each field must still hold
    the request's value of the same name."""
    engine, _ = make_engine(tmp_path)
    parent = engine.submit(tokens(9, 3), GREEDY, retain=True, salt="tenant")
    engine.run_until_idle()
    child = engine.fork(parent, tokens(3, 4), SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.step()
    request = engine._table.live[child]
    request.replay_divergence = {"max_abs": 0.5}
    request.finish_reason = "stop"
    # Distinct values, so that two fields of one type swapped would show.
    for value, name in enumerate(
        ("num_computed_tokens", "cached_tokens", "computed_tokens", "cow_copies", "preemptions", "window_start",
         "window_end", "replay_from", "replayed_tokens"), start=101,
    ):  # fmt: skip
        setattr(request, name, value)
    request.first_token_time, request.finish_time = 7.0, 8.0
    tables = {"full": [3, 1, 2]}
    view = RequestView.of(request, tables)
    derived = {
        "status": request.status.value,
        "hit_source": request.hit_source.value,
        "num_prompt_tokens": request.num_prompt_tokens,
        "max_new_tokens": 5,
        "block_tables": {"full": (3, 1, 2)},
        "output_token_ids": tuple(request.output_token_ids),
        "block_keys": None,  # the prompt's keys (PromptKeys), once finished
        "content_keys": None,
        "output_logprobs": None,  # its sampling asked for none
    }
    assert set(derived) < set(RequestView._fields)
    for name in RequestView._fields:
        expected = derived[name] if name in derived else getattr(request, name)
        assert getattr(view, name) == expected, name
    assert (view.parent_id, view.salt, view.hit_source, view.retain) == (parent, "tenant", "fork", False)
    assert view.prompt_token_ids == tuple(tokens(9, 3)) + engine.get(parent).output_token_ids + tuple(tokens(3, 4))
    assert view.arrival_time > 0 and view.first_scheduled_time is not None


def test_a_finished_request_keeps_its_prompts_chain_and_content_keys(tmp_path):
    """What the history stores for the workload analyzer: the chain keys the table computed for the
    prompt's full blocks, and the same blocks chained from the namespace-free content root."""
    engine, _ = make_engine(tmp_path)
    bs = engine.config.block_size
    prompt = tokens(3 * bs + bs // 2, 7)  # three full blocks and a partial one
    salted = engine.submit(prompt, GREEDY, salt="tenant")
    plain = engine.submit(prompt, GREEDY)
    assert engine.get(salted).block_keys is None  # not finished yet
    engine.run_until_idle()
    root = engine.namespace.root_key("tenant")
    expected = b"".join(chain_keys_of(prompt, root, bs, 3))
    assert engine.get(salted).block_keys == expected and len(expected) == 3 * 16
    assert engine.get(plain).block_keys != expected  # another salt, another chain
    content = b"".join(chain_keys_of(prompt, CONTENT_ROOT_KEY, bs, 3))
    assert engine.get(salted).content_keys == engine.get(plain).content_keys == content


def test_background_thread_serves_submissions(tmp_path):
    engine, _ = make_engine(tmp_path)
    engine.start()
    try:
        rid = engine.submit(tokens(12, 1), GREEDY)
        import time

        deadline = time.time() + 30
        while engine.get(rid).status != "finished" and time.time() < deadline:
            time.sleep(0.01)
        assert engine.get(rid).status == "finished"
    finally:
        engine.stop()
    assert engine.failure is None


def test_a_burst_shares_its_new_prefix_in_the_step_that_computes_it_and_matches_the_reference(tmp_path, tiny_llama_reference):
    """In-flight hits: the first request's chunk computes the shared blocks, the others read them in the
    same forward (the runner writes every chunk's K/V before any attention reads it)."""
    engine, spy = make_engine(tmp_path)
    prefix = tokens(26, 3)  # 6 full blocks and 2 tokens: the 2 are not shared
    ids = [engine.submit(prefix + tokens(3 + i, 10 + i), GREEDY) for i in range(4)]
    ids.append(engine.submit(prefix[:9] + tokens(8, 20), GREEDY))  # 2 blocks in common with the first
    engine.step()
    assert all(len(engine.get(rid).output_token_ids) == 1 for rid in ids), "one step starts every request"
    engine.check_invariants()
    engine.run_until_idle()
    assert [engine.get(rid).cached_tokens for rid in ids] == [0, 24, 24, 24, 8]
    assert [engine.get(rid).hit_source for rid in ids] == ["none"] + ["prefix"] * 4
    for rid in ids:
        assert_matches_reference(engine, spy, tiny_llama_reference, rid)
        assert_work_skipped(engine, spy, rid)
    engine.check_invariants()
    stats = engine.stats()
    assert stats.used_blocks == 0 and stats.prefix_hit_tokens == 3 * 24 + 8


def test_a_burst_waits_for_a_shared_prefix_the_first_request_computes_over_several_steps(tmp_path, tiny_llama_reference):
    """Sharing the first chunk's blocks now would compute the rest of the shared prefix twice: wait."""
    engine, spy = make_engine(tmp_path, max_num_batched_tokens=16)
    prefix = tokens(40, 5)
    first = engine.submit(prefix + [9], GREEDY)
    second = engine.submit(prefix + [11], GREEDY)
    engine.step()
    assert engine.get(second).status == "waiting"
    engine.run_until_idle()
    assert engine.get(second).cached_tokens == 40 and engine.get(second).computed_tokens == 1
    for rid in (first, second):
        assert_matches_reference(engine, spy, tiny_llama_reference, rid)
    engine.check_invariants()


def test_a_burst_sharing_a_new_prefix_computes_it_once(make_model):
    """Regression: requests arriving together used to prefill their shared, not yet cached prefix twice."""
    engine = Engine(EngineConfig(model="tiny-llama", num_blocks=64, block_size=16), loaded=make_model("tiny-llama"))
    prefix = [3 + i % 500 for i in range(64)]
    ids = [engine.submit(prefix + [400 + i] * 4, SamplingParams(max_new_tokens=2)) for i in range(4)]
    engine.run_until_idle()
    assert [engine.get(i).cached_tokens for i in ids] == [0, 64, 64, 64]
    assert sum(engine.get(i).computed_tokens for i in ids) == 68 + 3 * 4


def test_logprobs_come_one_per_output_token_and_leave_greedy_tokens_as_they_were(tmp_path):
    engine, _ = make_engine(tmp_path)
    prompt = tokens(21, 5)
    plain = engine.submit(prompt, GREEDY)
    asked = engine.submit(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3))
    engine.run_until_idle()
    assert engine.get(plain).output_logprobs is None
    view = engine.get(asked)
    assert view.output_token_ids == engine.get(plain).output_token_ids
    assert len(view.output_logprobs) == 6
    for token, logprobs in zip(view.output_token_ids, view.output_logprobs):
        assert len(logprobs.top) == 3 and logprobs.top[0][0] == token  # greedy: the likeliest token
        assert logprobs.logprob == logprobs.top[0][1] <= 0.0


def test_penalties_change_what_a_greedy_request_repeats(tmp_path):
    engine, _ = make_engine(tmp_path)
    prompt = tokens(21, 6)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    penalized = SamplingParams(max_new_tokens=12, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    plain, fresh = engine.submit(prompt, greedy), engine.submit(prompt, penalized)
    engine.run_until_idle()
    repeats = [len(v.output_token_ids) - len(set(v.output_token_ids)) for v in map(engine.get, (plain, fresh))]
    assert repeats[1] < repeats[0]


def test_a_logit_bias_outside_the_vocabulary_is_refused_and_nothing_is_recorded(tmp_path):
    engine, _ = make_engine(tmp_path)
    before = len(engine.requests())
    with pytest.raises(ValueError, match="logit_bias"):
        engine.submit(tokens(5, 1), SamplingParams(logit_bias=((engine.vocab_size, 1.0),)))
    assert len(engine.requests()) == before
