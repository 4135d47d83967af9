"""Both KV tiers in the console (issue 44): the Blocks page's disk tier section and its marks on the grid, the
Overview's per-tier numbers and its flag of a tier that stores and never loads, and the Settings fields
that give the console's engine a disk tier."""

from __future__ import annotations

import json
import time

import pytest

from app.charts import PROMOTED_NAME
from app.hosting import config_from_env
from app.tiers import IDLE_TIER_STORES, TIER_OFF, check_offload, idle_tier_warning
from engine.core.kv_tier import TierStats
from engine.core.request import SamplingParams
from tests.test_app_support import console_env, errors, host, no_exceptions, open_page, texts, wait_idle  # noqa: F401

PARAMS = SamplingParams(max_new_tokens=2, ignore_eos=True)
IDLE = "paying for its disk without serving a hit"
POOL = 8  # blocks of 16: a 100-token prompt takes 7, so the next one evicts the last one's


@pytest.fixture
def tiered(console_env, tmp_path, monkeypatch):
    """The console's engine with a 1 MiB disk tier under a pool of POOL blocks."""
    monkeypatch.setenv("PREFIX_CONSOLE_OFFLOAD_DIR", str(tmp_path / "tier"))
    monkeypatch.setenv("PREFIX_CONSOLE_OFFLOAD_GIB", "0.001")
    console_env(num_blocks=POOL)


def prompt(seed: int, length: int = 100) -> list[int]:
    return [(seed * 7919 + i * 31) % 900 + 10 for i in range(length)]


def run(token_ids: list[int]):
    engine = host().console.engine
    rid = engine.submit(token_ids, PARAMS)
    wait_idle()
    return engine.get(rid)


def settle_stores() -> None:
    """Steps until the tier's writer thread has reported every store (they are written off the step, and a
    step takes the finished ones in)."""
    engine = host().console.engine
    for _ in range(100):
        time.sleep(0.1)
        run(prompt(900, 3))  # no full block, nothing cached: from the second time on it evicts nothing
        tier = engine.stats().tier
        if tier.stores and not tier.writing_blocks:
            return
    raise AssertionError("the tier's writer reported no store")


def promote_one_prompt():
    """Prompt A, then B (which evicts A's blocks to disk), then A again: returns A's second view."""
    run(prompt(1))
    run(prompt(2))
    settle_stores()
    again = run(prompt(1))
    assert again.disk_cached_tokens > 0, "the second A must be served from disk for these tests to mean anything"
    return again


def grid_traces(at) -> dict[str, dict]:
    grid = json.loads(at.get("plotly_chart")[0].proto.spec)
    return {trace.get("name"): trace for trace in grid["data"]}


def test_without_a_tier_the_blocks_page_says_it_is_off_and_how_to_turn_it_on(console_env):
    at = open_page("blocks")
    no_exceptions(at)
    assert TIER_OFF in texts(at) and "--offload-dir" in TIER_OFF and "Settings" in TIER_OFF
    assert PROMOTED_NAME not in grid_traces(at)


