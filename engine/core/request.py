"""Requests: what an operator asked for, and what the engine did with it.

`Request` is the engine's mutable record. Every change of its fields is one of the transitions below,
each a method that makes all of that transition's changes, and each is made under the engine's lock
(engine/engine.py): by a step, or by a command between steps (submit, fork, release, abort, retire), so
no change ever lands inside a step. Commands come from the thread that calls the engine: in an engine
process (engine/engine_process.py) that is its one loop thread, which drains its inbox (an API client's
aborts included) before each step; a console that hosts an engine calls it from its own threads while
the engine's background thread steps. (The workload analyzer, analysis/timed.py, drives requests of its
own through the same scheduler on one thread, with no engine.)

    submitted ──admitted──> running ──finished──> finished | retained ──released──> released
        │  ^                  │  ^                   (retained: blocks kept as a fork base)
        │  └────preempted─────┘  └─ reserved, chunk_computed, append_token (every step)
        ├─ rejected                 (a fork child starts with `seeded_by_fork`, still waiting)
        └──────── stopped (waiting or running) ──> failed | aborted   (ended unfinished; blocks freed)

`RequestView` (engine/core/snapshot.py) is the immutable copy handed to other threads (console, storage, CLI).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.admission import check_sampling
from engine.core.chain_keys import ChainKeys
from engine.core.kv_groups import HitPlan, ReplayMode


class RequestStatus(enum.StrEnum):
    """Where a request is in the diagram above; the value is what the history stores."""

    WAITING = "waiting"  # queued, holds no blocks (or was preempted and gave them back)
    RUNNING = "running"  # holds blocks, is prefilling or decoding
    RETAINED = "retained"  # finished but kept as a fork base; holds its blocks until released
    FINISHED = "finished"  # done; its blocks were released
    RELEASED = "released"  # a retained request that an operator released
    REJECTED = "rejected"  # refused (too large for the pool, ...); never held blocks
    FAILED = "failed"  # stopped by an error of its own (non-finite logits); its blocks were freed
    ABORTED = "aborted"  # stopped unfinished: its engine shut down (a restart) or it was aborted; blocks freed

    @property
    def holds_blocks(self) -> bool:
        """Whether every request in this status holds KV blocks: running and retained ones, the only
        parents a fork may share from. (A waiting fork child holds its parent's shared blocks until its
        first step; no other waiting request holds any.)"""
        return self is RequestStatus.RUNNING or self is RequestStatus.RETAINED

    @property
    def is_final(self) -> bool:
        """Whether the request will never run again (everything but waiting and running). A retained
        request's record still changes once: when it is released."""
        return not (self is RequestStatus.WAITING or self is RequestStatus.RUNNING)


def can_release(status: RequestStatus, retain: bool) -> bool:
    """Whether an operator may release a request (`Engine.release`'s rule): a retained one frees its
    blocks at once; a waiting or running one that would be retained frees them when it finishes."""
    return status is RequestStatus.RETAINED or (
        retain and (status is RequestStatus.WAITING or status is RequestStatus.RUNNING)
    )


class HitSource(enum.StrEnum):
    NONE = "none"  # nothing reused; the whole context was computed
    PREFIX = "prefix"  # leading blocks came from the prefix index
    FORK = "fork"  # the block table was shared from a parent request


class PromptKeys(NamedTuple):
    """The keys of a finished request's prompt that the history keeps, for the workload analyzer.

    Both cover the prompt's full blocks, `num_prompt_tokens // block_size` keys of 16 bytes each,
    concatenated: `chain` as the engine keyed them (its namespace and the request's salt at the root),
    `content` chained from `engine.core.namespace.CONTENT_ROOT_KEY` instead, so the same tokens at the same
    positions have the same content keys under every model, dtype and salt.
    """

    chain: bytes  # the table's chain keys of the prompt's full blocks
    content: bytes  # the same blocks' namespace-free keys


