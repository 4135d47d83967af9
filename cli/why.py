"""`why`: why a request's prompt tokens were not served from the prefix cache, from the history.

    python -m cli why --db URL --request ID [--run RUN] [--json]     one request (analysis/why.py's causes)
    python -m cli why --db URL --run RUN --summary [--json]          every request of a run: tokens missed by cause

A request id is what the console shows and what the API returns as a response's `id`; without `--run` the
newest run holding that id is read. The decoded text windows use the run's model's tokenizer (from
`--data-dir`, default the console's); a model without one shows token ids. Exit status: 0; 2 for a
database URL that cannot be used, an unknown request or run, or a request whose prompt the history does
not hold.

It answers in well under a second: nothing here imports torch or transformers when the model's tokenizer
is cached as a `tokenizer.json` (the console caches SmolLM2's on first use); it is read with the
`tokenizers` library alone, which only decodes here. Only a model without that file goes through
`serving.prompts.load_tokenizer` (transformers, seconds to import).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cli.usage import open_database

NAME = "why"
CHAT_PRESETS = ("smollm2", "tiny-chat")  # the presets with a tokenizer: SmolLM2's (serving.prompts.load_tokenizer)
# Where the console caches SmolLM2's tokenizer under the data directory: the converted model, else a
# tokenizer-only copy (engine.runner.model_loading's SMOLLM2_CACHE_NAME and SMOLLM2_TOKENIZER_CACHE_NAME).
SMOLLM2_TOKENIZER_DIRS = ("models/smollm2-135m-instruct", "models/smollm2-135m-instruct-tokenizer")
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="why a request missed the prefix cache (or a run's misses by cause)")
    parser.add_argument("--db", required=True, help="SQLAlchemy URL of the history")
    parser.add_argument("--request", default=None, help="the request id (a response's id for API requests)")
    parser.add_argument("--run", dest="run_id", default=None, help="the run (default: the newest holding the request)")
    parser.add_argument("--summary", action="store_true", help="every request of --run: tokens missed by cause")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the model's tokenizer is cached")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Explain one request or summarise a run; returns the exit status (see the module docstring)."""
    if (args.request is None) != args.summary:
        print("error: give --request ID, or --run RUN --summary", file=sys.stderr)
        return 2
    if args.summary and args.run_id is None:
        print("error: --summary needs --run", file=sys.stderr)
        return 2
    from sqlalchemy.exc import SQLAlchemyError

    from storage.db import db_engine

    db = open_database(db_engine, args.db)
    try:
        result = _summary(db, args) if args.summary else _one(db, args)
    except (LookupError, ValueError, SQLAlchemyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        db.dispose()
    print(json.dumps(result.as_json(), indent=2) if args.json else render(result.as_json()))
    return 0


def _tiers(db: Any) -> Any:
    """The disk tier's history as a diagnosis reads it (analysis/why_tiers.py)."""
    from analysis.why_tiers import TierLookups
    from storage.read.tier_history import request_promotions, tier_fate

    return TierLookups(lambda *request: request_promotions(db, *request), lambda *key: tier_fate(db, *key))


def _one(db: Any, args: argparse.Namespace) -> Any:
    from analysis.why import diagnose
    from storage.read.why import find_request, latest_eviction, requests_before

    request = find_request(db, args.request, args.run_id)
    if request is None:
        where = f" in run {args.run_id}" if args.run_id else ""
        raise LookupError(f"no request {args.request!r}{where} in the history")
    earlier = requests_before(db, request.arrival_time)
    return diagnose(request, earlier, lambda *key: latest_eviction(db, *key), _decoder(request.model, args.data_dir),
                    _tiers(db))  # fmt: skip


def _summary(db: Any, args: argparse.Namespace) -> Any:
    from analysis.why import summarize
    from storage.read.why import latest_eviction, requests_before, run_requests

    requests = run_requests(db, args.run_id)
    if not requests:
        raise LookupError(f"no requests of run {args.run_id!r} in the history")
    others = [r for r in requests_before(db, requests[-1].arrival_time) if r.run_id != args.run_id]
    summary, _ = summarize(args.run_id, requests, others, lambda *key: latest_eviction(db, *key),
                           _decoder(requests[0].model, args.data_dir), _tiers(db))  # fmt: skip
    return summary


def _decoder(model: str, data_dir: Path | None) -> Any:
    from analysis.why import Decoder
    from engine.core.config import default_data_dir

    data_dir = data_dir or default_data_dir()
    if model in CHAT_PRESETS:
        directories = [data_dir / name for name in SMOLLM2_TOKENIZER_DIRS]
    elif Path(model).is_dir():
        directories = [Path(model)]
    else:
        return Decoder.of(None)  # a token-id-only preset (load_tokenizer's None)
    for directory in directories:
        if (directory / "tokenizer.json").is_file():
            return Decoder.deferred(lambda: file_decoder(directory))
    from serving.prompts import load_tokenizer  # not cached yet: transformers builds (and caches) it

    return Decoder.of(load_tokenizer(model, data_dir))


def file_decoder(directory: Path) -> Any:
    """A decoder from a tokenizer directory's `tokenizer.json`, through the `tokenizers` library.

    Decodes as the transformers tokenizer of the same directory does; the special ids are the ones it
    calls special (`all_special_ids`): the tokens `tokenizer_config.json` and `special_tokens_map.json` name
    in SPECIAL_TOKEN_FIELDS and `additional_special_tokens`.
    """
    from tokenizers import Tokenizer

    from analysis.why import Decoder

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    names: list[Any] = []
    for config_name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / config_name
        config = json.loads(path.read_text()) if path.is_file() else {}
        names += [config.get(field) for field in SPECIAL_TOKEN_FIELDS]
        names += list(config.get("additional_special_tokens") or ())
    contents = {name["content"] if isinstance(name, dict) else name for name in names if name}
    ids = frozenset(i for i in map(tokenizer.token_to_id, contents) if i is not None)
    return Decoder(
        lambda tokens: tokenizer.decode(list(tokens), skip_special_tokens=False),
        lambda tokens: tokenizer.decode(list(tokens), skip_special_tokens=True),
        lambda: ids,
    )


def render(result: dict[str, Any]) -> str:
    """A diagnosis or a run summary as text."""
    from analysis.why_tiers import tier_words

    if "by_cause" in result:
        disk = f" ({result['disk_cached_tokens']} from disk)" if result.get("disk_cached_tokens") else ""
        lines = [f"run {result['run_id']}: {result['requests']} requests, {result['prompt_tokens']} prompt tokens: "
                 f"{result['cached_tokens']} served from the cache{disk}, {result['missed_tokens']} missed, "
                 f"{result['never_served_tokens']} never served (each prompt's last token and partial block)"]  # fmt: skip
        for cause, counts in result["by_cause"].items():
            if counts["requests"]:
                missed = counts["missed_tokens"]
                lines.append(f"  {cause:<10} {counts['requests']:>6} requests  {missed:>9} tokens missed")
        if result["unexplained"]:
            lines.append(f"  {result['unexplained']} requests without a recorded prompt")
        return "\n".join(lines)
    lines = [f"{result['request_id']} (run {result['run_id']}): {result['cause']}; of {result['prompt_tokens']} "
             f"prompt tokens {result['cached_tokens']} were served from the cache, {result['missed_tokens']} missed, "
             f"{result['never_served_tokens']} never served (the last token and a partial block are always "
             f"computed); {result['reusable_tokens']} reusable (first not served: token {result['position']})"]  # fmt: skip
    if result["match"]:
        match = result["match"]
        shared = match["shared_tokens"]
        if result["cause"] == "fork":
            lines.append(f"  a fork of {match['request_id']}: shares its {shared} tokens of KV (its blocks, a partial "
                         "tail too)")  # fmt: skip
        else:
            lines.append(f"  earlier request {match['request_id']} (run {match['run_id']}) shared {shared} tokens "
                         "(its prompt and its output)")  # fmt: skip
    if result["divergence"]:
        d = result["divergence"]
        if result["cause"] == "extended":
            lines += [f"  its cached context ends at token {d['position']}, after {d['before']!r}",
                      f"    ours continues: {d['ours']!r}"]  # fmt: skip
        else:
            lines += [f"  diverged at token {d['position']} after {d['before']!r}", f"    ours:   {d['ours']!r}",
                      f"    theirs: {d['theirs']!r}"]  # fmt: skip
        lines += [f"  {note}" for note in d["notes"]]
    if result.get("disk"):
        d = result["disk"]
        lines.append(f"  served from disk: {d['tokens']} tokens (tokens {d['start']}-{d['end'] - 1}, read into pool "
                     f"blocks {d['blocks']} from tier slots {d['slots']}); {d['memory_tokens']} from memory")  # fmt: skip
    if result["eviction"]:
        e = result["eviction"]
        lines.append(f"  evicted at {e['at']:.3f} ({e['reason']}), block {e['block']}")
    tier = result.get("tier")
    if tier and tier["lost"]:
        lines.append(f"  {tier_words(tier, lambda at: f'{at:.3f}')}")
    if result["namespace"]:
        lines += [f"  {name}: ours {pair[0]!r}, theirs {pair[1]!r}" for name, pair in result["namespace"].items()]
    if result["wait"]:
        w = result["wait"]
        lines.append(f"  waited {w['seconds'] * 1000:.1f} ms for {w['request_id']} to compute the shared prefix")
    if result["window"]:
        lines.append(f"  sliding-window state replayed from token {result['window']['r']}")
    lines += [f"  {note}" for note in result["notes"]]
    return "\n".join(lines)
