"""Fleet mode across a server's tiers (issue 44): held blocks per medium per pod, and which tier of each pod
would serve a prompt (the pool's hit first, then each slower tier from where the faster ones stopped)."""

from __future__ import annotations

import math

import pandas as pd

from app.fleet_tiers import served_sentence, tier_frame, tier_route_frame, where
from fleet.events import BlockStored
from fleet.held_blocks import BlockGroup, pack_tokens
from fleet.index import FleetIndex
from fleet.tiers import TIER_ORDER, tier_rank
from tests.fleet_support import pod_batch

BS = 2
PROMPT = [10, 11, 20, 21, 30, 31, 40, 41, 50]  # four whole blocks (hashes 1-4 below) and one token


def block(n: int, medium: str, parent: int | None = None) -> BlockStored:
    """Block n of PROMPT (hash n, tokens PROMPT[2(n-1):2n]) under `parent` (None: the prompt's start)."""
    return BlockStored((n,), parent, tuple(PROMPT[2 * (n - 1) : 2 * n]), BS, medium, 0)


def chain(first: int, last: int, medium: str) -> list[BlockStored]:
    return [block(n, medium, n - 1 if n > 1 else None) for n in range(first, last + 1)]


def index_of(**pods: list[BlockStored]) -> FleetIndex:
    index = FleetIndex(clock=lambda: 1.0)
    for name, events in pods.items():
        index.apply_batch(pod_batch(events, pod=name))
    return index


def served(index: FleetIndex, pod: str, prompt=PROMPT) -> list[tuple[str, int, int]]:
    match = next(match for match in index.route_tiers(prompt).matches if match.pod == pod)
    return [(serve.medium, serve.blocks, serve.tokens) for serve in match.served]


def test_the_disk_tier_serves_from_where_the_pools_hit_stops():
    """The pool holds blocks 1-2; the disk holds 1-4 (block 1 was demoted and promoted again): the pool
    serves two blocks, the disk the next two, not its own copy of the first."""
    index = index_of(a=chain(1, 2, "CPU") + chain(1, 4, "DISK"))
    assert served(index, "a") == [("CPU", 2, 4), ("DISK", 2, 4)]
    match = index.route_tiers(PROMPT).matches[0]
    assert match.matched_tokens == 8
    assert served_sentence(match) == "a: 4 tokens in CPU memory, 4 more on DISK"


def test_a_pod_whose_pool_misses_is_served_from_its_disk_tier_from_the_start():
    index = index_of(b=chain(1, 3, "DISK"))
    assert served(index, "b") == [("DISK", 3, 6)]


def test_tiers_are_walked_fastest_first_whatever_order_their_blocks_arrived_in():
    index = index_of(c=[block(3, "DISK", 2), block(2, "CPU", 1), block(1, "GPU")])
    assert served(index, "c") == [("GPU", 1, 2), ("CPU", 1, 2), ("DISK", 1, 2)]


def test_a_slower_tier_that_lacks_the_block_where_the_faster_stopped_serves_nothing():
    """Block 3 is in neither tier: the disk's block 4 cannot be reached (the engine recomputes from 3)."""
    index = index_of(d=chain(1, 2, "CPU") + [block(4, "DISK", 3)])
    assert served(index, "d") == [("CPU", 2, 4)]


def test_a_fully_held_prompt_of_whole_blocks_is_served_one_block_short():
    """The server computes the last token to sample from it, as `route` caps a match."""
    index = index_of(a=chain(1, 2, "CPU") + chain(3, 4, "DISK"))
    assert served(index, "a", PROMPT[:8]) == [("CPU", 2, 4), ("DISK", 1, 2)]


def test_pods_are_ranked_by_tokens_served_from_any_tier_and_the_frame_shows_each_tier():
    index = index_of(a=chain(1, 1, "GPU"), b=chain(1, 1, "GPU") + chain(2, 3, "CPU"), c=[])
    route = index.route_tiers(PROMPT)
    assert [match.pod for match in route.matches] == ["b", "a", "c"]
    frame = tier_route_frame(route)
    assert list(frame.columns) == ["pod", "cached tokens", "GPU tokens", "CPU tokens", "share of prompt", "stale"]
    assert frame[["pod", "cached tokens", "GPU tokens", "CPU tokens"]].values.tolist() == [
        ["b", 6, 2, 4], ["a", 2, 2, 0], ["c", 0, 0, 0],
    ]  # fmt: skip
    assert served_sentence(route.matches[2]) == "c: nothing cached"


def test_a_twin_in_the_faster_tier_still_leads_into_the_slower_one():
    """Two hashes hold block 1's tokens in the pool; the disk's block 2 hangs from the second."""
    twin = BlockStored((9,), None, tuple(PROMPT[:2]), BS, "CPU", 0)
    index = index_of(a=[block(1, "CPU"), twin, block(2, "DISK", 9)])
    assert served(index, "a") == [("CPU", 1, 2), ("DISK", 1, 2)]


def test_a_walk_from_a_block_goes_on_from_its_tokens():
    group = BlockGroup()
    for event in chain(1, 4, "DISK"):
        group.store(event, 1.0)
    reach = group.walk_from(pack_tokens(PROMPT), ((2, 4),))
    assert (reach.blocks, reach.tokens, reach.ends) == (2, 8, (4,))
    assert group.walk_from(pack_tokens(PROMPT), ((7, 4),)) == (0, 4, (7,))  # nothing hangs from 7
    assert group.walk(pack_tokens(PROMPT)) == (4, 8)


def test_media_are_ordered_by_speed_and_unknown_ones_come_last_by_name():
    media = ["STORAGE", "zz", "DISK", "GPU", "aa", "CPU"]
    assert sorted(media, key=tier_rank) == ["GPU", "CPU", "DISK", "STORAGE", "aa", "zz"]
    assert TIER_ORDER[0] == "GPU"
    assert [where(m) for m in ("GPU", "CPU", "DISK", "STORAGE")] == [
        "in GPU memory", "in CPU memory", "on DISK", "in STORAGE",
    ]  # fmt: skip


def test_held_blocks_per_tier_give_each_pods_share_and_each_tiers():
    pods = pd.DataFrame(
        [
            {"pod": "b", "blocks": 4, "CPU blocks": 1, "DISK blocks": 3},
            {"pod": "a", "blocks": 2, "CPU blocks": 2, "DISK blocks": math.nan},
            {"pod": "c", "blocks": 0},
        ]
    )
    frame = tier_frame(pods)
    assert frame[["pod", "tier", "blocks"]].values.tolist() == [["a", "CPU", 2], ["b", "CPU", 1], ["b", "DISK", 3]]
    assert frame["share of pod"].tolist() == [1.0, 0.25, 0.75]
    assert frame["share of tier"].tolist() == [2 / 3, 1 / 3, 1.0]
    assert tier_frame(pd.DataFrame([{"pod": "c", "blocks": 0}])).empty


def test_the_pods_summary_counts_blocks_per_medium_as_the_tier_frame_reads_them():
    from app.fleet_view import live_pods

    index = index_of(a=chain(1, 2, "CPU") + chain(1, 4, "DISK"))
    frame = tier_frame(live_pods(index.pods(1.0), {}, {}))
    assert frame[["tier", "blocks", "share of pod"]].values.tolist() == [["CPU", 2, 2 / 6], ["DISK", 4, 4 / 6]]