class TokenLogprobs(NamedTuple):
    """One output token's log-probability and the most likely tokens at its position, as the model gave
    them (the raw distribution, before logit bias, penalties and temperature: vLLM's default)."""

    logprob: float  # of the token that was chosen
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; as many as asked for


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy (the argmax of the adjusted logits). Built
    only within the sampling bounds (engine/core/admission.py's `check_sampling`; AdmissionError otherwise).

    The logits are adjusted as vLLM does before a token is picked: `logit_bias` is added, then the
    penalties are subtracted, counted over the output generated so far (the prompt is not counted).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # per-request generator seed for temperature > 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from the logit of each token the output holds
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time the output holds it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), ids distinct
    logprobs: int | None = None  # None: none reported; k: each output token's logprob and the k likeliest

    def __post_init__(self) -> None:
        check_sampling(self)  # engine/core/admission.py: AdmissionError naming the field out of its bounds

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or a penalty changes the logits before a token is picked."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class Request:
    """The engine's record of one request. Changed only through its transition methods, under the engine's
    lock (see the module docstring)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]  # context before generation (a fork's inherited tokens included); fixed
    sampling: SamplingParams
    parent_id: str | None = None  # set for forks
    retain: bool = False  # keep blocks after finishing, as a fork base
    salt: str | None = None  # tenant salt folded into the cache namespace
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    cached_tokens: int = 0  # hit position: tokens reused at first schedule
    disk_cached_tokens: int = 0  # of which read from the disk tier (the rest were in the pool's memory)
    computed_tokens: int = 0  # prefill tokens actually run through the model
    hit_source: HitSource = HitSource.NONE
    cow_copies: int = 0  # copy-on-write copies its chunks made (shared partial tails written into)
    preemptions: int = 0
    finish_reason: str | None = None
    final_block_tables: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per KV group, as it finished
    prompt_keys: PromptKeys | None = None  # set when it finishes
    # Sliding-window hit accounting (see engine/core/kv_groups.py): the hit position h is `cached_tokens`.
    window_start: int = 0  # s: valid window-state range [s, e) found at admission
    window_end: int = 0  # e
    replay_from: int = 0  # r: computation started here; [r, h) was replayed
    replay_mode: ReplayMode = ReplayMode.NONE
    replayed_tokens: int = 0  # h - r
    replay_divergence: dict[str, float] | None = None  # set when an approximate replay was verified
    # False while the request's KV derives from an approximate replay: set at every admission from its hit
    # plan, inherited by a fork child from its parent. Such state is never offered to the prefix index,
    # so no later request can hit it.
    cacheable: bool = True
    prefilling: bool = True  # no token sampled since the last admission (fresh or after preemption)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Its context's chain keys, kept from one prefix lookup to the next (`lookup_keys`).
    _lookup_keys: ChainKeys | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)  # views share it instead of copying it

    # ------------------------------------------------------------------ reading
    @property
    def num_tokens(self) -> int:
        """Context length: prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Context tokens [start, end) (prompt, then output), copying only those: the scheduler reads a
        step's chunk through this, so a step costs what it computes, not the context length."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return list(self.prompt_token_ids[start:end])
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - num_prompt]]

    @property
    def all_token_ids(self) -> list[int]:
        """A copy of the whole context: for one-off uses (a hit lookup, a fork), never once per step."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def lookup_keys(self, root_key: bytes, block_size: int) -> ChainKeys:
        """The chain keys of its context's full blocks under `root_key` (its namespace and salt), made at
        its first prefix lookup and kept (vLLM keeps block hashes on its Request likewise): a request
        that waits to start hashes each block once. Its context only grows, so they never go stale."""
        keys = self._lookup_keys
        if keys is None or keys.root_key != root_key or keys.block_size != block_size:
            keys = self._lookup_keys = ChainKeys(root_key, block_size)
        return keys

    # ------------------------------------------------------------------ transitions
    def seeded_by_fork(self, shared_tokens: int, mode: ReplayMode) -> None:
        """A fork child (hit source FORK), still waiting, shares its parent's first `shared_tokens` tokens of KV."""
        self.num_computed_tokens = shared_tokens
        self.cached_tokens = shared_tokens
        self.replay_from = shared_tokens
        self.replay_mode = mode

    def fork_share_given_back(self) -> None:
        """A waiting fork child gave its parent's blocks back (so that others could start): it starts like
        a new request, from a lookup of its context in the prefix index. Counted as a preemption."""
        self.preemptions += 1
        self.num_computed_tokens = 0
        self.cached_tokens = 0
        self.disk_cached_tokens = 0
        self.replay_from = 0
        self.replay_mode = ReplayMode.NONE
        self.hit_source = HitSource.NONE

    def rejected(self, reason: str) -> None:
        self.status = RequestStatus.REJECTED
        self.finish_reason = reason

    def admitted(self, start: int, plan: HitPlan | None, now: float) -> None:
        """The request runs from position `start`; `plan` is its hit plan (None for a fork child's
        first admission, whose tables came from its parent).

        The hit accounting (cached tokens, hit source, window range, replay) is the first admission's;
        whether its state may be cached is decided afresh by every admission that planned a hit.
        """
        self.status = RequestStatus.RUNNING
        self.num_computed_tokens = start
        if plan is not None:
            self.cacheable = plan.mode is not ReplayMode.APPROXIMATE
        if self.first_scheduled_time is not None:
            return
        self.first_scheduled_time = now
        if plan is not None:
            self.cached_tokens = plan.h
            self.disk_cached_tokens = plan.tier_tokens
            self.hit_source = HitSource.PREFIX if plan.h else HitSource.NONE
            self.window_start, self.window_end = plan.s, plan.e
            self.replay_from, self.replay_mode = plan.r, plan.mode
            self.replayed_tokens = plan.replayed_tokens

    def tier_hit_lost(self) -> int:
        """Its disk-tier blocks failed their checksum and are computed instead: its hit ends where the pool's
        did. Returns the tokens it no longer counts as cached."""
        lost, self.disk_cached_tokens = self.disk_cached_tokens, 0
        self.cached_tokens -= lost
        return lost

    def reserved(self, num_copies: int) -> None:
        """Slots for its next chunk were reserved; `num_copies` shared partial tails were copied for it."""
        self.cow_copies += num_copies

    def chunk_computed(self, num_tokens: int) -> None:
        """The forward computed its scheduled chunk of `num_tokens` tokens."""
        self.num_computed_tokens += num_tokens
        if self.prefilling:
            self.computed_tokens += num_tokens

    def append_token(self, token: int, now: float, logprobs: TokenLogprobs | None = None) -> None:
        """A token was sampled for it (with its logprobs when the request asked for them)."""
        self.output_token_ids.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        self.prefilling = False
        if self.first_token_time is None:
            self.first_token_time = now

    def preempted(self) -> None:
        """It lost its blocks and waits to be recomputed from scratch."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.preemptions += 1
        self.prefilling = True

    def finished(
        self, reason: str, block_tables: dict[str, tuple[int, ...]], now: float, *, prompt_keys: PromptKeys
    ) -> None:
        """It stopped generating; `block_tables` are its tables at that moment, `prompt_keys` its prompt's."""
        self.prompt_keys = prompt_keys
        self._ended(RequestStatus.RETAINED if self.retain else RequestStatus.FINISHED, reason, block_tables, now)

    def stopped(self, status: RequestStatus, reason: str, block_tables: dict[str, tuple[int, ...]], now: float) -> None:
        """It ended unfinished, waiting or running: FAILED by an error of its own (non-finite logits) or
        ABORTED because its engine shut down. `block_tables` are the tables it held (empty if none; the
        scheduler frees them), and it records no prompt keys (nothing it computed is kept).

        Raises:
            ValueError: a status other than FAILED or ABORTED.
        """
        if status not in (RequestStatus.FAILED, RequestStatus.ABORTED):
            raise ValueError(f"a stopped request ends failed or aborted, not {status.value}")
        self._ended(status, reason, block_tables, now)

    def _ended(self, status: RequestStatus, reason: str, block_tables: dict[str, tuple[int, ...]], now: float) -> None:
        """The fields every end sets (`finished` and `stopped` both end through here)."""
        self.status = status
        self.finish_reason = reason
        self.finish_time = now
        self.final_block_tables = block_tables

    def release_when_finished(self) -> None:
        """An operator released it before it finished: it frees its blocks when it does."""
        self.retain = False

    def released(self) -> None:
        """An operator released it after it finished retained: its blocks are gone."""
        self.status = RequestStatus.RELEASED

    def replay_verified(self, divergence: dict[str, float]) -> None:
        """Its approximate replay was measured against a from-scratch forward."""
        self.replay_divergence = divergence
