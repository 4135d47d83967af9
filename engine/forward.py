"""One step's forward: a schedule in, the sampled tokens and the failed requests out.

Runs the disk tier's stores and loads and the copy-on-write copies the schedule asks for, one forward of
the model over every scheduled chunk, the check for non-finite logits, and sampling (engine/engine.py's
`step` calls it between the scheduler's `schedule` and `postprocess`). It changes no bookkeeping: the
scheduler accounts for what it returns (a load whose checksum failed included: its request is neither
sampled nor failed, and goes back to the queue to compute that block).
"""

from __future__ import annotations

import logging
from typing import Collection, NamedTuple

import torch

from engine.core.kv_coordinator import KVCoordinator
from engine.core.kv_tier import TierLoad
from engine.core.request import Request, TokenLogprobs
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.runner.kv_tier_io import DiskTier
from engine.runner.model_runner import GroupSlots, ModelRunner, SeqChunk
from engine.runner.sampler import sample, token_logprobs
from engine.runner.verify import ReplayVerifier

logger = logging.getLogger(__name__)


class StepOutcome(NamedTuple):
    """What one forward produced, for `Scheduler.postprocess`."""

    sampled: dict[str, int]  # the token of each request whose chunk reached its context's end
    logprobs: dict[str, TokenLogprobs]  # that token's logprobs, for those whose sampling asks for them
    failed: dict[str, str]  # why each request whose chunk came out non-finite fails
    failed_loads: list[TierLoad]  # disk-tier loads whose bytes failed their checksum


