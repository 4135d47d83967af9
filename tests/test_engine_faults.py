"""Engine faults a console must survive, on a real tiny model (fp32, CPU), and a property test of the
engine's invariants under random submits, forks, releases, resets, NaN requests and a retire (restart).

Non-finite logits are injected through the weights: one row of the input embedding (token POISON) is
set to NaN, as a corrupted checkpoint row or an fp16 overflow would leave it. Every request whose
context holds that token computes NaN from that position on, through the real forward, attention and
KV blocks; every other token's computation is the untouched seeded model, so the other requests are
checked against the transformers reference on clean weights (conftest's `tiny_llama_reference`).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.config import EngineConfig
from engine.engine import Engine, RequestRejected
from engine.runner.model_loading import LoadedModel, load_model
from engine.core.request import SamplingParams
from tests.engine_reference import LogitSpy, assert_matches_reference
from tests.storage_support import wait_for

POISON = 7  # the token id whose embedding is NaN
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 512) for _ in range(n)]  # never POISON


def poisoned_model(data_dir) -> LoadedModel:
    """Seeded tiny-llama whose embedding row POISON is NaN (the LM head stays finite)."""
    loaded = load_model(EngineConfig(model="tiny-llama", dtype="float32", device="cpu", data_dir=data_dir))
    embedding = loaded.model.get_input_embeddings().weight
    assert embedding.data_ptr() != loaded.model.get_output_embeddings().weight.data_ptr()  # untied
    with torch.no_grad():
        embedding[POISON] = float("nan")
    return loaded


def poisoned_engine(tmp_path, num_blocks: int, loaded: LoadedModel | None = None) -> Engine:
    config = EngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=num_blocks, data_dir=tmp_path)
    return Engine(config, loaded=loaded or poisoned_model(tmp_path))


def assert_block_memory_finite(engine: Engine) -> None:
    assert all(bool(torch.isfinite(kv).all()) for kv in engine.runner.kv), "a NaN outlived its request"


def test_a_request_whose_logits_go_nan_fails_alone_and_the_others_match_the_reference(tmp_path, tiny_llama_reference):
    """Before: greedy argmax of NaN logits returned a token silently, and a sampled request's
    `torch.multinomial` raised, which stopped the background loop with every request unfinished."""
    engine = poisoned_engine(tmp_path, num_blocks=32)
    spy = LogitSpy(engine)
    good = [engine.submit(tokens(13, 1), GREEDY), engine.submit(tokens(9, 2), SAMPLED)]
    sampled_bad = engine.submit(tokens(5, 3) + [POISON] + tokens(5, 4), SAMPLED)
    finished = engine.step()  # the good ones decode from here on
    greedy_bad = engine.submit([POISON], GREEDY)  # joins their decode batch
    finished += engine.run_until_idle()

    for rid, position in ((sampled_bad, 10), (greedy_bad, 0)):
        view = engine.get(rid)
        assert view.status == "failed"
        assert view.finish_reason == f"non-finite logits (NaN or inf) at position {position}"
        assert view.output_token_ids == () and not engine.kv.has_table(rid)  # its blocks went back
    assert {v.request_id for v in finished} == {*good, sampled_bad, greedy_bad}
    for rid in good:
        assert engine.get(rid).status == "finished" and len(engine.get(rid).output_token_ids) == 6
    assert_matches_reference(engine, spy, tiny_llama_reference, good[0])  # greedy: logits and tokens
    engine.check_invariants()
    stats = engine.stats()
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.num_blocks
    assert_block_memory_finite(engine)
    cached = [b for b in engine.snapshot().blocks if b.key is not None]
    assert cached and all(POISON not in b.token_ids for b in cached)  # nothing of theirs can be hit


def test_blocks_a_failed_request_held_serve_the_next_requests_correctly(tmp_path, tiny_llama_reference):
    """A pool so small that the next two requests need every block, the failed request's included."""
    engine = poisoned_engine(tmp_path, num_blocks=16)
    spy = LogitSpy(engine)
    bad = engine.submit(tokens(20, 5) + [POISON] + tokens(9, 6), GREEDY)  # 36 tokens: 9 blocks
    engine.run_until_idle()
    assert engine.get(bad).status == "failed"
    assert_block_memory_finite(engine)
    after = [engine.submit(tokens(25, 7 + i), GREEDY) for i in range(2)]  # 31 tokens: 8 blocks each
    engine.run_until_idle()
    for rid in after:
        assert engine.get(rid).status == "finished"
        assert_matches_reference(engine, spy, tiny_llama_reference, rid)
    engine.check_invariants()


