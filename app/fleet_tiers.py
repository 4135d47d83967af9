"""Plain functions behind the Fleet pages' tier views: held blocks per tier (medium) per pod, and which tier
of each pod would serve a prompt (`FleetIndex.route_tiers`). No Streamlit here; the pages lay these out.

A tier is a medium as the servers' KV events name it: "GPU" (vLLM's pool), "CPU" (this engine's pool
on the CPU, or vLLM's CPU offloading tier), "DISK" (this engine's disk tier), "STORAGE" (vLLM's file
tier). fleet.tiers orders them fastest first.
"""

from __future__ import annotations

import pandas as pd

from fleet.tiers import PodTierMatch, TieredRoute, tier_rank

BLOCKS_SUFFIX = " blocks"  # the pods frames' per-medium columns: "<medium> blocks" (app.fleet_view)
TIER_COLUMNS = ["pod", "tier", "blocks", "share of pod", "share of tier"]
_WHERE = {"GPU": "in GPU memory", "CPU": "in CPU memory", "CPU_PINNED": "in pinned CPU memory", "DISK": "on DISK"}


def where(medium: str) -> str:
    """Where a medium keeps its blocks, in words ("in CPU memory", "on DISK", "in STORAGE")."""
    return _WHERE.get(medium, f"in {medium}")


def tier_frame(pods: pd.DataFrame) -> pd.DataFrame:
    """Held blocks per tier per pod, from a pods frame (`live_pods` or `history_pods`).

    Returns:
        One row per pod and tier it holds blocks in, pods by name and tiers fastest first: pod, tier,
        blocks, share of pod (of the pod's held blocks), share of tier (of every pod's blocks in that tier).
    """
    media = [name[: -len(BLOCKS_SUFFIX)] for name in pods.columns if name.endswith(BLOCKS_SUFFIX)]
    if pods.empty or not media:
        return pd.DataFrame(columns=TIER_COLUMNS)
    rows = []
    for row in pods.to_dict("records"):
        held = {medium: _count(row[f"{medium}{BLOCKS_SUFFIX}"]) for medium in media}
        total = sum(held.values())
        for medium, blocks in held.items():
            if blocks:
                rows.append({"pod": row["pod"], "tier": medium, "blocks": blocks, "share of pod": blocks / total})
    frame = pd.DataFrame(rows, columns=TIER_COLUMNS[:4])
    if frame.empty:
        return pd.DataFrame(columns=TIER_COLUMNS)
    frame["share of tier"] = frame["blocks"] / frame.groupby("tier")["blocks"].transform("sum")
    frame["rank"] = frame["tier"].map(tier_rank)
    return frame.sort_values(["pod", "rank"]).drop(columns="rank").reset_index(drop=True)


def _count(value) -> int:
    """A per-medium count cell as an int (a pod without blocks in that medium has NaN or None)."""
    return 0 if value is None or pd.isna(value) else int(value)


def served_sentence(match: PodTierMatch) -> str:
    """One pod's answer in words: "pod-a: 48 tokens in CPU memory, 96 more on DISK"."""
    if not match.served:
        return f"{match.pod}: nothing cached"
    parts = [f"{serve.tokens:,} tokens {where(serve.medium)}" for serve in match.served[:1]]
    parts += [f"{serve.tokens:,} more {where(serve.medium)}" for serve in match.served[1:]]
    return f"{match.pod}: {', '.join(parts)}" + (" (stale)" if match.stale else "")


def tier_route_frame(route: TieredRoute) -> pd.DataFrame:
    """Each pod's served tokens by tier, most first: pod, cached tokens, one "<tier> tokens" column per tier
    some pod serves from (fastest first, 0 where that pod's tier serves nothing), share of prompt, stale."""
    media = sorted({serve.medium for match in route.matches for serve in match.served}, key=tier_rank)
    rows = []
    for match in route.matches:
        served = {serve.medium: serve.tokens for serve in match.served}
        row = {"pod": match.pod, "cached tokens": match.matched_tokens}
        row.update({f"{medium} tokens": served.get(medium, 0) for medium in media})
        total = route.num_prompt_tokens
        row.update({"share of prompt": match.matched_tokens / total if total else 0.0, "stale": match.stale})
        rows.append(row)
    columns = ["pod", "cached tokens", *(f"{medium} tokens" for medium in media), "share of prompt", "stale"]
    return pd.DataFrame(rows, columns=columns)
