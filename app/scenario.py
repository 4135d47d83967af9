"""The guided scenario "Sharing and copy-on-write": issue 15's exercise, played on the shared engine.

    Two requests share one full block and one half-full block, then append different tokens. Draw
    reference counts and copy-on-write, marking when the old block can safely be released.

`SharingScenario` runs it as four actions, each ending with the history written (so the Blocks page's
timeline, read from storage, shows it) and one or more sentences saying what just happened:

    1. a retained parent computes one full block F and one half-full block T     F: 1, T: 1
    2. two forks share its table, then each writes its first token into T        F: 3; T: 3 -> 2 -> 1
       (copy-on-write: each child gets its own copy of T)
    3. the parent is released                                                    F: 2; T: 0, safe to reuse
    4. the children are released                                                 F: 0, evictable (cached)

It never disturbs other operators: its request ids are new (`cow-<tag>-...`), its prompt hangs from a
cache namespace of its own (a salt), so it neither hits nor is hit by anyone's blocks, nothing is
reset, and every request it made is released when it ends, also when it fails.

No Streamlit here: the page calls `run` with a callback that redraws after each action.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.request import RequestStatus, SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine

TIMEOUT_S = 120.0  # longest wait for one action's requests to finish
NEEDED_BLOCKS = 4  # F, T and the two copies


class ScenarioError(RuntimeError):
    """The scenario cannot run here or did not finish (its requests were released)."""


@dataclass(frozen=True)
class Step:
    """One sentence of the walk-through, and the action it belongs to (1-4)."""

    action: int
    text: str


@dataclass
class ScenarioRun:
    """What one run of the scenario made: ids, the blocks the exercise is about, its sentences so far."""

    tag: str  # unique per run: names its requests and its cache namespace
    parent: str
    children: tuple[str, str]
    full_block: int | None = None  # F (in the engine's first KV group, the full one when it has one)
    tail_block: int | None = None  # T, the parent's half-full tail
    copies: tuple[int, ...] = ()  # the children's copies of T, child A's first
    steps: list[Step] = field(default_factory=list)
    done: bool = False

    @property
    def request_ids(self) -> list[str]:
        return [self.parent, *self.children]

    @property
    def blocks(self) -> list[int]:
        """The exercise's blocks in the order the page stacks them: F, T, then the copies."""
        return [b for b in (self.full_block, self.tail_block, *self.copies) if b is not None]