def test_in_flight_sharers_of_a_request_that_goes_nan_fail_only_if_poisoned_themselves(tmp_path, tiny_llama_reference):
    """Sharers read the first request's blocks in the forward that computes them. When that forward goes
    non-finite, its K/V is zeroed and none of it enters the index, and the sharers go back to the queue
    (the NaN reaches even its blocks before the poison: a causal mask's zero weight times NaN is NaN).
    Recomputed on their own, those whose prompts hold the poison fail; the other matches the reference."""
    engine = poisoned_engine(tmp_path, num_blocks=32)
    spy = LogitSpy(engine)
    prefix = tokens(9, 10) + [POISON] + tokens(2, 11)  # 3 full blocks, the poison in the third
    poisoned = [engine.submit(prefix + tokens(2, 12 + i), GREEDY) for i in range(2)]
    clean = engine.submit(prefix[:8] + tokens(3, 20), GREEDY)  # shares 2 blocks, before the poison
    engine.step()
    assert [engine.get(rid).cached_tokens for rid in poisoned + [clean]] == [0, 12, 8]  # shared in flight
    assert [engine.get(rid).status for rid in poisoned + [clean]] == ["failed", "waiting", "waiting"]
    assert engine.get(clean).preemptions == 1
    engine.run_until_idle()
    assert [engine.get(rid).status for rid in poisoned + [clean]] == ["failed", "failed", "finished"]
    assert_matches_reference(engine, spy, tiny_llama_reference, clean)
    engine.check_invariants()
    assert engine.stats().used_blocks == 0
    assert_block_memory_finite(engine)
    cached = [b for b in engine.snapshot().blocks if b.key is not None]
    assert all(POISON not in b.token_ids for b in cached)


def test_a_failed_request_on_the_background_loop_leaves_the_loop_serving(tmp_path):
    engine = poisoned_engine(tmp_path, num_blocks=32)
    engine.start()
    try:
        bad = engine.submit(tokens(6, 8) + [POISON], SAMPLED)
        good = engine.submit(tokens(6, 9), SAMPLED)
        assert wait_for(lambda: not engine.has_work() or engine.failure is not None, timeout_s=60)
        assert engine.failure is None
        assert (engine.get(bad).status, engine.get(good).status) == ("failed", "finished")
    finally:
        engine.stop()
    engine.check_invariants()


# ---------------------------------------------------------------- property test
STEMS = [tokens(8, 10), tokens(8, 10)[:4] + tokens(4, 11), tokens(5, 12)]  # shared stems: prefix hits are common
tails = st.lists(st.integers(8, 40), max_size=10)
_MODEL: list[LoadedModel] = []  # one poisoned model for every example (each engine has its own KV memory)


