"""What the disk tier adds to a long-running engine stays bounded by the pool and the tier, not by requests
served (the long run is benchmarks/soak.py --tier-gib): the tier's index, the console's promotion marks
and the KV-event feed's per-key sets, over many prompts through a 12-block pool and a 24-slot tier."""

from __future__ import annotations

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.engine import Engine
from engine.feeds.outbound import translator_for
from tests.engine_support import tokens

GREEDY = SamplingParams(max_new_tokens=2, ignore_eos=True)
POOL = 12


def test_the_tiers_bookkeeping_is_bounded_by_the_pool_and_the_tier(tmp_path) -> None:
    fields = dict(model="tiny-llama", device="cpu", block_size=4, num_blocks=POOL, data_dir=tmp_path)
    probe = Engine(EngineConfig(**fields, offload_dir=tmp_path / "probe", offload_gib=0.001))
    tier_gib = 24 * probe.kv.tier.slot_bytes / (1 << 30)
    probe.close()
    with_tier = dict(offload_dir=tmp_path / "tier", offload_gib=tier_gib, offload_policy="reuse-lru")
    engine = Engine(EngineConfig(**fields, **with_tier))
    translator = translator_for(engine)
    engine.add_listener(lambda events, views: translator.translate(events))
    for i in range(120):  # one shared prefix between new ones: stores, promotions, tier evictions
        prefix = tokens(24, 7) if i % 2 == 0 else tokens(24, 1000 + i)  # 8 blocks a request: the next evicts it
        engine.submit(prefix + tokens(6, 5000 + i), GREEDY)
        engine.run_until_idle()
        engine.stop()  # the writer catches up (and the pool's cached blocks are offered too)
        tier = engine.kv.tier
        assert tier.stats().ready_blocks + tier.stats().writing_blocks <= tier.num_slots
        assert len(tier._pending) == 0 and len(tier._loads) == 0 and not tier._pinned
        assert len(engine._promotions._marks) <= POOL
        assert len(translator._pool_first) <= POOL
        assert len(translator._on_disk) <= tier.num_slots
    stats = engine.stats().tier
    assert stats.stores > tier.num_slots and stats.evictions > 0 and stats.loads > 0, "the workload must churn"
    engine.check_invariants()
    engine.close()
