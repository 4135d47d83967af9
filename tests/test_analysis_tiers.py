"""Two KV tiers in the analyzer: the direct simulation against the one-pass curve (an exclusive tier is one
LRU of pool + tier; this engine's inclusive tier lies between max(pool, tier) and pool + tier), the cost
model's arithmetic, the answer sentence, and `analyze --tier-gib` in JSON and as a table."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import io

from analysis.analyzer import AnalysisConfig, Mode, analyze
from analysis.own_workloads import Keying, read_run_trace
from analysis.policies import Policy
from analysis.readers import load_trace
from analysis.report import to_json
from analysis.sequential import infinite_hit_blocks, simulate
from analysis.stack_distance import lru_curve
from analysis.tier_plan import GIB, DiskModel, TierConfig, TierSize, answer, tier_point
from analysis.tiers import Served, TierRule, TwoTierCache, simulate_tiers
from analysis.timed import ServiceModel
from cli.__main__ import main
from tests.analysis_support import CONVERSATION_SAMPLE, any_chains, prefix_chains, trace_of
from tests.own_workload_support import NAMESPACE, token_prompts

BLOCK = 4  # tests/analysis_support.py's block size


def serve_all(cache: TwoTierCache, chains: list[list[int]]) -> list[Served]:
    served = []
    for chain in chains:
        served.append(cache.serve(chain))
        cache.check_invariants()
    return served


def test_evicted_blocks_are_demoted_and_a_later_request_reads_them_back_from_the_tier():
    # Pool 2, tier 2: r1 evicts [1, 2] tail first into the tier; r2 finds neither in the pool, both in the tier.
    for rule in TierRule:
        cache = TwoTierCache(2, 2, rule)
        assert serve_all(cache, [[1, 2], [3, 4], [1, 2]]) == [Served(0, 0, 0), Served(0, 0, 0), Served(0, 2, 2)]
        assert (cache.loaded, cache.stored) == (2, 2 if rule is TierRule.INCLUSIVE else 4)


def test_this_engines_tier_keeps_promoted_copies_pinned_and_drops_what_finds_no_room():
    """The counterexample to "pool + tier is one LRU of P + D" for an inclusive tier: after r2 promotes
    [1, 2], the tier's two slots hold copies of pool blocks (pinned while r2's demotions are stored), so
    3 and 4 are dropped and r3 misses them; an exclusive tier (and one LRU of 4 blocks) serves them."""
    chains = [[1, 2], [3, 4], [1, 2], [3, 4]]
    inclusive = TwoTierCache(2, 2, TierRule.INCLUSIVE)
    assert serve_all(inclusive, chains)[3] == Served(0, 0, 0)
    assert inclusive.dropped == 2
    exclusive = TwoTierCache(2, 2, TierRule.EXCLUSIVE)
    assert serve_all(exclusive, chains)[3] == Served(0, 2, 2)
    assert lru_curve(trace_of(chains)).hit_blocks(4).tolist() == [0, 0, 2, 2]


def test_this_engines_tier_makes_a_promoted_copy_most_recent_so_it_outlives_older_blocks():
    """Pool 2, tier 3, one block a request. r5 promotes 1 (its copy made most recent, as the engine's
    `plan_loads` does) while 1 is also in the pool; r6's store then evicts 3, not 1, and r7 misses 3."""
    chains = [[1], [2], [3], [4], [5], [1], [6], [3]]
    inclusive = TwoTierCache(2, 3, TierRule.INCLUSIVE)
    assert [s.tier_blocks for s in serve_all(inclusive, chains)] == [0, 0, 0, 0, 0, 1, 0, 0]
    exclusive = TwoTierCache(2, 3, TierRule.EXCLUSIVE)
    assert [s.tier_blocks for s in serve_all(exclusive, chains)] == [0, 0, 0, 0, 0, 1, 0, 1]


def test_a_request_larger_than_the_pool_writes_its_tail_straight_to_the_tier():
    cache = TwoTierCache(1, 3, TierRule.INCLUSIVE)
    assert serve_all(cache, [[1, 2, 3], [1, 2, 3]]) == [Served(0, 0, 0), Served(1, 2, 2)]