class EngineFaultMachine(RuleBasedStateMachine):
    """Random submits and forks (some holding POISON, some sampled), releases, steps, resets and the
    retire of a restart, on a 16-block pool (preemptions are common). After every rule: the engine's
    invariants hold, the block memory is finite, nothing cached holds POISON, exactly the poisoned
    requests fail, and after `retire` no request holds a block and no new one is taken."""

    def __init__(self) -> None:
        super().__init__()
        if not _MODEL:
            _MODEL.append(poisoned_model(None))
        self.engine = poisoned_engine(None, num_blocks=16, loaded=_MODEL[0])
        self.poisoned: set[str] = set()
        self.retired = False  # after `retire` every submit is refused

    def _params(self, sampled: bool, new: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=new, temperature=0.9 if sampled else 0.0, seed=1, ignore_eos=True)

    @rule(stem=st.sampled_from(STEMS), tail=tails, poison_at=st.none() | st.integers(0, 20),
          sampled=st.booleans(), retain=st.booleans(), new=st.integers(1, 6))  # fmt: skip
    def submit(self, stem, tail, poison_at, sampled, retain, new):
        prompt = stem + tail
        if poison_at is not None:
            prompt.insert(min(poison_at, len(prompt)), POISON)
        if self.retired:
            with pytest.raises(ValueError, match="takes no new requests: restart"):
                self.engine.submit(prompt, self._params(sampled, new), retain=retain)
            return
        try:
            rid = self.engine.submit(prompt, self._params(sampled, new), retain=retain)
        except RequestRejected:
            return
        if poison_at is not None:
            self.poisoned.add(rid)

    def _holders(self) -> list[str]:
        return sorted(r.request_id for r in self.engine.requests() if r.status in ("running", "retained"))

    @precondition(lambda self: self._holders())
    @rule(data=st.data(), suffix=st.lists(st.integers(8, 40), min_size=1, max_size=6), poison=st.booleans())
    def fork(self, data, suffix, poison):
        parent = data.draw(st.sampled_from(self._holders()))
        try:
            child = self.engine.fork(parent, suffix + ([POISON] if poison else []), self._params(False, 3))
        except RequestRejected:
            return
        if poison or parent in self.poisoned:
            self.poisoned.add(child)

    @precondition(lambda self: any(r.status == "retained" for r in self.engine.requests()))
    @rule(data=st.data())
    def release(self, data):
        retained = sorted(r.request_id for r in self.engine.requests() if r.status == "retained")
        self.engine.release(data.draw(st.sampled_from(retained)))

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            if self.engine.has_work():
                self.engine.step()

    @rule()
    def reset(self):
        self.engine.reset_cache()

    @rule()
    def retire(self):
        self.engine.retire("restart")
        self.retired = True
        stats = self.engine.stats()
        assert (stats.used_blocks, stats.num_running, stats.num_waiting, stats.num_retained) == (0, 0, 0, 0)

    @invariant()
    def invariants_hold(self):
        self.engine.check_invariants()

    @invariant()
    def block_memory_is_finite(self):
        assert_block_memory_finite(self.engine)

    @invariant()
    def nothing_cached_holds_poison(self):
        assert all(POISON not in b.token_ids for b in self.engine.snapshot().blocks if b.key is not None)

    @invariant()
    def exactly_the_poisoned_requests_fail(self):
        for view in self.engine.requests():
            if view.status == "failed":
                assert view.request_id in self.poisoned
            if view.request_id in self.poisoned:
                assert view.status not in ("finished", "retained", "released"), view.request_id


TestEngineFaultMachine = EngineFaultMachine.TestCase
TestEngineFaultMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


def test_only_rows_holding_a_nan_or_an_infinity_fail_not_finite_rows_whose_sum_overflows():
    """The check sums each row first (one pass) and re-reads a row only when its sum is not finite. A
    chunk that read blocks a failed chunk computed in the same step (an in-flight hit) does not fail,
    finite or not, but its K/V is zeroed with theirs (its request is recomputed)."""
    from types import SimpleNamespace

    from engine.forward import StepForward

    cleared = []
    runner = SimpleNamespace(clear_slots=cleared.append)
    reads_from = [None, None, None, None, "r2", "r1", "r3"]
    scheduled = [
        SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}"), start_pos=10 * i, token_ids=[1, 2], reads_from=holder)
        for i, holder in enumerate(reads_from)
    ]
    logits = torch.zeros(7, 8)
    logits[1, :] = 3e38  # finite values whose float32 sum overflows
    logits[2, 3] = float("nan")
    logits[3, 0], logits[3, 1] = float("inf"), float("-inf")
    logits[6, 2] = float("nan")  # r6 read from r3, which failed: not failed itself, but zeroed
    chunks = [f"c{i}" for i in range(7)]
    failed = StepForward(runner, kv=None, verifier=None)._non_finite(scheduled, chunks, logits)
    assert failed == {
        "r2": "non-finite logits (NaN or inf) at position 21",
        "r3": "non-finite logits (NaN or inf) at position 31",
    }
    assert cleared == ["c2", "c3", "c4", "c6"]  # r4 and r6 read from failed chunks; r5 from r1, finite
