"""Sliding-window attention: prefix hits with ready window state, exact and approximate replay, window release.

References: transformers' Ministral (hybrid: even layers sliding) and Mistral (all sliding) on the same
seeded weights, run as plain full forwards.
"""

from __future__ import annotations

import random

from engine.core.config import EngineConfig
from engine.engine import Engine, RequestRejected
from engine.core.events import EventKind, EvictReason
from engine.core.request import SamplingParams
from tests.engine_reference import LogitSpy, assert_matches_reference
from tests.engine_support import HYBRID_WINDOW, tokens

W = HYBRID_WINDOW
BS = 4
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def hybrid_engine(tmp_path, **overrides) -> tuple[Engine, LogitSpy]:
    fields = dict(model="tiny-llama", attention_override=f"hybrid:{W}", device="cpu", block_size=BS, num_blocks=64,
                  data_dir=tmp_path)
    fields.update(overrides)
    engine = Engine(EngineConfig(**fields))
    return engine, LogitSpy(engine)


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> str:
    rid = engine.submit(prompt, params)
    engine.run_until_idle()
    return rid


def test_hybrid_spec_splits_layers_into_two_groups(tmp_path):
    engine, _ = hybrid_engine(tmp_path)
    assert [g.name for g in engine.runner.groups] == ["full", "sliding"]
    assert engine.runner.groups[1].window == W
    assert engine.namespace.attention_spec == ("sliding:8", "full", "sliding:8", "full")


def test_ready_hit_replays_nothing_and_matches_reference(tmp_path, hybrid_reference):
    engine, spy = hybrid_engine(tmp_path)
    a = run(engine, tokens(30, 1))
    context = list(engine.get(a).prompt_token_ids) + list(engine.get(a).output_token_ids)
    b = run(engine, context[:32] + tokens(5, 2))
    view = engine.get(b)
    assert (view.cached_tokens, view.replay_mode, view.replay_from, view.replayed_tokens) == (32, "ready", 32, 0)
    assert view.window_start <= 32 - W + 1 and view.window_end == 32
    assert view.computed_tokens == 5
    for rid in (a, b):
        assert_matches_reference(engine, spy, hybrid_reference, rid)
    engine.check_invariants()


