"""An `Analysis` as the JSON object `python -m cli analyze --json` prints.

    {"format", "mode", "requests", "references", "input_tokens", "block_size", "unique_blocks",
     "max_hit_ratio", "max_hit_tokens",
     "curve": [{"policy", "capacity_tokens", "capacity_blocks", "hit_ratio", "hit_tokens",
                "misses": {reason: tokens}, "by_type": [...], "top_prefixes": [...],
                "savings": {"prefill_s", "prefill_s_per_trace_hour", "cost_per_trace_hour"},
                "timed": null | {"queueing_s": {"p50", "p90", "p99", "max"}, "peak_blocks_in_use",
                                 "preemptions", "rejected", "makespan_s", "steps"}}, ...],
     "misses": {"compulsory", "partial", "namespace"},   # tokens every cache misses, whatever its size
     "by_type": [{"type", "requests", "input_tokens", "hit_tokens", "hit_ratio"}, ...],  # infinite cache
     "top_prefixes": [{"first_block", "last_block", "depth", "requests", "tokens_saved"}, ...],  # infinite
     "tiers": [{"pool_tokens", "pool_blocks", "tier_gib", "tier_blocks", "pool_hit_tokens", "hit_tokens",
                "pool_hit_ratio", "hit_ratio", "floor_hit_ratio", "simulated_hit_ratio", "tier_hit_tokens",
                "loaded_blocks", "prefill_s_saved", "load_s", "net_prefill_s", "net_prefill_s_per_trace_hour",
                "pool_alone_tokens", "pool_alone_kv_gib", "answer"}, ...],   # empty unless disk tiers were asked for
     "disk": null | {"kv_bytes_per_token", "disk_gbps"},
     "seconds"}

Each point's "misses" has every reason ("compulsory", "capacity", "partial", "pinned", "namespace"),
summing to `input_tokens - hit_tokens`. "by_type" lists are empty for traces without request types.
"savings" prices the hit tokens with the service model's prefill rate; its per-hour values are null
for a trace without a time span, the cost null unless a cost per engine hour was given.
"tiers" (analysis/tier_plan.py): per (capacity, disk tier size), the pool alone's hit ratio, the pool and
tier's (one LRU of pool + tier blocks), the floor this engine's tier never goes below (one LRU of the
larger of the two), its direct simulation under this engine's rule ("simulated_hit_ratio", null unless
asked), the tier's hit tokens and loads, the prefill seconds they save net of the loads, and the pool
that would hit as much alone.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from analysis.analyzer import Analysis
from analysis.breakdown import TypeHits
from analysis.tier_plan import TierPoint, answer


def to_json(analysis: Analysis) -> dict[str, Any]:
    """The analysis as plain JSON-serialisable values (see the module docstring)."""
    trace = analysis.trace
    unavoidable = analysis.unavoidable
    return {
        "format": trace.format.value,
        "mode": analysis.mode.value,
        "requests": len(trace),
        "references": trace.num_references,
        "input_tokens": trace.input_tokens,
        "block_size": trace.block_size,
        "unique_blocks": analysis.unique_blocks,
        "max_hit_ratio": analysis.max_hit_ratio,
        "max_hit_tokens": analysis.max_hit_tokens,
        "curve": [
            {
                "policy": point.policy.value,
                "capacity_tokens": point.capacity_tokens,
                "capacity_blocks": point.capacity_blocks,
                "hit_ratio": point.hit_ratio,
                "hit_tokens": point.hit_tokens,
                "misses": asdict(point.misses),
                "by_type": [_type_hits(hits) for hits in point.by_type],
                "top_prefixes": [asdict(prefix) for prefix in point.top_prefixes],
                "savings": asdict(point.savings),
                "timed": None if point.timed is None else asdict(point.timed),
            }
            for point in analysis.curve
        ],
        "misses": {
            "compulsory": unavoidable.compulsory,
            "partial": unavoidable.partial,
            "namespace": unavoidable.namespace,
        },
        "by_type": [_type_hits(hits) for hits in analysis.max_by_type],
        "top_prefixes": [asdict(prefix) for prefix in analysis.max_top_prefixes],
        "tiers": [_tier_point(point) for point in analysis.tiers],
        "disk": None if not analysis.tiers else asdict(analysis.tiers[0].disk),
        "seconds": analysis.seconds,
    }


def _tier_point(point: TierPoint) -> dict[str, Any]:
    simulated = point.simulated_hit_tokens
    return {
        "pool_tokens": point.size.pool_tokens,
        "pool_blocks": point.pool_blocks,
        "tier_gib": point.size.tier_gib,
        "tier_blocks": point.tier_blocks,
        "pool_hit_tokens": point.pool_hit_tokens,
        "hit_tokens": point.hit_tokens,
        "pool_hit_ratio": point.ratio(point.pool_hit_tokens),
        "hit_ratio": point.ratio(point.hit_tokens),
        "floor_hit_ratio": point.ratio(point.floor_hit_tokens),
        "simulated_hit_ratio": None if simulated is None else point.ratio(simulated),
        "tier_hit_tokens": point.tier_hit_tokens,
        "loaded_blocks": point.loaded_blocks,
        "prefill_s_saved": point.prefill_s_saved,
        "load_s": point.load_s,
        "net_prefill_s": point.net_prefill_s,
        "net_prefill_s_per_trace_hour": point.net_prefill_s_per_trace_hour,
        "pool_alone_tokens": point.pool_alone_tokens,
        "pool_alone_kv_gib": point.pool_alone_kv_gib,
        "answer": answer(point),
    }


def _type_hits(hits: TypeHits) -> dict[str, Any]:
    return {
        "type": hits.request_type,
        "requests": hits.requests,
        "input_tokens": hits.input_tokens,
        "hit_tokens": hits.hit_tokens,
        "hit_ratio": hits.hit_ratio,
    }