def test_the_blocks_page_lists_the_disk_tier_and_marks_the_blocks_promoted_from_it(tiered):
    again = promote_one_prompt()
    first = (again.cached_tokens - again.disk_cached_tokens) // 16
    promoted = sorted(again.block_table[first : first + again.disk_cached_tokens // 16])
    stats = host().console.engine.stats().tier
    at = open_page("blocks")
    no_exceptions(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Ready blocks"] == f"{stats.ready_blocks:,}" and int(metrics["Slots"]) == stats.num_slots
    table = next(d.value for d in at.dataframe if "LRU rank" in d.value.columns)
    assert len(table) == stats.ready_blocks > 0 and list(table["LRU rank"]) == list(range(1, len(table) + 1))
    assert f"(full group): **{', '.join(map(str, promoted))}**" in texts(at)
    trace = grid_traces(at)[PROMOTED_NAME]
    columns = json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]["xaxis"]["range"][1] + 0.5
    assert sorted(round(y) * int(columns) + round(x) for x, y in zip(trace["x"], trace["y"])) == promoted

    at.number_input(key="blocks_inspect_id").set_value(promoted[0]).run()
    assert "**Promoted from the disk tier** at step" in texts(at)
    other = next(b for b in range(POOL) if b not in promoted)
    at.number_input(key="blocks_inspect_id").set_value(other).run()
    assert "Promoted from the disk tier" not in texts(at)


def test_the_overview_shows_both_tiers_and_the_hits_each_served(tiered):
    promote_one_prompt()
    stats = host().console.engine.stats()
    at = open_page("overview")
    no_exceptions(at)
    table = next(t.value for t in at.table if "tier" in t.value.columns)
    rows = {row["tier"]: row for row in table.to_dict("records")}
    assert set(rows) == {"memory (KV pool)", "disk"}
    assert rows["disk"]["hit tokens"] == f"{stats.tier_hit_tokens:,}" and stats.tier_hit_tokens > 0
    assert rows["disk"]["loads"] == f"{stats.tier.loads:,}" and rows["disk"]["stores"] == f"{stats.tier.stores:,}"
    memory = stats.prefix_hit_tokens - stats.tier_hit_tokens
    assert rows["memory (KV pool)"]["hit tokens"] == f"{memory:,}"
    assert f"from memory {memory:,} · disk {stats.tier_hit_tokens:,} tokens" in texts(at)
    assert not any(IDLE in w.value for w in at.warning)


def test_the_overview_flags_a_tier_that_stores_and_never_loads(tiered):
    engine = host().console.engine
    seed = 10
    while engine.stats().tier.stores <= IDLE_TIER_STORES:  # distinct prompts: nothing comes back
        run(prompt(seed))
        seed += 1
        assert seed < 60, "the tier never stored enough blocks"
    assert engine.stats().tier.loads == 0
    at = open_page("overview")
    no_exceptions(at)
    assert any(IDLE in w.value for w in at.warning)


def test_the_idle_flag_waits_for_enough_stores_and_clears_with_one_load():
    def tier(stores: int, loads: int) -> TierStats:
        return TierStats(num_slots=64, ready_blocks=min(stores, 64), writing_blocks=0, hit_tokens=16 * loads, stores=stores,
                         loads=loads, bytes_written=stores * 4096, bytes_read=loads * 4096, drops=0, corrupt=0, evictions=0)  # fmt: skip

    assert idle_tier_warning(None) is None
    assert idle_tier_warning(tier(IDLE_TIER_STORES, 0)) is None
    assert IDLE in idle_tier_warning(tier(IDLE_TIER_STORES + 1, 0))
    assert idle_tier_warning(tier(1000, 1)) is None


def test_settings_gives_the_engine_a_disk_tier(console_env, tmp_path):
    at = open_page("settings")
    values = dict(zip(at.table[0].value["setting"], at.table[0].value["value"]))
    assert values["disk KV tier"].startswith("off")
    at.text_input(key="settings_offload_dir").input(str(tmp_path / "new-tier"))
    at.number_input(key="settings_offload_gib").set_value(0.001)
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert not errors(at)
    assert f"a 0.001 GiB disk tier in `{tmp_path / 'new-tier'}`" in texts(at)
    at.button(key="settings_restart_confirm").click().run()
    no_exceptions(at)
    engine = host().console.engine
    assert engine.config.offload_dir == tmp_path / "new-tier" and engine.config.offload_gib == 0.001
    assert engine.stats().tier is not None and (tmp_path / "new-tier").is_dir()
    values = dict(zip(at.table[0].value["setting"], at.table[0].value["value"]))
    assert values["disk KV tier"].startswith(f"{tmp_path / 'new-tier'}, 0.001 GiB (")


@pytest.mark.parametrize(
    ("directory", "gib", "message"),
    [
        ("{tmp}/tier", 0.0, "more than 0 and at most 1,024 GiB, got 0"),
        ("{tmp}/tier", 2048.0, "at most 1,024 GiB, got 2048"),
        ("{tmp}/a-file/tier", 1.0, "is not a directory"),
        ("/proc/prefix-console-tier", 0.001, "cannot be made or written"),
        ("{tmp}/tier", 1024.0, "free for the tier, not 1024 GiB"),  # a test machine has less than 1 TiB free
    ],
)
def test_settings_refuses_a_disk_tier_it_cannot_have_and_changes_nothing(console_env, tmp_path, directory, gib, message):
    (tmp_path / "a-file").write_text("not a directory")
    old = host().console
    at = open_page("settings")
    at.text_input(key="settings_offload_dir").input(directory.format(tmp=tmp_path))
    at.number_input(key="settings_offload_gib").set_value(gib)
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert len(errors(at)) == 1 and errors(at)[0].startswith("Not restarted: ") and message in errors(at)[0]
    assert host().console is old and not any(b.key == "settings_restart_confirm" for b in at.button)


def test_a_blank_directory_means_no_tier_and_checking_makes_nothing(tmp_path):
    assert check_offload("  ", 5.0) is None
    assert check_offload(str(tmp_path / "x" / "y"), 0.001) == (tmp_path / "x" / "y", 0.001)
    assert not (tmp_path / "x").exists()


def test_the_embedded_engine_takes_its_disk_tier_from_the_environment(tmp_path):
    config = config_from_env({"PREFIX_CONSOLE_OFFLOAD_DIR": str(tmp_path / "t"), "PREFIX_CONSOLE_OFFLOAD_GIB": "0.5"})
    assert (config.offload_dir, config.offload_gib) == (tmp_path / "t", 0.5)
    assert config_from_env({}).offload_dir is None  # off by default
    with pytest.raises(ValueError, match="PREFIX_CONSOLE_OFFLOAD_GIB must be a number of GiB, got 'lots'"):
        config_from_env({"PREFIX_CONSOLE_OFFLOAD_DIR": str(tmp_path), "PREFIX_CONSOLE_OFFLOAD_GIB": "lots"})
    with pytest.raises(ValueError, match="together"):
        config_from_env({"PREFIX_CONSOLE_OFFLOAD_DIR": str(tmp_path)})