class StepForward:
    """The model's half of a step, over the engine's runner and its KV groups' tables."""

    def __init__(
        self, runner: ModelRunner, kv: KVCoordinator, verifier: ReplayVerifier | None, tier: DiskTier | None = None
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.verifier = verifier  # keeps the logits of approximate replays, when asked for
        self.tier = tier  # the disk tier's byte copies; None without a second tier

    def run(self, out: SchedulerOutput, generators: dict[str, torch.Generator]) -> StepOutcome:
        """The disk tier's stores and loads, copy-on-write copies, then one forward over every chunk.

        Stores go first: they copy out blocks the pool evicted while scheduling, which the loads, the
        copies and the forward may rewrite. A chunk whose request's load failed (or that reads from such a
        request's blocks) is computed with the rest but neither sampled nor failed; its K/V is zeroed.

        Args:
            out: the step's schedule.
            generators: the seeded generator of each request that samples with one.
        """
        failed_loads = self.tier.execute(out.tier) if self.tier is not None else []
        if any(out.copies):
            self.runner.copy_blocks(out.copies)
        if not out.chunks:
            return StepOutcome({}, {}, {}, failed_loads)
        reload = {load.request_id for load in failed_loads}
        chunks = [self._runner_chunk(chunk) for chunk in out.chunks]
        logits = self.runner.execute(chunks)
        failed = self._non_finite(out.chunks, chunks, logits, reload)
        ends = [
            i
            for i, c in enumerate(out.chunks)
            if c.reaches_end
            and c.request.request_id not in failed
            and c.reads_from not in failed
            and c.request.request_id not in reload
            and c.reads_from not in reload
        ]
        if not ends:
            return StepOutcome({}, {}, failed, failed_loads)
        requests = [out.chunks[i].request for i in ends]
        end_logits = logits if len(ends) == len(out.chunks) else logits[ends]  # all of them: no copy
        if self.verifier is not None:
            self.verifier.capture(requests, end_logits)
        seeded = [generators.get(r.request_id) for r in requests]
        tokens = sample(end_logits, [r.sampling for r in requests], seeded, [r.output_token_ids for r in requests])
        sampled = {r.request_id: t for r, t in zip(requests, tokens)}
        return StepOutcome(sampled, _logprobs(requests, end_logits, tokens), failed, failed_loads)

    def write_back(self) -> None:
        """Store every block cached in the pool into the disk tier and wait for the writer (an engine
        stopping); nothing without a tier or with a closed one."""
        if self.tier is not None and not self.tier.closed:
            self.tier.write_back(self.kv.write_back_tier())

    def close_tier(self) -> None:
        """Close the disk tier's files and give up its lock (an engine retired); nothing without a tier."""
        if self.tier is not None:
            self.tier.close()

    def _non_finite(
        self,
        scheduled: list[ScheduledChunk],
        chunks: list[SeqChunk],
        logits: torch.Tensor,
        reload: Collection[str] = (),
    ) -> dict[str, str]:
        """Why each request whose chunk's last-position logits hold a NaN or an infinity fails.

        Every chunk's last row is checked, prefill chunks too: causal attention carries a non-finite K/V
        to every later position, so the chunk that first computes one is caught before its blocks enter
        the prefix index. Each such chunk's K/V is zeroed at once (`ModelRunner.clear_slots`), so what
        its request computed never reaches another request through a reused block. A chunk that read
        blocks a failed chunk computed in the same step (an in-flight hit) neither fails nor is sampled,
        finite or not: its K/V is zeroed too and its request goes back to the queue, to be recomputed on
        its own (`Scheduler.postprocess`). Its result is not its own: a NaN reaches even the failed
        chunk's positions before it (a causal mask weighs later keys zero, and 0 x NaN is NaN), so the
        shared blocks may hold NaN that this request, computed alone, would never see.

        A NaN or an infinity makes its row's sum NaN or infinite, so one sum per row finds every candidate
        (64 rows of a 49,152 vocabulary: 0.1 ms, against 5 ms for `isfinite(logits).all(dim=-1)`); a row
        whose sum is not finite is then checked value by value, so finite logits whose sum overflows do
        not fail.

        `reload`: requests whose disk-tier load failed: their chunks (and those reading from them) are
        zeroed and neither sampled nor failed, finite or not.
        """
        failed = {}
        finite_rows = torch.isfinite(logits.sum(dim=-1)).tolist()
        for row in (i for i, finite in enumerate(finite_rows) if not finite):
            finite_rows[row] = bool(torch.isfinite(logits[row]).all())
        for chunk, runner_chunk, finite in zip(scheduled, chunks, finite_rows):
            if chunk.request.request_id in reload or chunk.reads_from in reload:  # read a torn tier block
                self.runner.clear_slots(runner_chunk)
            elif chunk.reads_from in failed:  # a holder's chunk comes before the chunks that read from it
                self.runner.clear_slots(runner_chunk)  # recomputed on its own later, whatever its logits
            elif not finite:
                self.runner.clear_slots(runner_chunk)
                position = chunk.start_pos + len(chunk.token_ids) - 1
                reason = f"non-finite logits (NaN or inf) at position {position}"
                logger.warning("request %s failed: %s", chunk.request.request_id, reason)
                failed[chunk.request.request_id] = reason
        return failed

    def _runner_chunk(self, chunk: ScheduledChunk) -> SeqChunk:
        """The runner's input for one chunk: per group, the request's table and where the chunk writes."""
        tables = self.kv.group_tables(chunk.request.request_id)
        groups = tuple(GroupSlots(t.block_ids, t.first_block, w) for t, w in zip(tables, chunk.write_from))
        return SeqChunk(chunk.token_ids, chunk.start_pos, groups)


def _logprobs(requests: list[Request], logits: torch.Tensor, tokens: list[int]) -> dict[str, TokenLogprobs]:
    """The logprobs of the sampled tokens of the requests that ask for them (none computed otherwise)."""
    wanted = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    if not wanted:
        return {}
    rows = logits if len(wanted) == len(requests) else logits[wanted]
    counts = [requests[i].sampling.logprobs or 0 for i in wanted]
    found = token_logprobs(rows, [tokens[i] for i in wanted], counts)
    return {requests[i].request_id: lp for i, lp in zip(wanted, found)}