def exact_replay_setup(engine: Engine) -> tuple[list[int], list[int]]:
    """C caches window state at position 20; A caches full blocks to 40 and window state only at its end."""
    x = tokens(20, 3)
    run(engine, x, SamplingParams(max_new_tokens=1, ignore_eos=True))
    a_prompt = x + tokens(20, 4)
    run(engine, a_prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    return x, a_prompt


def test_exact_replay_from_the_last_ready_point_matches_reference(tmp_path, hybrid_reference):
    engine, spy = hybrid_engine(tmp_path)
    _, a_prompt = exact_replay_setup(engine)
    events = []
    engine.add_listener(lambda batch, _views: events.extend(batch))
    b = run(engine, a_prompt[:36] + tokens(4, 5))
    view = engine.get(b)
    assert view.cached_tokens == 36  # full-layer hit
    assert view.replay_mode == "exact" and view.replay_from == 20 and view.replayed_tokens == 16
    assert min(spy.positions[b]) == 20  # the model ran from r, never before it
    assert view.computed_tokens == 40 - 20
    assert_matches_reference(engine, spy, hybrid_reference, b)
    replays = [e for e in events if e.kind is EventKind.REPLAY]
    assert [(e.request_id, e.detail["h"], e.detail["r"], e.detail["mode"]) for e in replays] == [(b, 36, 20, "exact")]
    engine.check_invariants()


def test_a_replay_longer_than_a_step_keeps_its_computed_length_and_forks_from_it(tmp_path, hybrid_reference):
    """Regression: when an exact replay takes several steps, the full group already holds the whole hit
    [0, h) while the sliding group holds only what was replayed so far. The coordinator took the longer
    of the two as the request's length, so `check_invariants` failed mid-replay and a fork there would
    have shared window state that was never computed."""
    engine, spy = hybrid_engine(tmp_path, max_num_batched_tokens=8)
    _, a_prompt = exact_replay_setup(engine)
    b = engine.submit(a_prompt[:36] + tokens(4, 5), GREEDY, retain=True)
    engine.step()
    view = engine.get(b)
    assert (view.cached_tokens, view.replay_mode, view.replay_from) == (36, "exact", 20)
    assert view.num_computed_tokens == 28  # one 8-token chunk of the replay
    engine.check_invariants()
    child = engine.fork(b, tokens(3, 6), GREEDY)
    assert engine.get(child).num_computed_tokens == 28
    engine.run_until_idle()
    for rid in (b, child):
        assert_matches_reference(engine, spy, hybrid_reference, rid)
    engine.check_invariants()


def test_approximate_replay_is_bounded_and_its_divergence_is_measured(tmp_path):
    engine, spy = hybrid_engine(tmp_path, allow_approximate_replay=True, verify_replay=True)
    _, a_prompt = exact_replay_setup(engine)
    b = run(engine, a_prompt[:36] + tokens(4, 5))
    view = engine.get(b)
    assert view.replay_mode == "approximate"
    assert view.replayed_tokens <= W  # backtrack 0: at most W tokens recomputed
    assert min(spy.positions[b]) == view.replay_from == 28
    div = view.replay_divergence
    assert div is not None and div["num_tokens"] == 4
    assert div["max_abs_logit"] >= 0 and 0 <= div["top1_agreement"] <= 1 and div["mean_kl"] >= -1e-6
    engine.check_invariants()


def test_state_from_an_approximate_replay_is_never_hit(tmp_path):
    """Regression: blocks computed after an approximate replay were cached like exact ones, so a follow-up
    request got a "ready" hit on approximate state and its logits drifted from the reference."""
    engine, _ = hybrid_engine(tmp_path, allow_approximate_replay=True)
    _, a_prompt = exact_replay_setup(engine)
    events = []
    engine.add_listener(lambda batch, _views: events.extend(batch))
    b = engine.submit(a_prompt[:36] + tokens(8, 5), SamplingParams(max_new_tokens=6, ignore_eos=True), retain=True)
    engine.run_until_idle()
    assert engine.get(b).replay_mode == "approximate"
    child = engine.fork(b, tokens(3, 6), GREEDY)  # a fork shares b's state, so it inherits the taint
    engine.run_until_idle()
    assert (engine.get(child).hit_source, engine.get(child).replay_mode) == ("fork", "ready")
    assert not [e for e in events if e.kind is EventKind.CACHE and e.request_id in (b, child)]
    context = list(engine.get(b).prompt_token_ids) + list(engine.get(b).output_token_ids)
    engine.release(b)
    c = run(engine, context + tokens(4, 7))
    assert engine.get(c).cached_tokens <= 36  # nothing b or its fork computed is in the index
    engine.check_invariants()


def test_approximate_replay_is_not_used_unless_allowed(tmp_path):
    engine, _ = hybrid_engine(tmp_path)
    _, a_prompt = exact_replay_setup(engine)
    b = run(engine, a_prompt[:36] + tokens(4, 5))
    assert engine.get(b).replay_mode == "exact"


def test_backtrack_keeps_window_state_ready_a_little_earlier(tmp_path):
    engine, _ = hybrid_engine(tmp_path, window_backtrack=8)
    _, a_prompt = exact_replay_setup(engine)
    b = run(engine, a_prompt[:36] + tokens(4, 5))
    assert engine.get(b).replay_mode == "ready"


def test_sliding_blocks_outside_the_window_are_released_during_long_generation(tmp_path, mistral_reference):
    engine = Engine(EngineConfig(model="tiny-mistral", device="cpu", block_size=BS, num_blocks=64, data_dir=tmp_path))
    spy = LogitSpy(engine)
    rid = engine.submit(tokens(10, 6), SamplingParams(max_new_tokens=30, ignore_eos=True))
    held = []
    while engine.has_work():
        engine.step()
        held.append(len(engine.get(rid).block_tables.get("sliding", ())))
    assert max(held) <= -(-(W - 1) // BS) + 2  # the window's blocks plus the one being written
    assert engine.stats().groups[0].window_released_blocks >= 5
    assert_matches_reference(engine, spy, mistral_reference, rid)
    engine.check_invariants()


def test_all_sliding_prefix_hit_is_ready_and_matches_reference(tmp_path, mistral_reference):
    engine = Engine(EngineConfig(model="tiny-mistral", device="cpu", block_size=BS, num_blocks=64, data_dir=tmp_path))
    spy = LogitSpy(engine)
    a = run(engine, tokens(30, 7))
    context = list(engine.get(a).prompt_token_ids) + list(engine.get(a).output_token_ids)
    b = run(engine, context[:32] + tokens(6, 8))
    view = engine.get(b)
    assert view.replay_mode == "ready" and view.cached_tokens == 32
    assert_matches_reference(engine, spy, mistral_reference, b)


def test_cached_sliding_blocks_can_be_evicted_alone(tmp_path):
    engine, _ = hybrid_engine(tmp_path)
    run(engine, tokens(30, 1))
    full, sliding = engine.kv.full.pool, engine.kv.sliding.pool
    assert sliding.num_evictable > 0
    while sliding.num_evictable:
        sliding.evict(sliding.blocks[sliding.evictable_in_eviction_order()[0]], EvictReason.LRU)
    assert full.num_cached > 0 and sliding.num_cached == 0
    engine.check_invariants()


def test_invariants_hold_with_two_groups_under_random_workload(tmp_path):
    engine, _ = hybrid_engine(tmp_path, num_blocks=40, max_num_batched_tokens=16, window_backtrack=4)
    rng = random.Random(11)
    stems = [tokens(12, 20), tokens(24, 21)]
    live: list[str] = []
    for step in range(60):
        op = rng.random()
        try:
            if op < 0.35:
                live.append(engine.submit(rng.choice(stems)[: rng.randrange(5, 24)] + tokens(rng.randrange(1, 6), step),
                                          SamplingParams(max_new_tokens=rng.randrange(1, 6), ignore_eos=True),
                                          retain=rng.random() < 0.4))
            elif op < 0.55 and live:
                parent = rng.choice(live)
                if engine.get(parent).status in ("running", "retained"):
                    live.append(engine.fork(parent, tokens(rng.randrange(1, 5), step), GREEDY))
            elif op < 0.65 and live:
                rid = rng.choice(live)
                if engine.get(rid).status == "retained":
                    engine.release(rid)
            else:
                engine.step()
        except RequestRejected:
            pass  # requests too large for the pool are part of the workload; any other error fails the test
        engine.check_invariants()
    engine.run_until_idle()
    engine.check_invariants()
