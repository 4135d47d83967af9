"""`analyze`: what a prefix cache of a given size would hit on a workload, under which policy, and why not more.

    python -m cli analyze TRACE [--format mooncake|bailian|run-trace|history] [--block-size N]
        [--capacity-tokens C1,C2,...] [--policies lru,reuse-lru,fifo,lfu,opt] [--mode sequential|timed]
        [--json] [--tier-gib G1,G2 [--disk-gbps B] [--kv-bytes-per-token N] [--tier-simulate]] ...

TRACE is a trace file (JSON lines; the format is detected from the first line unless named), a
`run-trace` workload file (`--format run-trace`: tokenized with `--model`'s tokenizer and keyed under
its namespace, so `--model` loads that model), or a history database (`--format history`: a SQLAlchemy
URL, or the path of a SQLite file; `--runs` picks runs). Capacities accept k/M/G suffixes (1M = 1,000,000
tokens); without `--capacity-tokens`, ten log-spaced capacities up to the workload's unique blocks.

`--tier-gib` adds a disk tier of each size behind an LRU pool of each capacity (analysis/tier_plan.py): the
hit ratio with the tier, the prefill seconds its loads save net of their read time, and the pool that
would hit as much alone.

With `--json` it prints one JSON object (analysis/report.py documents its keys); otherwise a table.
A progress bar goes to stderr when it is a terminal. Exit status: 0; 2 for a bad trace (a malformed
line is named by its number), an empty trace, an unknown format or a bad option, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from cli.usage import UsageError, open_database

NAME = "analyze"
FORMATS = ("mooncake", "bailian", "run-trace", "history")
MODES = ("sequential", "timed")
DEFAULT_POINTS = 10  # capacities evaluated when none are named
SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}
MAX_CAPACITY_TOKENS = 10**12  # an operator-typed bound: far beyond any cache


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="hit ratio of a cache of given sizes on a workload, and why it misses")
    parser.add_argument("trace", help="trace file, run-trace file, or (--format history) database URL / SQLite file")
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: detected (hash-id traces)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="hash-id traces: split blocks to this size; run-trace: the engine's (16); history: runs of it")  # fmt: skip
    parser.add_argument("--capacity-tokens", default=None, help="comma-separated cache sizes in tokens (1M, 500k, ...)")
    parser.add_argument("--policies", default=None, help="comma-separated: lru, reuse-lru, fifo, lfu, opt "
                        "(default lru,reuse-lru,opt; timed: lru,reuse-lru)")  # fmt: skip
    parser.add_argument("--mode", choices=MODES, default="sequential")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--top-prefixes", type=int, default=10, help="hot prefixes listed per point")
    parser.add_argument("--model", default=None, help="run-trace: the model whose tokenizer and namespace key it")
    parser.add_argument("--dtype", default="float32", help="run-trace: the dtype in the namespace")
    parser.add_argument("--runs", default=None, help="history: comma-separated run ids (default: every run)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None, help="service model (default: measured)")
    parser.add_argument("--decode-tokens-per-s", type=float, default=None, help="service model (default: measured)")
    parser.add_argument("--cost-per-hour", type=float, default=None, help="what an engine hour costs: savings in money")
    parser.add_argument("--tier-gib", default=None, help="comma-separated disk tier sizes in GiB (8,32): each "
                        "behind an LRU pool of each capacity (sequential mode)")  # fmt: skip
    parser.add_argument("--disk-gbps", type=float, default=None, help="the disk tier's read bandwidth in GB/s (default 2)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=None,
                        help="KV bytes of one token, for the tier's blocks (default 46080: SmolLM2-135M in float32)")  # fmt: skip
    parser.add_argument("--tier-simulate", action="store_true",
                        help="also simulate this engine's tier rule at each tier point (one pure-Python pass each)")  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Analyse `args.trace`; returns the exit status (see the module docstring)."""
    started = time.perf_counter()
    try:
        trace = load(args)
        config = analysis_config(args, trace)
        report = analyse(trace, config)
    except ValueError as error:  # TraceError, UsageError, or a bound of AnalysisConfig, ServiceModel, EngineConfig
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: cannot read {args.trace}: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, allow_nan=False))  # strict JSON: every number in a report is finite
    else:
        print(table(report, time.perf_counter() - started))
    return 0


def load(args: argparse.Namespace):
    """The trace `args` name, at the block size asked for."""
    from analysis.readers import load_trace, parse_format

    if args.block_size is not None and args.block_size < 1:
        raise UsageError("--block-size must be a positive number of tokens")
    if args.format == "run-trace":
        return _run_trace(args)
    if args.format == "history":
        return _history(args)
    if args.model is not None or args.runs is not None:
        raise UsageError("--model is for run-trace files and --runs for the history")
    trace = load_trace(Path(args.trace), None if args.format is None else parse_format(args.format))
    if args.block_size is not None and args.block_size != trace.block_size:
        try:
            trace = trace.split(args.block_size)
        except ValueError as error:
            raise UsageError(str(error)) from None
    return trace


