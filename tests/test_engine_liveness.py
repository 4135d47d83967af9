"""Property test: the engine always finishes its work. Random submits, forks (of running and retained
requests), releases, cache resets and steps on a small pool, then every retained request is released:
from there `run_until_idle` must end, with every block free or evictable and the invariants intact.

The stalls this guards against: a waiting fork child holds its parent's blocks; with the parent gone,
a request ahead of the child that needs them, or two children of different parents that each need the
other's, waited for ever (engine/core/scheduler.py: children go ahead of a blocked head, and give their
shares back when nothing can run).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.config import EngineConfig
from engine.engine import Engine, RequestRejected
from engine.core.request import SamplingParams

STEMS = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 9, 9], [10, 11]]  # shared stems make prefix hits and forks common
tokens = st.lists(st.integers(3, 40), min_size=1, max_size=6)
sampling = st.builds(SamplingParams, max_new_tokens=st.integers(1, 5), ignore_eos=st.just(True))


def engine_machine(data_dir, attention_override: str | None):
    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            config = EngineConfig(model="tiny-llama", device="cpu", block_size=2, num_blocks=8, max_num_seqs=1,
                                  max_num_batched_tokens=8, data_dir=data_dir, attention_override=attention_override)  # fmt: skip
            self.engine = Engine(config)
            self.ids: list[str] = []

        @rule(stem=st.sampled_from(STEMS), tail=tokens, params=sampling, retain=st.booleans())
        def submit(self, stem, tail, params, retain):
            try:
                self.ids.append(self.engine.submit(stem + tail, params, retain=retain))
            except RequestRejected:
                pass

        @precondition(lambda self: self.ids)
        @rule(data=st.data(), suffixes=st.lists(tokens, min_size=1, max_size=2), params=sampling, retain=st.booleans())
        def fork(self, data, suffixes, params, retain):
            parent = data.draw(st.sampled_from(self.ids))
            try:
                self.ids += self.engine.fork_many(parent, suffixes, params, retain=retain)
            except ValueError:  # the parent holds no KV (waiting, finished, released)
                pass
            except RequestRejected:
                pass

        @precondition(lambda self: self.ids)
        @rule(data=st.data())
        def release(self, data):
            try:
                self.engine.release(data.draw(st.sampled_from(self.ids)))
            except ValueError:  # not retained
                pass

        @rule()
        def reset(self):
            self.engine.reset_cache()

        @rule(steps=st.integers(1, 4))
        def step(self, steps):
            for _ in range(steps):
                self.engine.step()

        @invariant()
        def invariants_hold(self):
            self.engine.check_invariants()

        def teardown(self):
            """An operator who releases every retained request as soon as it finishes sees all work end."""
            for _ in range(1_000):
                self.release_retained()
                if not self.engine.has_work():
                    break
                self.engine.step()
            else:
                raise AssertionError(f"the work never ended: {[v.status for v in self.engine.requests()]}")
            self.release_retained()
            self.engine.check_invariants()
            assert self.engine.stats().used_blocks == 0

        def release_retained(self) -> None:
            for view in self.engine.requests():
                if view.status == "retained":
                    self.engine.release(view.request_id)

    return EngineMachine


@pytest.mark.parametrize("attention_override", [None, "hybrid:4"])
def test_the_engine_always_finishes_its_work(tmp_path, attention_override):
    machine = engine_machine(tmp_path, attention_override)
    machine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    machine.TestCase().runTest()
