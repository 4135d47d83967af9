"""The "timed" mode: requests arrive at their timestamps and hold their blocks while they run.

Where the sequential mode serves one request at a time, here the engine's own scheduler, KV
coordinator, KV cache manager and block pool run the trace without the model, built as the engine
builds them (engine/core/assembly.py's `build_core`). Each step is the engine's three lines with the
forward replaced by a clock:

    out = scheduler.schedule()                          # continuous batching, chunked prefill, preemption
    clock += service.step_seconds(prefill, decode)      # what the forward would have taken
    scheduler.postprocess(out, {request: OUTPUT_TOKEN}) # computed blocks enter the cache, requests finish

So blocks of running requests cannot be evicted, a pool that is too small makes requests wait (and
preempts the newest running request when a running one cannot grow), and every hit is what the
engine's prefix lookup finds: full blocks only, at most `(prompt - 1) // block_size` of them (the last
token is always computed), under the engine's eviction policy.

Tokens. A trace has no tokens, only block ids; request r's prompt is built so that equal ids give equal
tokens at equal positions: full block `d` (a dense id) holds `[d] * block_size`, a hash-id trace's
partial last block of `t` tokens `[d] * t`, and an own workload's tail past its last full block (whose
tokens the trace does not keep) `TAIL_TOKEN`s. Generated tokens are `OUTPUT_TOKEN`. Chain keys are
then the engine's own, computed by its KV cache manager.

The service model (`ServiceModel`) charges a step `prefill / prefill_tokens_per_s + decode /
decode_tokens_per_s`; its defaults were measured on the engine (see `ServiceModel`). Arrival times are
the trace's; the clock is virtual (the engine's wall-clock stamps on requests are not used).

A request whose prompt and output cannot fit in the whole pool is rejected, by the engine's own rule
(engine/core/admission.py's `never_fits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from analysis.trace import MAX_REFERENCES, PartialBlocks, Trace
from engine.core.admission import never_fits
from engine.core.arith import ceil_div
from engine.core.assembly import build_core
from engine.core.config import MAX_NEW_TOKENS, EngineConfig
from engine.core.errors import require
from engine.core.events import EventLog
from engine.core.eviction import EvictionPolicy
from engine.core.kv_groups import FULL, KVGroupSpec
from engine.core.namespace import CacheNamespace
from engine.core.request import Request, RequestStatus, SamplingParams

OUTPUT_TOKEN = 2**32 - 1  # every generated token (no prompt block holds it: dense ids are far smaller)
TAIL_TOKEN = 2**32 - 2  # an own workload's prompt tokens past its last full block (unknown to the trace)
PROGRESS_EVERY_STEPS = 256  # steps between progress callbacks
# Operator-typed service rates, bounded so that every time derived from them is finite.
MIN_RATE_TOKENS_PER_S = 1e-3
MAX_RATE_TOKENS_PER_S = 1e12


@dataclass(frozen=True)
class ServiceModel:
    """How long the engine takes for a step, and how it batches (the engine's scheduler limits).

    The rate defaults were measured on this project's engine by benchmarks/service_rates.py, SmolLM2-135M-
    Instruct in fp32 on the shared 2-core CPU machine the project is developed on: the prefill of one
    1,024-token prompt, 139 tokens/s, and the generated tokens per second of 8 requests decoding together,
    16.8 (OMP_NUM_THREADS=1, load average about 10; with torch's two threads under that load, 53 and
    1.9). An idle machine is several times faster (tests' reference: a plain forward over 1,056 tokens in
    about 2.3 s). Set them to your hardware's numbers (`analyze --prefill-tokens-per-s ...`).
    """

    prefill_tokens_per_s: float = 139.0  # prompt tokens computed per second
    decode_tokens_per_s: float = 16.8  # generated tokens per second, summed over the batch
    max_num_batched_tokens: int = 2048  # the engine's per-step token budget (EngineConfig's default)
    max_num_seqs: int = 64  # most requests running at once (EngineConfig's default)

    def __post_init__(self) -> None:
        for rate in (self.prefill_tokens_per_s, self.decode_tokens_per_s):
            if not MIN_RATE_TOKENS_PER_S <= rate <= MAX_RATE_TOKENS_PER_S:  # also refuses NaN
                raise ValueError(
                    f"service rates must be in [{MIN_RATE_TOKENS_PER_S:g}, {MAX_RATE_TOKENS_PER_S:g}] tokens per "
                    f"second, got {rate:g}"
                )
        EngineConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs)  # bounds

    def step_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        """Seconds one step computing these tokens takes."""
        return prefill_tokens / self.prefill_tokens_per_s + decode_tokens / self.decode_tokens_per_s


@dataclass(frozen=True, eq=False)
class TimedRun:
    """What the engine's scheduler and pool did with a trace at one pool size."""

    capacity_blocks: int  # the pool's size in blocks
    hit_blocks: np.ndarray  # int64 per request: the blocks its first admission hit (0 if rejected)
    queueing_s: np.ndarray  # float64 per request: first scheduled - arrival (NaN if rejected)
    rejected: np.ndarray  # bool per request: too large for the whole pool (never ran)
    peak_blocks_in_use: int  # most blocks referenced by running requests at once
    preemptions: int  # running requests that lost their blocks to let another grow
    steps: int  # scheduler steps
    makespan_s: float  # virtual time when the last request finished

    def queueing_percentiles(self, percentiles: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
        """Queueing delay percentiles over the requests that ran, and the maximum, in seconds."""
        ran = self.queueing_s[~self.rejected]
        if not len(ran):
            return {f"p{p:g}": 0.0 for p in percentiles} | {"max": 0.0}
        values = np.percentile(ran, percentiles)
        return {f"p{p:g}": float(v) for p, v in zip(percentiles, values)} | {"max": float(ran.max())}


class VirtualClock:
    """The timed mode's time: seconds since the trace's start, advanced by the service model, read by the
    pool's stamps (it is the event log's clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def namespace_for(block_size: int) -> CacheNamespace:
    """The namespace of the model-free engine (one for every timed run: no hit crosses runs)."""
    return CacheNamespace("timed-analysis", "none", "none", block_size, ("full",))


def prompt_tokens(trace: Trace, request: int) -> list[int]:
    """Request `request`'s synthetic prompt (see the module docstring)."""
    size = trace.block_size
    blocks = trace.dense.ids[trace.block_starts[request] : trace.block_starts[request + 1]]
    length = int(trace.input_lengths[request])
    full = length // size
    tokens = np.repeat(blocks[:full], size).tolist()
    tail = length - full * size
    if tail:
        last = int(blocks[-1]) if trace.partial_blocks is PartialBlocks.CACHED else TAIL_TOKEN
        tokens += [last] * tail
    return tokens


def run_timed(
    trace: Trace,
    capacity_blocks: int,
    policy: EvictionPolicy,
    service: ServiceModel = ServiceModel(),
    on_requests: Callable[[int], None] | None = None,
) -> TimedRun:
    """Serve `trace` through the engine's scheduler over a pool of `capacity_blocks` blocks.

    Args:
        trace: the requests, with their arrival times.
        capacity_blocks: the pool's size (>= 1).
        policy: a fresh engine eviction policy for the pool.
        service: step times and batching limits.
        on_requests: called with the number of requests finished (or rejected) so far, now and then.

    Raises:
        ValueError: a capacity below 1, or a pool of more than `MAX_REFERENCES` blocks to build.
    """
    if capacity_blocks < 1:
        raise ValueError(f"a block pool holds at least 1 block, got {capacity_blocks}")
    # A pool that can hold every request's whole context at once never evicts, preempts or keeps a
    # request waiting for blocks, so every larger pool serves the same: the pool is built no larger.
    outputs = np.clip(trace.output_lengths, 1, MAX_NEW_TOKENS)
    contexts = ceil_div(trace.input_lengths + outputs, trace.block_size)  # elementwise
    pool_blocks = min(capacity_blocks, int(contexts.sum()))
    if pool_blocks > MAX_REFERENCES:
        raise ValueError(f"the timed mode builds pools of at most {MAX_REFERENCES:,} blocks, {pool_blocks:,} asked for")
    return _ModelFreeServer(trace, pool_blocks, policy, service).serve(capacity_blocks, on_requests)


class _ModelFreeServer:
    """The engine's scheduler, KV coordinator, KV cache manager and pool over one trace, with a clock for
    a model. Per request (by its index in the trace) it records the hit, queueing delay and rejection."""

    def __init__(self, trace: Trace, capacity_blocks: int, policy: EvictionPolicy, service: ServiceModel) -> None:
        self.trace = trace
        self.service = service
        self.capacity_blocks = capacity_blocks
        self.clock = VirtualClock()
        log = EventLog(clock=self.clock, recording=False)
        config = EngineConfig(max_num_batched_tokens=service.max_num_batched_tokens, max_num_seqs=service.max_num_seqs)
        groups = (KVGroupSpec(FULL, None, (0,)),)
        core = build_core(config, groups, namespace_for(trace.block_size), log, capacity_blocks, eviction=policy)
        self.pool = core.kv.managers[0].pool
        self.scheduler = core.scheduler
        count = len(trace)
        self.arrivals = trace.arrival_s.tolist()
        self.outputs = np.clip(trace.output_lengths, 1, MAX_NEW_TOKENS).tolist()
        self.hits = np.zeros(count, dtype=np.int64)  # blocks hit at the first admission
        self.queueing = np.full(count, np.nan)  # first scheduled - arrival
        self.rejected = np.zeros(count, dtype=bool)  # too large for the whole pool
        self.arrived = 0  # requests handed to the scheduler (or rejected) so far, in arrival order
        self.done = 0  # requests finished or rejected
        self.peak = 0  # most blocks referenced at once
        self._started: set[int] = set()  # requests admitted at least once

    def serve(self, capacity_blocks: int, on_requests: Callable[[int], None] | None) -> TimedRun:
        """Run the whole trace; the result names `capacity_blocks` as the pool's size."""
        steps = 0
        while self.done < len(self.trace):
            self.admit_arrivals()
            if self.scheduler.has_work:
                self.step()
                steps += 1
                if on_requests is not None and steps % PROGRESS_EVERY_STEPS == 0:
                    on_requests(self.done)
            else:
                self.wait_for_next_arrival()
        if on_requests is not None:
            on_requests(len(self.trace))
        return TimedRun(
            capacity_blocks=capacity_blocks,
            hit_blocks=self.hits,
            queueing_s=self.queueing,
            rejected=self.rejected,
            peak_blocks_in_use=self.peak,
            preemptions=self.scheduler.num_preemptions,
            steps=steps,
            makespan_s=self.clock.now,
        )

    def admit_arrivals(self) -> None:
        """Hand the scheduler every request that has arrived by now; reject those that can never fit."""
        size = self.trace.block_size
        while self.arrived < len(self.trace) and self.arrivals[self.arrived] <= self.clock.now:
            index, output = self.arrived, self.outputs[self.arrived]
            request = Request(str(index), tuple(prompt_tokens(self.trace, index)), SamplingParams(output))
            if never_fits(request.num_prompt_tokens, output, size, self.capacity_blocks) is not None:
                self.rejected[index] = True  # as the engine rejects it: it could never fit in the pool
                self.done += 1
            else:
                self.scheduler.add(request)
            self.arrived += 1

    def wait_for_next_arrival(self) -> None:
        if self.arrived < len(self.trace):
            self.clock.now = max(self.clock.now, self.arrivals[self.arrived])

    def step(self) -> None:
        """One engine step without the model: schedule, charge the step's time, postprocess."""
        out = self.scheduler.schedule()
        prefill = decode = 0
        for chunk in out.chunks:
            request = chunk.request
            index = int(request.request_id)
            if index not in self._started:
                self._started.add(index)
                self.queueing[index] = self.clock.now - self.arrivals[index]
                self.hits[index] = request.cached_tokens // self.trace.block_size
            if request.prefilling:
                prefill += len(chunk.token_ids)
            else:
                decode += len(chunk.token_ids)
        self.peak = max(self.peak, self.capacity_blocks - self.pool.num_allocatable)
        if out.chunks:
            self.clock.now += self.service.step_seconds(prefill, decode)
        else:  # the waiting head cannot start while it waits on another request: only an arrival helps
            require(self.arrived < len(self.trace) or bool(self.scheduler.running), "the scheduler is stuck")
            self.wait_for_next_arrival()
        sampled = {chunk.request.request_id: OUTPUT_TOKEN for chunk in out.chunks if chunk.reaches_end}
        for request in self.scheduler.postprocess(out, sampled):
            if request.status is RequestStatus.FINISHED:
                self.done += 1