def _run_trace(args: argparse.Namespace):
    """A run-trace file, keyed under the namespace of `--model` (loaded: its tokenizer and weights revision)."""
    from analysis.own_workloads import Keying, read_run_trace
    from engine.core.config import DEFAULT_MODEL, EngineConfig
    from engine.runner.model_loading import load_model  # torch: only for the format that needs the model's tokenizer
    from engine.core.namespace import CacheNamespace

    config = EngineConfig(model=args.model or DEFAULT_MODEL, dtype=args.dtype, device="cpu",
                          block_size=args.block_size or 16)  # fmt: skip
    loaded = load_model(config)
    namespace = CacheNamespace(loaded.model_id, loaded.weights_revision, config.dtype, config.block_size,
                               loaded.attention_spec)  # fmt: skip
    with open(args.trace, "rb") as file:
        return read_run_trace(file, Keying(namespace, loaded.tokenizer))


def _history(args: argparse.Namespace):
    """The finished requests a history database holds (storage is imported only here)."""
    from sqlalchemy.exc import SQLAlchemyError

    from analysis.own_workloads import history_trace
    from storage.read import queries
    from storage.db import existing_db_engine, redacted_url

    target = args.trace
    if "://" not in target:
        if not Path(target).is_file():
            raise UsageError(f"no history database at {target} (give a SQLAlchemy URL or a SQLite file)")
        target = f"sqlite:///{Path(target).resolve()}"
    runs = () if args.runs is None else tuple(run for run in args.runs.split(",") if run)
    database = open_database(existing_db_engine, target)
    try:
        rows = queries.prompt_chains(database, runs)
    except SQLAlchemyError as error:  # not a history database (no such table, ...), or unreachable
        message = f"cannot read the history at {redacted_url(target)}: {type(error).__name__}: {error}"
        raise UsageError(message) from None
    finally:
        database.dispose()
    return history_trace(rows.to_dict("records"), args.block_size)


def parse_capacities(text: str) -> tuple[int, ...]:
    """'1M,500k,4096' -> (1000000, 500000, 4096).

    Raises:
        UsageError: an entry that is not a whole number of tokens in [0, 10^12].
    """
    capacities = []
    for entry in text.split(","):
        entry = entry.strip().lower()
        scale = SUFFIXES.get(entry[-1:], 1)
        number = entry[:-1] if scale > 1 else entry
        try:
            value = Decimal(number) * scale  # exact: 4.1M is 4,100,000 tokens
        except InvalidOperation:
            raise UsageError(f"--capacity-tokens: {entry!r} is not a number of tokens") from None
        if not (value.is_finite() and 0 <= value <= MAX_CAPACITY_TOKENS and value == value.to_integral_value()):
            raise UsageError(f"--capacity-tokens: {entry!r} is not a whole number of tokens in [0, 10^12]")
        capacities.append(int(value))
    return tuple(capacities)


def analysis_config(args: argparse.Namespace, trace):
    """The AnalysisConfig the options describe, for `trace`."""
    from analysis.analyzer import AnalysisConfig, Mode, log_spaced_capacities
    from analysis.policies import Policy
    from analysis.timed import ServiceModel

    mode = Mode(args.mode)
    if args.policies is None:
        policies = (Policy.LRU, Policy.REUSE_LRU) + ((Policy.OPT,) if mode is Mode.SEQUENTIAL else ())
    else:
        try:
            policies = tuple(Policy(name.strip()) for name in args.policies.split(","))
        except ValueError:
            known = ", ".join(p.value for p in Policy)
            raise UsageError(f"--policies: {args.policies!r} names an unknown policy (known: {known})") from None
    if args.capacity_tokens is not None:
        capacities = parse_capacities(args.capacity_tokens)
    else:
        blocks = log_spaced_capacities(max(trace.unique_blocks, 1), DEFAULT_POINTS)
        capacities = tuple(block * trace.block_size for block in blocks)
    rates = {"prefill_tokens_per_s": args.prefill_tokens_per_s, "decode_tokens_per_s": args.decode_tokens_per_s}
    service = ServiceModel(**{name: rate for name, rate in rates.items() if rate is not None})
    return AnalysisConfig(capacities, policies, args.top_prefixes, mode, service, args.cost_per_hour, tier_config(args))