class SharingScenario:
    """Drives the exercise on `engine` (see the module docstring).

    Args:
        engine: the shared engine (its background thread steps the requests).
        flush: makes the history catch up with the engine (the page passes the writer's flush); returns
            False when it could not.
        wait_s: pause after each action, so a viewer sees the timeline fill in (0 in tests).
    """

    def __init__(self, engine: Engine, flush: Callable[[], bool], wait_s: float = 0.0) -> None:
        self.engine = engine
        self.flush = flush
        self.wait_s = wait_s

    def check(self) -> None:
        """Raise ScenarioError when the exercise cannot be played on this engine now."""
        bs = self.engine.config.block_size
        if bs < 2:
            raise ScenarioError("a half-full block needs a block size of at least 2")
        stats = self.engine.stats()
        for group in stats.groups:
            if group.free_blocks + group.evictable_blocks < NEEDED_BLOCKS:
                raise ScenarioError(
                    f"the {group.name} pool has {group.free_blocks + group.evictable_blocks} blocks to hand out; "
                    f"the scenario needs {NEEDED_BLOCKS}"
                )

    def run(self, on_action: Callable[[ScenarioRun], None] = lambda run: None) -> ScenarioRun:
        """Play the four actions, calling `on_action` after each; release everything it made at the end.

        Raises:
            ScenarioError: it cannot run here, or an action did not finish in time.
        """
        self.check()
        tag = secrets.token_hex(3)
        run = ScenarioRun(tag, f"cow-{tag}-parent", (f"cow-{tag}-child-a", f"cow-{tag}-child-b"))
        try:
            for action in (self._parent, self._forks, self._release_parent, self._release_children):
                action(run)
                if not self.flush():
                    raise ScenarioError("the history writer did not catch up; the timeline may be incomplete")
                on_action(run)
                time.sleep(self.wait_s)
            run.done = True
            return run
        finally:
            self._release_all(run)

    # ------------------------------------------------------------------ the four actions
    def _parent(self, run: ScenarioRun) -> None:
        engine, bs = self.engine, self.engine.config.block_size
        rng = random.Random(run.tag)
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(bs + bs // 2)]
        # One new token: its KV is never computed, so the table holds the prompt alone, 1.5 blocks.
        params = SamplingParams(max_new_tokens=1, ignore_eos=True)
        engine.submit(prompt, params, request_id=run.parent, retain=True, salt=f"scenario-{run.tag}")
        self._wait(run.parent, RequestStatus.RETAINED)
        table = engine.get(run.parent).block_table
        run.full_block, run.tail_block = table[0], table[1]
        run.steps.append(
            Step(
                1,
                f"The parent computed {len(prompt)} tokens: block {table[0]} is full ({bs} tokens) and block "
                f"{table[1]} holds {bs // 2} of {bs}. Each has one holder, the parent: reference count 1.",
            )
        )

    def _forks(self, run: ScenarioRun) -> None:
        engine = self.engine
        rng = random.Random(f"{run.tag}-suffixes")
        suffixes = [[rng.randrange(3, engine.vocab_size)], [rng.randrange(3, engine.vocab_size)]]
        engine.fork_many(run.parent, suffixes, SamplingParams(max_new_tokens=2, ignore_eos=True),
                         request_ids=list(run.children), retain=True)  # fmt: skip
        for child in run.children:
            self._wait(child, RequestStatus.RETAINED)
        run.copies = tuple(engine.get(child).block_table[1] for child in run.children)
        a, b = run.children
        full, tail = run.full_block, run.tail_block
        run.steps += [
            Step(2, f"Two forks share the parent's whole table: blocks {full} and {tail} go to reference count 3 "
                    f"(parent, {a}, {b}). Nothing is copied: sharing is a reference, not a copy."),
            Step(2, f"{a} writes its first token into block {tail}, which others still hold, so it gets a copy first "
                    f"(copy-on-write): block {run.copies[0]} holds the {self.engine.config.block_size // 2} shared "
                    f"tokens and then its own; block {tail} drops to 2."),
            Step(2, f"{b} copies too (block {run.copies[1]}), and block {tail} drops to 1. Why copy when the finished "
                    "parent will never write again? It still holds the block and may be forked again, and a block "
                    "that several tables share may only be appended to in place by one holder: so every writer "
                    "copies while others hold it."),
        ]  # fmt: skip

    def _release_parent(self, run: ScenarioRun) -> None:
        self.engine.release(run.parent)
        run.steps.append(
            Step(3, f"The parent is released. Block {run.tail_block} reaches 0: no holder left: safe to reuse (it "
                    f"was never full, so it was never cached and goes back to the free blocks). Block "
                    f"{run.full_block} stays at 2: both children still hold it.")
        )  # fmt: skip

    def _release_children(self, run: ScenarioRun) -> None:
        for child in run.children:
            self.engine.release(child)
        run.steps.append(
            Step(4, f"The children are released. Block {run.full_block} reaches 0 but is in the prefix index: "
                    f"evictable from here on (a later request with the same prefix would hit it). Their copies "
                    f"{run.copies[0]} and {run.copies[1]} reach 0: safe to reuse. The engine is as the scenario "
                    "found it.")
        )  # fmt: skip

    # ------------------------------------------------------------------ helpers
    def _wait(self, request_id: str, status: RequestStatus) -> None:
        """Until the request is in `status`; a final status other than it (or a dead engine) raises."""
        deadline = time.monotonic() + TIMEOUT_S
        while (view := self.engine.get(request_id)).status != status:
            if view.is_final or self.engine.failure is not None:
                raise ScenarioError(f"{request_id} ended {view.status} ({view.finish_reason or 'engine stopped'})")
            if time.monotonic() > deadline:
                raise ScenarioError(f"{request_id} did not finish within {TIMEOUT_S:.0f} s (the engine is busy)")
            time.sleep(0.02)

    def _release_all(self, run: ScenarioRun) -> None:
        """Release whatever of the scenario still holds blocks (after a failure, or a release that raced)."""
        for rid in run.request_ids:
            try:
                view = self.engine.get(rid)
            except KeyError:
                continue
            if view.releasable:
                self.engine.release(rid)