@settings(max_examples=300, deadline=None)
@given(chains=st.one_of(prefix_chains(), any_chains()), pool=st.integers(0, 6), tier=st.integers(0, 6))
def test_an_exclusive_tier_is_one_lru_of_pool_plus_tier_request_by_request(chains, pool, tier):
    trace = trace_of(chains)
    curve = lru_curve(trace)
    run = simulate_tiers(trace, pool, tier, TierRule.EXCLUSIVE)
    assert run.pool_hit_blocks.tolist() == curve.hit_blocks(pool).tolist()
    assert run.hit_blocks.tolist() == curve.hit_blocks(pool + tier).tolist()
    assert run.loaded_blocks <= int(run.tier_hit_blocks.sum())


@settings(max_examples=300, deadline=None)
@given(chains=st.one_of(prefix_chains(), any_chains()), pool=st.integers(0, 6), tier=st.integers(0, 6))
def test_this_engines_tier_lies_between_one_lru_of_the_larger_tier_and_one_of_both(chains, pool, tier):
    trace = trace_of(chains)
    curve = lru_curve(trace)
    run = simulate_tiers(trace, pool, tier, TierRule.INCLUSIVE)
    assert run.pool_hit_blocks.tolist() == curve.hit_blocks(pool).tolist()
    hits = run.hit_blocks
    assert (curve.hit_blocks(max(pool, tier)) <= hits).all()
    assert (hits <= curve.hit_blocks(pool + tier)).all()
    assert (hits <= infinite_hit_blocks(trace)).all()


@settings(max_examples=200, deadline=None)
@given(chains=prefix_chains(), pool=st.integers(0, 5), tier=st.integers(0, 5))
def test_a_larger_tier_never_hits_less_under_either_rule(chains, pool, tier):
    trace = trace_of(chains)
    for rule in TierRule:
        smaller = simulate_tiers(trace, pool, tier, rule).hit_blocks.sum()
        assert simulate_tiers(trace, pool, tier + 1, rule).hit_blocks.sum() >= smaller, rule


def test_a_tier_of_nothing_is_the_pool_alone_which_is_the_engines_block_pool():
    trace = load_trace(CONVERSATION_SAMPLE)
    for rule in TierRule:
        run = simulate_tiers(trace, 40, 0, rule)
        assert run.tier_hit_blocks.sum() == run.loaded_blocks == run.stored_blocks == 0
        assert run.pool_hit_blocks.tolist() == simulate(trace, Policy.LRU, 40).hit_blocks.tolist()


def test_on_a_mooncake_sample_the_curve_gives_the_exclusive_answer_and_bounds_the_engines():
    trace = load_trace(CONVERSATION_SAMPLE).split(128)
    curve = lru_curve(trace)
    for pool, tier in ((50, 200), (200, 50), (300, 300)):
        exclusive = simulate_tiers(trace, pool, tier, TierRule.EXCLUSIVE)
        inclusive = simulate_tiers(trace, pool, tier, TierRule.INCLUSIVE)
        assert trace.hit_tokens(exclusive.hit_blocks).sum() == curve.hit_tokens(pool + tier)
        engine = trace.hit_tokens(inclusive.hit_blocks).sum()
        assert curve.hit_tokens(max(pool, tier)) <= engine <= curve.hit_tokens(pool + tier)


def test_sizes_and_bandwidths_are_bounded():
    with pytest.raises(ValueError, match="KV bytes per token"):
        DiskModel(0)
    with pytest.raises(ValueError, match="disk bandwidth"):
        DiskModel(100, float("nan"))
    with pytest.raises(ValueError, match="disk tier must be in"):
        TierSize(16, -1.0)
    with pytest.raises(ValueError, match="named twice"):
        TierConfig((8.0, 8.0), DiskModel(100))
    with pytest.raises(ValueError, match="sequential mode only"):
        AnalysisConfig((64,), (Policy.LRU,), mode=Mode.TIMED, tiers=TierConfig((1.0,), DiskModel(100)))
    with pytest.raises(ValueError, match=">= 0 blocks"):
        TwoTierCache(-1, 0, TierRule.INCLUSIVE)