def tier_config(args: argparse.Namespace):
    """The TierConfig `--tier-gib` and its companions describe, or None without `--tier-gib`."""
    from analysis.tier_plan import DEFAULT_DISK_GBPS, ENGINE_KV_BYTES_PER_TOKEN, DiskModel, TierConfig

    if args.tier_gib is None:
        if args.disk_gbps is not None or args.kv_bytes_per_token is not None or args.tier_simulate:
            raise UsageError("--disk-gbps, --kv-bytes-per-token and --tier-simulate go with --tier-gib")
        return None
    sizes = []
    for entry in args.tier_gib.split(","):
        try:
            sizes.append(float(entry))
        except ValueError:
            raise UsageError(f"--tier-gib: {entry.strip()!r} is not a number of GiB") from None
    kv_bytes = ENGINE_KV_BYTES_PER_TOKEN if args.kv_bytes_per_token is None else args.kv_bytes_per_token
    disk = DiskModel(kv_bytes, DEFAULT_DISK_GBPS if args.disk_gbps is None else args.disk_gbps)
    return TierConfig(tuple(sizes), disk, args.tier_simulate)


def analyse(trace, config) -> dict[str, Any]:
    from analysis.analyzer import analyze
    from analysis.report import to_json

    bar = ProgressBar(sys.stderr) if sys.stderr.isatty() else None
    try:
        return to_json(analyze(trace, config, bar))
    finally:
        if bar is not None:
            bar.close()


class ProgressBar:
    """A one-line progress bar on a terminal, redrawn at most every `interval_s`."""

    def __init__(self, stream, interval_s: float = 0.2) -> None:
        self._stream = stream
        self._interval_s = interval_s
        self._last = 0.0
        self._drawn = False

    def __call__(self, progress) -> None:
        now = time.monotonic()
        if now - self._last < self._interval_s and progress.done < progress.total:
            return
        self._last = now
        share = progress.done / progress.total if progress.total else 1.0
        filled = int(share * 30)
        self._stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {share:6.1%}  {progress.stage[:60]:<60}")
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()


def table(report: dict[str, Any], seconds: float) -> str:
    """The report as text: the workload, then one line per point."""
    lines = [
        f"{report['format']} trace, {report['mode']} mode: {report['requests']:,} requests, "
        f"{report['input_tokens']:,} prompt tokens, {report['unique_blocks']:,} unique blocks of "
        f"{report['block_size']} tokens",
        f"maximum hit ratio (infinite cache): {report['max_hit_ratio']:.4f}   unavoidable misses: "
        + ", ".join(f"{reason} {tokens:,}" for reason, tokens in report["misses"].items()),
        "",
        f"{'policy':<10}{'capacity':>14}{'hit ratio':>11}{'of max':>8}  misses (tokens): capacity / pinned / namespace",
    ]
    for point in report["curve"]:
        share = point["hit_ratio"] / report["max_hit_ratio"] if report["max_hit_ratio"] else 0.0
        misses = point["misses"]
        line = (
            f"{point['policy']:<10}{point['capacity_tokens']:>14,}{point['hit_ratio']:>11.4f}{share:>8.1%}  "
            f"{misses['capacity']:,} / {misses['pinned']:,} / {misses['namespace']:,}"
        )
        per_hour = point["savings"]["prefill_s_per_trace_hour"]
        if per_hour is not None:
            line += f"   saves {per_hour:,.0f} prefill s per trace hour"
        if point["timed"] is not None:
            timed = point["timed"]
            line += (
                f"   queueing p50 {timed['queueing_s']['p50']:.2f} s, p99 {timed['queueing_s']['p99']:.2f} s, "
                f"peak {timed['peak_blocks_in_use']:,} blocks in use"
            )
        lines.append(line)
    if report["tiers"]:
        lines += ["", *tier_table(report)]
    lines.append(f"\n{seconds:.1f} s")
    return "\n".join(lines)


def tier_table(report: dict[str, Any]) -> list[str]:
    """The two-tier rows: an LRU pool of each capacity with a disk tier of each size behind it."""
    disk = report["disk"]
    lines = [
        f"disk tier behind an LRU pool ({disk['kv_bytes_per_token']:,} KV bytes a token, read at "
        f"{disk['disk_gbps']:g} GB/s); with tier: one LRU of pool + tier, this engine's tier at least the floor",
        f"{'pool':>14}{'tier GiB':>10}{'pool alone':>12}{'with tier':>11}{'floor':>8}{'simulated':>11}"
        f"{'net prefill s saved':>21}   pool alone for the same: tokens (KV GiB)",
    ]
    for row in report["tiers"]:
        simulated = "-" if row["simulated_hit_ratio"] is None else f"{row['simulated_hit_ratio']:.4f}"
        per_hour = row["net_prefill_s_per_trace_hour"]
        saved = f"{row['net_prefill_s']:,.0f}" if per_hour is None else f"{per_hour:,.0f} /h"
        lines.append(
            f"{row['pool_tokens']:>14,}{row['tier_gib']:>10g}{row['pool_hit_ratio']:>12.4f}{row['hit_ratio']:>11.4f}"
            f"{row['floor_hit_ratio']:>8.4f}{simulated:>11}{saved:>21}   {row['pool_alone_tokens']:,} "
            f"({row['pool_alone_kv_gib']:,.2f})"
        )
    return lines
