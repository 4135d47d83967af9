"""Replaying a JSONL workload trace through an engine (the `run-trace` command, cli/run_trace.py).

One JSON object per line, applied in order:
    {"op": "submit", "id": "a", "tokens": [..] | "text": "..." | "chat": [{"role": .., "content": ..}],
     "max_new_tokens": 8, "retain": false, "temperature": 0, "top_p": 1, "seed": null, "salt": null}
    {"op": "fork", "id": "b", "parent": "a", "suffix_tokens": [..] | "suffix_text": "...", ...}
    {"op": "release", "id": "a"}   {"op": "run"}   {"op": "reset"}
Every finished request is reported as one dict; a rejected request as {"id", "rejected"}. A bad line
(not UTF-8 JSON, nested too deeply, longer than MAX_LINE_BYTES, or an op the engine refuses) raises
TraceError naming the line; the engine state stays consistent (nothing of that line applied).
"""

from __future__ import annotations

from typing import Any, BinaryIO, Callable

import orjson

from engine.engine import Engine, RequestRejected
from engine.core.errors import InvariantError
from serving.prompts import submit_prompt, token_list
from engine.core.request import SamplingParams
from engine.core.snapshot import RequestView

OPS = ("submit", "fork", "release", "run", "reset")
MAX_LINE_BYTES = 16 * 2**20  # one op: a prompt of a million tokens fits
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "ignore_eos")


class TraceError(ValueError):
    """A trace line that cannot be applied; the message names the line."""


def request_record(view: RequestView) -> dict[str, Any]:
    return {
        "id": view.request_id,
        "parent": view.parent_id,
        "prompt_tokens": view.num_prompt_tokens,
        "cached_tokens": view.cached_tokens,
        "cached_tokens_by_tier": view.cached_tokens_by_tier,
        "computed_tokens": view.computed_tokens,
        "hit_source": view.hit_source,
        "output_token_ids": list(view.output_token_ids),
        "block_table": list(view.block_table),
        "cow_copies": view.cow_copies,
        "preemptions": view.preemptions,
        "finish_reason": view.finish_reason,
        "block_tables": {group: list(ids) for group, ids in view.block_tables.items()},
        "h": view.cached_tokens,
        "s": view.window_start,
        "e": view.window_end,
        "r": view.replay_from,
        "replay_mode": view.replay_mode,
        "replayed_tokens": view.replayed_tokens,
        "replay_divergence": view.replay_divergence,
    }


def summary_record(engine: Engine) -> dict[str, Any]:
    stats = engine.stats()
    try:
        engine.check_invariants()
        invariants_ok = True
    except InvariantError:
        invariants_ok = False
    return {
        "summary": {
            "num_blocks": stats.num_blocks,
            "free_blocks": stats.free_blocks,
            "cached_blocks": stats.cached_blocks,
            "used_blocks": stats.used_blocks,
            "evictions": stats.evictions,
            "cow_copies": stats.cow_copies,
            "preemptions": stats.preemptions,
            "prefix_hit_tokens": stats.prefix_hit_tokens,
            "prefix_query_tokens": stats.prefix_query_tokens,
            "tier_hit_tokens": stats.tier_hit_tokens,  # of the hits, those read from the disk tier
            "fork_shared_tokens": stats.fork_shared_tokens,
            "fork_query_tokens": stats.fork_query_tokens,
            "preempted_hit_tokens": stats.preempted_hit_tokens,
            "preempted_query_tokens": stats.preempted_query_tokens,
            "tokens_saved": stats.tokens_saved,
            "invariants_ok": invariants_ok,
        }
    }


def replay(engine: Engine, source: BinaryIO, emit: Callable[[dict[str, Any]], None]) -> None:
    """Apply every line of `source`, emitting a record per finished or rejected request; runs until idle
    at the end."""
    number = 0
    while line := source.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise TraceError(f"line {number}: longer than {MAX_LINE_BYTES} bytes")
        if not line.strip():
            continue
        try:
            _apply(engine, _parse(line), emit)
        except RequestRejected as exc:
            emit({"id": _parse(line).get("id"), "rejected": str(exc)})
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"line {number}: {exc}") from exc
    _run(engine, emit)


def _parse(line: bytes) -> dict[str, Any]:
    try:
        op = orjson.loads(line)  # refuses text that is not UTF-8, and nesting deeper than 1,024
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(op, dict):
        raise ValueError("each line must be a JSON object")
    if op.get("op") not in OPS:
        raise ValueError(f"unknown op {op.get('op')!r}; expected one of {OPS}")
    return op


def _apply(engine: Engine, op: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> None:
    kind = op["op"]
    if kind == "submit":
        engine.submit(
            submit_prompt(engine.tokenizer, op),
            _sampling(op),
            request_id=_id(op),
            retain=bool(op.get("retain", False)),
            salt=op.get("salt"),
        )
    elif kind == "fork":
        if "parent" not in op:
            raise ValueError("fork needs a 'parent'")
        engine.fork(op["parent"], _suffix(engine, op), _sampling(op), request_id=_id(op), retain=bool(op.get("retain")))
    elif kind == "release":
        engine.release(_id(op))
    elif kind == "run":
        _run(engine, emit)
    else:
        engine.reset_cache()


def _run(engine: Engine, emit: Callable[[dict[str, Any]], None]) -> None:
    for view in engine.run_until_idle():
        emit(request_record(view))


def _id(op: dict[str, Any]) -> str:
    rid = op.get("id")
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"{op['op']} needs a non-empty string 'id'")
    return rid


def _sampling(op: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: op[k] for k in SAMPLING_KEYS if k in op})


def _suffix(engine: Engine, op: dict[str, Any]) -> list[int]:
    given = [k for k in ("suffix_tokens", "suffix_text") if k in op]
    if len(given) != 1:
        raise ValueError("fork needs exactly one of 'suffix_tokens' or 'suffix_text'")
    if "suffix_tokens" in op:
        return token_list(op["suffix_tokens"], "suffix_tokens")
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer: use suffix_tokens")
    if not op["suffix_text"]:
        raise ValueError("the fork suffix is empty")
    return list(engine.tokenizer(op["suffix_text"], add_special_tokens=False)["input_ids"])

