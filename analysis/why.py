"""Why a request's prompt tokens were not served from the prefix cache: one cause per request.

Pure computation over history rows (storage/read/why.py reads them; cli/why.py and the console's panel
show the result). The cause is the first that applies at the first prompt token not served from the
cache, `position` (= the request's cached tokens):

    fork       a fork child: it shares its parent's block table (its partial tail too), so everything
               the parent held was served; `match` names the parent.
    hit        everything reusable was served: the cache served every full block before the last prompt
               token (the engine always computes that token, for its logits; a partial tail is never
               cached), so nothing is missed. A request that waited for another one computing the same
               prefix (the scheduler's rule) is a hit; `wait` says how long and for whom.
    evicted    an earlier request of the same namespace held the block at `position` (its chain was
               cached) and the block was evicted before this request looked it up; `eviction` is the
               latest such eviction from the history (time, reason, block).
    both_tiers evicted as above, and then evicted from the disk tier too (or dropped by it) before the
               lookup: a miss a larger tier would have saved; `tier` says when and why (analysis/why_tiers.py).
    window     sliding-window state was not ready: the chain was there but the window's blocks were not
               (evicted with reason "window", or the request replayed from its boundary `r`).
    namespace  the same tokens through `position`'s block were cached under another namespace (another
               tenant salt, model, weights, dtype or attention spec): no key could match.
    extended   this prompt continues an earlier request's whole cached context (a chat's next turn
               holds the previous turn's prompt and reply): every token that request computed was
               shared, and nothing earlier went further, so the tokens after P were never computed.
    diverged   an earlier request shared the first P tokens and then differed: `divergence` gives P and
               the decoded text after it on both sides; `same_text` says the ids differ but decode to
               the same text (the tokenization or the template changed, not the text), and a template
               on one side only (its special tokens anywhere in one prompt, none in the other) is called
               out. A request whose visible words an earlier one holds under another template (chat and
               plain text) diverges at P = 0.
    new        no earlier request shared even the first block.

What an earlier request left in the cache is its context: its prompt and its output but the last token
(sampled after the last forward, so its KV is never computed). A later prompt is compared with that
whole context, so a conversation's next turn matches the reply the engine generated.

The counts add up: cached_tokens + missed_tokens + never_served_tokens == prompt_tokens, where
never_served_tokens are the last prompt token and the partial block before it (always computed, never
looked up; a fork child, which shares its parent's partial tail, has only the tokens after its parent's).

The workload analyzer (analysis/breakdown.py) splits misses by reason over a trace; where a cause means
the same as one of its reasons it has that reason's name in `ANALYZER_REASONS`: "namespace" is the same
word; "evicted" is its "capacity"; "new", "extended" and "diverged" are its "compulsory" (no cache of any
size holds the tokens).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from analysis.why_decoder import Decoder
from analysis.why_tiers import TierLookups, served_from_disk, still_on_disk_note, tier_after_eviction
from engine.core.arith import common_prefix

WINDOW_BEFORE = 16  # tokens of shared context shown before a divergence
WINDOW_AFTER = 16  # tokens shown after it, on each side (a date of ten digits fits)
MIN_SHARED_WORDS = 16  # characters of visible text two prompts must share to count as the same words
MAX_WORD_CANDIDATES = 500  # the newest earlier requests decoded to look for the same words (a decode each)
WAIT_EPSILON_S = 1e-3  # a shorter wait between arrival and first schedule is not reported


class Cause(enum.StrEnum):
    HIT = "hit"
    FORK = "fork"
    NEW = "new"
    EXTENDED = "extended"
    DIVERGED = "diverged"
    EVICTED = "evicted"
    BOTH_TIERS = "both_tiers"
    NAMESPACE = "namespace"
    WINDOW = "window"


ANALYZER_REASONS = {Cause.NEW: "compulsory", Cause.DIVERGED: "compulsory", Cause.EXTENDED: "compulsory",
                    Cause.EVICTED: "capacity", Cause.BOTH_TIERS: "capacity", Cause.NAMESPACE: "namespace"}  # fmt: skip
FORK_SOURCE = "fork"  # HitSource.FORK's value: the request's table was shared from its parent


class WhyError(ValueError):
    """The history cannot explain this request (its prompt was not recorded)."""


class HistoryRequest(Protocol):
    """One request as the history holds it (storage/read/why.py's `WhyRequest` has these fields)."""

    run_id: str
    request_id: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    prompt_token_ids: tuple[int, ...] | None  # from its SUBMIT event; None when not recorded
    output_token_ids: tuple[int, ...]  # what it generated (so far, for one still running)
    parent_id: str | None  # a fork child's parent
    salt: str | None
    cached_tokens: int
    disk_cached_tokens: int  # of cached_tokens, those promoted from the disk tier
    prompt_tokens: int
    hit_source: str  # HitSource value: "fork" for a fork child
    block_keys: bytes | None  # chain keys of its prompt's full blocks, 16 bytes each, once finished
    replay_mode: str | None
    r: int | None  # replay boundary (sliding windows)
    namespace: str | None  # its run's namespace root (hex)
    block_size: int
    model: str
    dtype: str
    weights_revision: str | None


class EvictionFact(Protocol):
    """One eviction from the history (storage/read/why.py's `WhyEviction` has these fields)."""

    at: float  # epoch seconds
    reason: str  # EvictReason value: lru, reset, parent_evicted, window
    block: int | None  # the physical block
    key_hex: str
    group: str | None


@dataclass(frozen=True)
class Diagnosis:
    """The answer for one request (`as_json` is `python -m cli why --json`'s object)."""

    request_id: str
    run_id: str
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int  # what an unbounded cache would have served (the best earlier same-namespace match)
    cause: Cause
    position: int  # first prompt token not served from the cache
    missed_tokens: int  # cacheable tokens not served: (prompt_tokens - 1) // block_size * block_size - cached
    never_served_tokens: int  # the last prompt token and the partial block before it: prompt - cached - missed
    match: dict[str, Any] | None = None  # request_id, run_id, shared_tokens (the parent, for a fork)
    divergence: dict[str, Any] | None = None  # position, before, ours, theirs, same_text, template_tokens
    eviction: dict[str, Any] | None = None  # at, reason, block, key
    namespace: dict[str, Any] | None = None  # what differs: {"salt": [ours, theirs], "model": [...], ...}
    wait: dict[str, Any] | None = None  # seconds, request_id (the request it waited for)
    window: dict[str, Any] | None = None  # replay boundary r
    disk: dict[str, Any] | None = None  # tokens served from disk (analysis/why_tiers.py's served_from_disk)
    tier: dict[str, Any] | None = None  # the missed block in the disk tier (why_tiers.tier_after_eviction)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "run_id": self.run_id, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "reusable_tokens": self.reusable_tokens, "cause": self.cause.value,
            "analyzer_reason": ANALYZER_REASONS.get(self.cause), "position": self.position,
            "missed_tokens": self.missed_tokens, "never_served_tokens": self.never_served_tokens, "match": self.match, "divergence": self.divergence,
            "eviction": self.eviction, "namespace": self.namespace, "wait": self.wait, "window": self.window,
            "disk": self.disk, "tier": self.tier, "notes": list(self.notes),
        }  # fmt: skip