def test_the_cost_model_prices_loads_at_the_disk_bandwidth_against_prefill_at_the_service_rate():
    # Pool 2 blocks, tier 2 blocks (of 4 tokens, 1,000 bytes a token: 4,000 bytes a block). r2 reads 2
    # blocks from the tier: 8 tokens of prefill at 2 tokens/s saved (4 s), 8,000 bytes at 1e-3 GB/s read
    # (0.008 s). Requests arrive 1 s apart: 2 s of trace.
    trace = trace_of([[1, 2], [3, 4], [1, 2]])
    disk = DiskModel(1000, 1e-3)
    tier_gib = 2 * 4000 / GIB
    assert disk.tier_blocks(tier_gib, BLOCK) == 2 and disk.tier_blocks(tier_gib * 0.999, BLOCK) == 1
    point = tier_point(lru_curve(trace), TierSize(8, tier_gib), disk, ServiceModel(prefill_tokens_per_s=2.0))
    assert (point.pool_blocks, point.tier_blocks) == (2, 2)
    assert (point.pool_hit_tokens, point.hit_tokens, point.floor_hit_tokens) == (0, 8, 0)
    assert (point.tier_hit_tokens, point.loaded_blocks) == (8, 2)
    assert point.prefill_s_saved == 4.0 and point.load_s == pytest.approx(0.008)
    assert point.net_prefill_s_per_trace_hour == pytest.approx((4.0 - 0.008) * 1800)
    assert (point.pool_alone_tokens, point.pool_alone_kv_gib) == (16, pytest.approx(16_000 / GIB))
    sentence = answer(point)
    assert "hit ratio 0.000 -> 0.333" in sentence and "7,186 prefill seconds saved per hour" in sentence
    assert "less 14.4 s of tier loads" in sentence and "the pool alone needs 16 tokens" in sentence


def test_a_disk_slower_than_prefill_saves_negative_time():
    trace = trace_of([[1, 2], [3, 4], [1, 2]])
    slow = tier_point(lru_curve(trace), TierSize(8, 1.0), DiskModel(10**6, 1e-3), ServiceModel(prefill_tokens_per_s=1e6))
    assert slow.tier_hit_tokens == 8 and slow.net_prefill_s < 0


