"""The disk tier in the engine's snapshot (engine/core/tier_view.py): its newest blocks, bounded, and the pool
blocks promoted from it in their current life; and the snapshot crossing the console's route."""

from __future__ import annotations

import time

from engine.core.events import Event, EventKind, TierReason
from engine.core.snapshot import EngineSnapshot
from engine.core.tier_view import FIRST_TOKENS, KEY_HEX, PromotionMarks, tier_view
from serving.console_routes import decode, encode
from tests.engine_support import tokens
from tests.test_kv_tier import BS, TIER_GIB, engine, first_prompt_again, run

KEY = "ab" * 16


def event(kind: EventKind, detail: dict, block_id: int | None = None, step: int = 1) -> Event:
    return Event(kind, step, 0.0, None, block_id, 0, detail)


def promote(block_ids: list[int], keys: list[str], step: int = 1) -> Event:
    return event(EventKind.PROMOTE, {"block_ids": block_ids, "keys": keys, "slots": list(range(len(block_ids)))}, block_ids[0], step)


def test_a_promotion_marks_its_blocks_until_their_life_ends():
    marks = PromotionMarks("full")
    keys = [f"{i:02x}" * 16 for i in range(4)]
    marks.on_events([event(EventKind.ALLOCATE, {"block_ids": [3, 4, 5, 6], "group": "full"}), promote([3, 4, 5, 6], keys, step=7)])
    assert [(m.block_id, m.step, m.slot, m.key) for m in marks.marks()] == [
        (3, 7, 0, keys[0][:KEY_HEX]), (4, 7, 1, keys[1][:KEY_HEX]), (5, 7, 2, keys[2][:KEY_HEX]), (6, 7, 3, keys[3][:KEY_HEX]),
    ]  # fmt: skip
    marks.on_events([
        event(EventKind.ALLOCATE, {"block_ids": [3], "group": "sliding"}),  # another pool's block 3: still marked
        event(EventKind.ALLOCATE, {"block_ids": [4], "group": "full"}),  # handed out again: a new life
        event(EventKind.EVICT, {"group": "full", "reason": "lru"}, block_id=5),  # its key dropped
        event(EventKind.TIER_EVICT, {"key": keys[3], "slot": 3, "reason": TierReason.CORRUPT.value}),  # block 6's bytes were bad
    ])  # fmt: skip
    assert [m.block_id for m in marks.marks()] == [3]
    marks.on_events([event(EventKind.TIER_EVICT, {"key": keys[0], "slot": 0, "reason": TierReason.LRU.value})])
    assert [m.block_id for m in marks.marks()] == [3], "the tier giving up its copy does not undo a promotion"


def test_the_marks_are_bounded_by_the_pool():
    marks = PromotionMarks("full")
    for step in range(50):
        marks.on_events([promote([step % 4], [KEY], step=step)])
    assert [m.block_id for m in marks.marks()] == [0, 1, 2, 3]
    assert marks.marks()[0].step == 48


def test_the_snapshot_lists_the_tiers_blocks_and_marks_the_promoted_pool_blocks(tmp_path):
    e = engine(tmp_path, tier=True)
    again = first_prompt_again(e)
    snapshot = e.snapshot()
    tier, stats = snapshot.tier, snapshot.stats.tier
    assert tier is not None and stats is not None and len(tier.blocks) == stats.ready_blocks > 0
    entries = e.kv.tier.entries(len(tier.blocks))
    assert [(b.key, b.slot, b.stamp) for b in tier.blocks] == [(x.key.hex()[:KEY_HEX], x.slot, x.stamp) for x in entries]
    assert all(b.first_token_ids == x.token_ids[:FIRST_TOKENS] for b, x in zip(tier.blocks, entries))
    first = (again.cached_tokens - again.disk_cached_tokens) // BS
    promoted = again.block_table[first : first + again.disk_cached_tokens // BS]
    assert again.disk_cached_tokens > 0 and [p.block_id for p in tier.promoted] == sorted(promoted)
    assert tier.group == "full"

    later = run(e, tokens(30, 3))  # evicts most of the pool: blocks handed out again lose their mark
    reused = set(later.block_table) & set(promoted)
    assert reused, "the third prompt must reuse a promoted block for this test to mean anything"
    assert not reused & {p.block_id for p in e.snapshot().tier.promoted}
    e.stop()


def test_a_tier_view_lists_at_most_its_limit_most_recently_used_first(tmp_path):
    e = engine(tmp_path, tier=True)
    first_prompt_again(e)
    view = tier_view(e.kv, PromotionMarks("full"), limit=2)
    assert view is not None and len(view.blocks) == 2 < e.stats().tier.ready_blocks
    assert view.blocks == e.snapshot().tier.blocks[:2]
    assert tier_view(e.kv, None) is None


def test_an_engine_without_a_tier_snapshots_none(tmp_path):
    e = engine(tmp_path, tier=False)
    assert e.snapshot().tier is None


def test_the_tier_view_crosses_the_console_route_unchanged(tmp_path, test_data_dir):
    """Through a real engine server: the engine process's snapshot, msgpack on /engine/snapshot, decoded by
    the console's RemoteEngine, carries the tier's blocks and the promoted pool blocks."""
    from tests.serving_support import MODEL, serve, shut

    served = serve(test_data_dir, num_blocks=9, offload_dir=tmp_path / "tier", offload_gib=TIER_GIB)
    try:
        def complete(prompt: list[int]):
            return served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})

        first = tokens(100, 1)
        complete(first)
        complete(tokens(100, 2))  # evicts the first prompt's blocks to the tier
        time.sleep(0.5)  # the tier's writer stores them off the step
        complete(tokens(3, 3))  # a step that takes the finished stores in
        again = complete(first)
        disk = again.usage.prompt_tokens_details.cached_tokens_by_tier["disk"]
        deadline = time.monotonic() + 30
        snapshot = served.engine.snapshot()
        while not snapshot.stats.tier.loads and time.monotonic() < deadline:  # a snapshot may be a second old
            time.sleep(0.1)
            snapshot = served.engine.snapshot()
        assert isinstance(snapshot, EngineSnapshot) and snapshot.tier is not None
        assert len(snapshot.tier.blocks) == snapshot.stats.tier.ready_blocks > 0
        assert disk > 0 and len(snapshot.tier.promoted) * 16 == disk
        view = served.engine.get(again.id)
        assert {p.block_id for p in snapshot.tier.promoted} <= set(view.block_table)
        assert decode(encode(snapshot), EngineSnapshot) == snapshot
    finally:
        shut(served)