EvictionLookup = Callable[[str, str, float], EvictionFact | None]  # (run_id, key hex, before) -> latest eviction


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    return common_prefix(tuple(a), tuple(b))


def cached_context(request: HistoryRequest) -> tuple[int, ...]:
    """The tokens whose KV the request computed: its prompt, then its output but the last token."""
    return tuple(request.prompt_token_ids or ()) + tuple(request.output_token_ids[:-1])


def shared_context(ours: tuple[int, ...], earlier: HistoryRequest) -> int:
    """How many leading tokens of `ours` an earlier request's cached context holds."""
    prompt = earlier.prompt_token_ids or ()
    shared = common_prefix(ours, prompt)
    if shared < len(prompt) or len(earlier.output_token_ids) < 2:
        return shared
    return shared + common_prefix(ours[shared:], tuple(earlier.output_token_ids[:-1]))


def diagnose(request: HistoryRequest, earlier: Iterable[HistoryRequest], evictions: EvictionLookup,
             decoder: Decoder, tiers: TierLookups | None = None) -> Diagnosis:  # fmt: skip
    """One request's cause (see the module docstring).

    Args:
        request: the request to explain.
        earlier: requests that arrived before it, in any run (other runs are other namespaces, or the same).
        evictions: the latest eviction of a chain key in a run before a time.
        decoder: for the divergence windows.
        tiers: the disk tier's history (None: explained as without a tier).

    Raises:
        WhyError: the request's prompt tokens are not in the history.
    """
    if request.prompt_token_ids is None:
        raise WhyError(f"the prompt of {request.request_id!r} is not in the history (recorded before prompts were)")
    ours = tuple(request.prompt_token_ids)
    bs = request.block_size
    cap = _lookup_cap(request)
    cached = min(request.cached_tokens, request.prompt_tokens)
    position = cached
    same, other = [], []
    for candidate in earlier:
        if candidate.prompt_token_ids is None or candidate.request_id == request.request_id and (
            candidate.run_id == request.run_id
        ):
            continue
        shared = shared_context(ours, candidate)
        (same if _same_namespace(request, candidate) else other).append((shared, candidate))
    best_shared, best = max(same, key=lambda pair: (pair[0], pair[1].arrival_time), default=(0, None))
    reusable = max(min(cap, best_shared // bs * bs), cached)
    base = dict(request_id=request.request_id, run_id=request.run_id, prompt_tokens=request.prompt_tokens,
                cached_tokens=cached, reusable_tokens=reusable, position=position,
                missed_tokens=_missed(request), never_served_tokens=_never_served(request),
                disk=served_from_disk(request, tiers))  # fmt: skip
    if request.hit_source == FORK_SOURCE and request.parent_id is not None:
        parent = {"request_id": request.parent_id, "run_id": request.run_id, "shared_tokens": cached}
        return Diagnosis(cause=Cause.FORK, match=parent, **base)
    if cached >= cap:
        return Diagnosis(cause=Cause.HIT, wait=_wait(request, same, bs), **base)
    next_end = position + bs
    holders = [(shared, c) for shared, c in same if shared >= next_end]
    if holders:
        shared, holder = max(holders, key=lambda pair: pair[1].arrival_time)  # the latest to have computed it
        return _evicted(request, holder, shared, (evictions, tiers), base)
    strangers = [(shared, c) for shared, c in other if shared >= next_end and c.block_size == bs]
    if strangers:
        shared, stranger = max(strangers, key=lambda pair: (pair[0], pair[1].arrival_time))
        return Diagnosis(cause=Cause.NAMESPACE, match=_match(stranger, shared),
                         namespace=_namespace_difference(request, stranger), **base)  # fmt: skip
    if best is not None and best_shared >= bs:
        theirs = cached_context(best)
        cause = Cause.EXTENDED if best_shared == len(theirs) else Cause.DIVERGED
        return Diagnosis(cause=cause, match=_match(best, best_shared),
                         divergence=_divergence(ours, best, best_shared, decoder), **base)  # fmt: skip
    words = _same_words(ours, [c for _, c in same], decoder)
    if words is not None:
        shared = shared_context(ours, words)
        return Diagnosis(cause=Cause.DIVERGED, match=_match(words, shared),
                         divergence=_divergence(ours, words, shared, decoder), **base)  # fmt: skip
    return Diagnosis(cause=Cause.NEW, **base)


def _lookup_cap(request: HistoryRequest) -> int:
    """Prompt tokens a prefix lookup may serve: the full blocks before the last prompt token."""
    return (request.prompt_tokens - 1) // request.block_size * request.block_size


def _missed(request: HistoryRequest) -> int:
    return max(0, _lookup_cap(request) - min(request.cached_tokens, request.prompt_tokens))


def _never_served(request: HistoryRequest) -> int:
    return request.prompt_tokens - max(_lookup_cap(request), min(request.cached_tokens, request.prompt_tokens))


def _same_namespace(a: HistoryRequest, b: HistoryRequest) -> bool:
    return a.namespace == b.namespace and a.salt == b.salt and a.block_size == b.block_size


def _match(candidate: HistoryRequest, shared: int) -> dict[str, Any]:
    return {"request_id": candidate.request_id, "run_id": candidate.run_id, "shared_tokens": shared}


def _wait(request: HistoryRequest, same: list[tuple[int, HistoryRequest]], bs: int) -> dict[str, Any] | None:
    """How long a hit waited for an earlier request that was computing its prefix, or None."""
    scheduled = request.first_scheduled_time
    if scheduled is None or scheduled - request.arrival_time < WAIT_EPSILON_S:
        return None
    computing = [
        (shared, c) for shared, c in same
        if shared >= bs and c.first_scheduled_time is not None and c.first_scheduled_time <= scheduled
        and (c.first_token_time is None or c.first_token_time >= request.arrival_time)
    ]  # fmt: skip
    if not computing:
        return None
    shared, other = max(computing, key=lambda pair: (pair[0], pair[1].arrival_time))
    return {"seconds": scheduled - request.arrival_time, "request_id": other.request_id, "shared_tokens": shared}


def _evicted(request: HistoryRequest, holder: HistoryRequest, shared: int,
             lookups: tuple[EvictionLookup, TierLookups | None], base: dict[str, Any]) -> Diagnosis:  # fmt: skip
    """The block at `position` was held by `holder`: find its eviction (or the window that was not ready),
    and what the disk tier did with it after."""
    evictions, tiers = lookups
    index = base["position"] // request.block_size
    # Our own keys first: shared blocks of one namespace have the same chain keys, and ours cover every
    # full prompt block, where the holder's cover its prompt only (not the reply a later turn shares).
    keys = request.block_keys or holder.block_keys
    match = _match(holder, shared)
    before = request.first_scheduled_time or request.arrival_time
    fact = None
    if keys is not None and len(keys) >= 16 * (index + 1):
        fact = evictions(holder.run_id, keys[16 * index : 16 * (index + 1)].hex(), before)
    window = {"r": request.r, "replay_mode": request.replay_mode} if request.replay_mode not in (None, "none") else None
    if fact is not None:
        eviction = {"at": fact.at, "reason": fact.reason, "block": fact.block, "key": fact.key_hex, "group": fact.group}
        cause = Cause.WINDOW if fact.reason == "window" else Cause.EVICTED
        tier = tier_after_eviction(tiers, holder.run_id, fact.key_hex, fact.at, before)
        if tier is not None and tier["lost"] and cause is Cause.EVICTED:
            cause = Cause.BOTH_TIERS
        notes = [still_on_disk_note(tier)] if tier is not None and not tier["lost"] else []
        return Diagnosis(cause=cause, match=match, eviction=eviction, window=window, tier=tier, notes=notes, **base)
    if window is not None:
        return Diagnosis(cause=Cause.WINDOW, match=match, window=window, **base)
    note = ("no eviction of this block is in the history: retention may have pruned it, or "
            f"{holder.request_id} had not finished computing it when this request looked it up")  # fmt: skip
    return Diagnosis(cause=Cause.EVICTED, match=match, notes=[note], **base)


def _namespace_difference(ours: HistoryRequest, theirs: HistoryRequest) -> dict[str, Any]:
    """Each namespace field that differs, as [ours, theirs]."""
    fields = ("salt", "model", "weights_revision", "dtype", "namespace")
    differs = {name: [getattr(ours, name), getattr(theirs, name)] for name in fields}
    return {name: pair for name, pair in differs.items() if pair[0] != pair[1]}


def _same_words(ours: Sequence[int], candidates: list[HistoryRequest], decoder: Decoder) -> HistoryRequest | None:
    """The latest of the newest MAX_WORD_CANDIDATES earlier requests whose visible text holds ours or is held
    in ours (the same words under another template or tokenization), when at least MIN_SHARED_WORDS
    characters are shared."""
    mine = decoder.visible(ours).strip()
    if len(mine) < MIN_SHARED_WORDS:
        return None
    newest = sorted(candidates, key=lambda c: c.arrival_time, reverse=True)[:MAX_WORD_CANDIDATES]
    for candidate in newest:
        theirs = decoder.visible(candidate.prompt_token_ids or ()).strip()
        if len(theirs) >= MIN_SHARED_WORDS and (mine in theirs or theirs in mine):
            return candidate
    return None


def _divergence(ours: tuple[int, ...], earlier: HistoryRequest, at: int, decoder: Decoder) -> dict[str, Any]:
    """The text around the first differing token, on both sides (theirs: the earlier request's cached
    context), and what kind of difference it is.

    `template_tokens` lists the special tokens of each side's window after the divergence; `template` names
    the side whose prompt alone holds special tokens ("ours" / "theirs"), None when both or neither do.
    """
    theirs = cached_context(earlier)
    ours_after, theirs_after = list(ours[at : at + WINDOW_AFTER]), list(theirs[at : at + WINDOW_AFTER])
    ours_text, theirs_text = decoder.decode(ours_after), decoder.decode(theirs_after)
    common = min(len(ours_text), len(theirs_text), 32)
    same_text = common > 0 and ours_text[:common] == theirs_text[:common]
    special = decoder.special_ids
    template_tokens = {
        "ours": [decoder.decode([t]) for t in ours_after if t in special],
        "theirs": [decoder.decode([t]) for t in theirs_after if t in special],
    }
    ours_templated = any(t in special for t in ours)
    theirs_templated = any(t in special for t in earlier.prompt_token_ids or ())
    template = None if ours_templated == theirs_templated else ("ours" if ours_templated else "theirs")
    notes = []
    if at == len(theirs) < len(ours):
        notes.append(f"{earlier.request_id}'s cached context (its prompt and its output but the last token) ends "
                     "here: no earlier request computed the tokens after it")  # fmt: skip
    if same_text:
        notes.append("the ids differ but decode to the same text: the tokenization or template changed, not the text")
    if template is not None:
        side = "this request" if template == "ours" else earlier.request_id
        notes.append(f"only {side} was rendered through a chat template: its prompt holds the template's special "
                     "tokens, the other's has none")  # fmt: skip
    return {
        "position": at,
        "before": decoder.decode(list(ours[max(0, at - WINDOW_BEFORE) : at])),
        "ours": ours_text,
        "theirs": theirs_text,
        "ours_ids": ours_after,
        "theirs_ids": theirs_after,
        "same_text": same_text,
        "template_tokens": template_tokens,
        "template": template,
        "notes": notes,
    }


@dataclass(frozen=True)
class RunSummary:
    """Tokens missed by cause over one run's requests."""

    run_id: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    disk_cached_tokens: int  # of cached_tokens, those served from the disk tier
    missed_tokens: int  # over every request, explained or not: cached + missed + never served = prompt tokens
    never_served_tokens: int
    by_cause: dict[str, dict[str, int]]  # cause -> {"requests", "missed_tokens"}
    unexplained: int  # requests whose prompt the history does not hold

    def as_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "disk_cached_tokens": self.disk_cached_tokens,
                "missed_tokens": self.missed_tokens,
                "never_served_tokens": self.never_served_tokens, "by_cause": self.by_cause,
                "unexplained": self.unexplained}  # fmt: skip


def summarize(run_id: str, requests: Sequence[HistoryRequest], before: Sequence[HistoryRequest],
              evictions: EvictionLookup, decoder: Decoder,
              tiers: TierLookups | None = None) -> tuple[RunSummary, list[Diagnosis]]:  # fmt: skip
    """Every request of a run diagnosed (in arrival order), and the tokens missed by cause.

    Args:
        requests: the run's requests.
        before: requests of other runs that arrived before the run's last request.
        tiers: the disk tier's history, as `diagnose` takes it.
    """
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    pool = sorted(before, key=lambda r: r.arrival_time)
    by_cause = {cause.value: {"requests": 0, "missed_tokens": 0} for cause in Cause}
    diagnoses, unexplained, seen = [], 0, []
    others = iter(pool)
    pending = next(others, None)
    for request in ordered:
        while pending is not None and pending.arrival_time < request.arrival_time:
            seen.append(pending)
            pending = next(others, None)
        try:
            diagnosis = diagnose(request, seen, evictions, decoder, tiers)
        except WhyError:
            unexplained += 1
        else:
            diagnoses.append(diagnosis)
            by_cause[diagnosis.cause.value]["requests"] += 1
            by_cause[diagnosis.cause.value]["missed_tokens"] += diagnosis.missed_tokens
        seen.append(request)
    summary = RunSummary(run_id, len(ordered), sum(r.prompt_tokens for r in ordered),
                         sum(min(r.cached_tokens, r.prompt_tokens) for r in ordered),
                         sum(getattr(r, "disk_cached_tokens", 0) or 0 for r in ordered), sum(map(_missed, ordered)),
                         sum(map(_never_served, ordered)), by_cause, unexplained)  # fmt: skip
    return summary, diagnoses