def test_the_analysis_adds_a_row_per_capacity_and_tier_with_the_engines_rule_simulated_when_asked():
    trace = load_trace(CONVERSATION_SAMPLE)
    tiers = TierConfig((0.5, 2.0), DiskModel(46_080), simulate=True)
    analysis = analyze(trace, AnalysisConfig((51_200, 512_000), (Policy.OPT,), tiers=tiers))
    assert [(p.size.pool_tokens, p.size.tier_gib) for p in analysis.tiers] == [
        (51_200, 0.5), (51_200, 2.0), (512_000, 0.5), (512_000, 2.0),
    ]  # fmt: skip
    curve = lru_curve(trace)
    for point in analysis.tiers:
        assert point.hit_tokens == curve.hit_tokens(point.pool_blocks + point.tier_blocks)
        assert point.floor_hit_tokens <= point.simulated_hit_tokens <= point.hit_tokens
    report = json.loads(json.dumps(to_json(analysis), allow_nan=False))
    assert report["disk"] == {"kv_bytes_per_token": 46_080, "disk_gbps": 2.0}
    assert report["tiers"][1]["answer"].startswith("add 2 GiB of disk tier (")
    assert analyze(trace, AnalysisConfig((51_200,), (Policy.LRU,))).tiers == ()


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["analyze", str(CONVERSATION_SAMPLE), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_tier_gib_adds_the_two_tier_rows_to_the_json_and_the_table(capsys):
    code, out, err = run_cli(capsys, "--capacity-tokens", "100k", "--policies", "lru", "--tier-gib", "1,4",
                             "--disk-gbps", "3", "--kv-bytes-per-token", "23040", "--json")  # fmt: skip
    assert (code, err) == (0, "")
    rows = json.loads(out)["tiers"]
    assert [(row["pool_tokens"], row["tier_gib"]) for row in rows] == [(100_000, 1.0), (100_000, 4.0)]
    assert rows[0]["tier_blocks"] == GIB // (23_040 * 512) and rows[0]["simulated_hit_ratio"] is None
    assert rows[0]["pool_hit_ratio"] <= rows[0]["hit_ratio"] <= rows[1]["hit_ratio"]
    code, out, _ = run_cli(capsys, "--capacity-tokens", "100k", "--policies", "lru", "--tier-gib", "1", "--tier-simulate")
    assert code == 0 and "disk tier behind an LRU pool (46,080 KV bytes a token, read at 2 GB/s)" in out
    row = out.splitlines()[out.splitlines().index(next(line for line in out.splitlines() if "pool alone for" in line)) + 1]
    assert row.split()[:2] == ["100,000", "1"] and row.split()[5] != "-"


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tier-gib", "8,x"), "--tier-gib: 'x' is not a number of GiB"),
        (("--tier-gib", "-1"), "a disk tier must be in [0, 16384] GiB"),
        (("--disk-gbps", "2"), "go with --tier-gib"),
        (("--tier-gib", "1", "--disk-gbps", "0"), "disk bandwidth must be in"),
        (("--tier-gib", "1", "--mode", "timed"), "sequential mode only"),
    ],
)
def test_cli_refuses_bad_tier_options_with_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, "--capacity-tokens", "100k", *args)
    assert code == 2 and out == "" and message in err


def test_loaded_blocks_count_the_references_the_tier_adds():
    trace = load_trace(CONVERSATION_SAMPLE)
    curve = lru_curve(trace)
    point = tier_point(curve, TierSize(51_200, 1.0), DiskModel(46_080), ServiceModel())
    exclusive = simulate_tiers(trace, point.pool_blocks, point.tier_blocks, TierRule.EXCLUSIVE)
    assert point.loaded_blocks == int(np.sum(exclusive.tier_hit_blocks)) == exclusive.loaded_blocks


def test_an_own_workload_keyed_as_the_engine_keys_it_gets_the_same_two_tier_answers():
    """A run-trace workload (the engine's chain keys, full blocks only, tenant salts): the curve gives the
    exclusive tier exactly and bounds the engine's, and the analysis's rows split the tokens by tier."""
    lines = [{"op": "submit", "id": f"r{i}", "tokens": tokens, **({"salt": salt} if salt else {})}
             for i, (tokens, salt) in enumerate(token_prompts(60, seed=3))]  # fmt: skip
    trace = read_run_trace(io.BytesIO("\n".join(map(json.dumps, lines)).encode()), Keying(NAMESPACE, None))
    curve = lru_curve(trace)
    for pool, tier in ((2, 3), (4, 2), (0, 5)):
        exclusive = simulate_tiers(trace, pool, tier, TierRule.EXCLUSIVE)
        assert exclusive.hit_blocks.tolist() == curve.hit_blocks(pool + tier).tolist()
        inclusive = simulate_tiers(trace, pool, tier, TierRule.INCLUSIVE).hit_blocks
        assert (curve.hit_blocks(max(pool, tier)) <= inclusive).all() and (inclusive <= curve.hit_blocks(pool + tier)).all()
    disk = DiskModel(1000)
    analysis = analyze(trace, AnalysisConfig((8,), (Policy.LRU,), tiers=TierConfig((3 * 4000 / GIB,), disk)))
    row = to_json(analysis)["tiers"][0]
    assert (row["pool_blocks"], row["tier_blocks"]) == (2, 3)
    assert row["pool_hit_tokens"] == curve.hit_tokens(2) and row["hit_tokens"] == curve.hit_tokens(5)
    assert row["tier_hit_tokens"] == row["hit_tokens"] - row["pool_hit_tokens"] > 0
