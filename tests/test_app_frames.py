"""The console's plain functions (no Streamlit, no engine): frames, prompt parsing, grid geometry."""

from __future__ import annotations

import dataclasses

import pytest

from app import charts
from app.frames import (
    align_tables, block_category, evictions_per_minute, history_frame, prefill_seconds_per_token, prefix_chain, prefix_tree,
    utc_csv, window_drops,
)  # fmt: skip
from app.hosting import config_from_env
from app.prompting import TOKEN_IDS, parse_suffixes, parse_token_ids
from engine.core.snapshot import BlockView, PoolStats, RequestView


def block(block_id: int, *, state: str = "free", ref: int = 0, key: str | None = None, parent: str | None = None, start: int = 0, hits: int = 0) -> BlockView:
    return BlockView(
        block_id=block_id, group="full", state=state, ref_count=ref, num_tokens=4, token_ids=(1, 2, 3, 4), key=key,
        parent_key=parent, start_pos=start, created_at=0.0, last_used=0.0, hit_count=hits, holders=(),
    )


def request(rid: str, table: tuple[int, ...], **fields) -> RequestView:
    """A view with defaults for every field; `table` is the full group's block table."""
    defaults = dict.fromkeys(RequestView._fields)
    base = dict(
        request_id=rid, parent_id=None, status="running", retain=False, salt=None, prompt_token_ids=(), output_token_ids=(),
        num_prompt_tokens=0, num_computed_tokens=0, cached_tokens=0, computed_tokens=0, hit_source="none", cow_copies=0,
        preemptions=0, finish_reason=None, arrival_time=0.0, first_scheduled_time=None, first_token_time=None,
        finish_time=None, block_tables={"full": table}, max_new_tokens=4,
    )  # fmt: skip
    return RequestView(**{**defaults, **base, **fields})


def stats(evictions: int) -> PoolStats:
    counters = {f.name: 0 for f in dataclasses.fields(PoolStats) if f.name != "groups"}
    return PoolStats(**{**counters, "num_blocks": 8, "block_size": 4, "evictions": evictions})


def test_block_categories_cap_the_reference_count():
    assert [block_category(block(0)), block_category(block(0, state="evictable", key="k"))] == ["free", "cached (evictable)"]
    assert block_category(block(0, state="referenced", ref=3)) == "referenced ×3"
    assert block_category(block(0, state="referenced", ref=9)) == "referenced ×4+"


def test_evictions_per_minute_uses_the_sample_a_minute_back():
    samples = [(0.0, stats(0)), (30.0, stats(5)), (50.0, stats(8))]
    assert evictions_per_minute(samples, stats(14), now=90.0) == pytest.approx((14 - 5) * 60 / 60)
    assert evictions_per_minute(samples, stats(8), now=40.0) == pytest.approx(8 * 60 / 40)  # younger than a minute
    assert evictions_per_minute([], stats(3), now=10.0) is None


def test_prefill_rate_ignores_preempted_and_unscheduled_requests():
    done = request("a", (), first_scheduled_time=10.0, first_token_time=10.5, computed_tokens=100)
    preempted = request("b", (), first_scheduled_time=10.0, first_token_time=20.0, computed_tokens=10, preemptions=1)
    waiting = request("c", ())
    assert prefill_seconds_per_token([done, preempted, waiting]) == pytest.approx(0.005)
    assert prefill_seconds_per_token([waiting]) is None


def test_aligned_tables_show_sharing_and_the_copy_on_write_column():
    parent, child, other = request("p", (0, 1, 2)), request("c", (0, 1, 5, 6), parent_id="p"), request("o", (7,))
    alignment = align_tables([child, other, parent])
    assert alignment.request_ids == ["o", "p", "c"]  # a parent comes before its children
    assert alignment.block_ids == [[7, None, None, None], [0, 1, 2, None], [0, 1, 5, 6]]
    assert alignment.shared == [[1, 0, 0, 0], [2, 2, 1, 0], [2, 2, 1, 1]]
    # Each row is compared with its parent, not with whichever request came first (issue 15).
    assert alignment.compared_with == {"o": None, "p": None, "c": "p"}
    assert alignment.divergence == {"o": None, "p": None, "c": 2}


def test_a_released_row_keeps_its_table_but_shares_nothing():
    """Regression: a released request's row still shaded the blocks it once held as shared."""
    parent = request("p", (0, 1), status="released")
    child = request("c", (0, 3), parent_id="p", status="retained")
    alignment = align_tables([parent, child])
    assert alignment.holding == [False, True]
    assert alignment.shared == [[0, 0], [1, 1]]
    assert alignment.divergence == {"p": None, "c": 1}


def test_prefix_tree_orders_parents_first_and_respects_the_limit():
    blocks = [
        block(0, state="evictable", key="a", parent="root", start=0, hits=1),
        block(1, state="evictable", key="b", parent="a", start=4),
        block(2, state="evictable", key="c", parent="a", start=4, hits=5),
        block(3, state="evictable", key="d", parent="c", start=8),
        block(4),
    ]
    nodes, roots, dropped = prefix_tree(blocks, limit=10)
    assert roots == ["root"] and dropped == 0
    assert [n.key for n in nodes] == ["a", "c", "b", "d"]  # breadth first, most hit first
    nodes, _, dropped = prefix_tree(blocks, limit=2)
    assert [n.key for n in nodes] == ["a", "c"] and dropped == 2
    assert [b.key for b in prefix_chain(blocks, "d")] == ["a", "c", "d"]


def test_grid_geometry_round_trips_block_ids():
    for num_blocks in (1, 24, 1000, 16384):
        cols = charts.grid_columns(num_blocks)
        assert 1 <= cols <= 128
        for block_id in (0, num_blocks // 2, num_blocks - 1):
            assert charts.block_at(block_id % cols, block_id // cols, cols) == block_id


def test_a_16k_block_grid_is_one_figure_with_one_trace_per_state():
    blocks = [block(i, state="referenced", ref=1 + i % 3) if i % 2 else block(i) for i in range(16384)]
    figure = charts.block_grid(blocks, block_size=16, selected=7)
    assert [t.type for t in figure.data] == ["scattergl"] * 4 + ["scatter"]
    assert sum(len(t.x) for t in figure.data[:4]) == 16384


def test_token_ids_and_suffixes_parse_or_say_why_not():
    assert parse_token_ids("[1, 2 3,4]") == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="integers"):
        parse_token_ids("1 two")
    with pytest.raises(ValueError, match="outside"):
        parse_token_ids("1 600", vocab_size=512)
    assert parse_suffixes(None, TOKEN_IDS, "1 2\n\n3") == [[1, 2], [3]]
    with pytest.raises(ValueError, match="suffix line 2"):
        parse_suffixes(None, TOKEN_IDS, "1\nx")
    with pytest.raises(ValueError, match="no tokenizer"):
        parse_suffixes(None, "Plain text", "hello")


def test_config_from_env_reads_and_validates():
    config = config_from_env({"PREFIX_CONSOLE_MODEL": "tiny-llama", "PREFIX_CONSOLE_NUM_BLOCKS": "32", "PREFIX_CONSOLE_BLOCK_SIZE": "8"})
    assert (config.model, config.num_blocks, config.block_size) == ("tiny-llama", 32, 8)
    assert config_from_env({}).model == "smollm2"
    with pytest.raises(ValueError, match="PREFIX_CONSOLE_BLOCK_SIZE must be an integer"):
        config_from_env({"PREFIX_CONSOLE_BLOCK_SIZE": "big"})
    with pytest.raises(ValueError, match="block_size must be in"):
        config_from_env({"PREFIX_CONSOLE_BLOCK_SIZE": "0"})
    assert dataclasses.is_dataclass(config)


def test_window_drops_are_counted_apart_from_capacity_evictions():
    """Regression: on a nearly empty pool, Evictions / min read 59.1, every one a sliding-window drop."""
    samples = [(0.0, dataclasses.replace(stats(0), window_evictions=0))]
    now = dataclasses.replace(stats(50), window_evictions=42)  # 42 window drops, 8 capacity evictions
    assert evictions_per_minute(samples, now, now=60.0) == pytest.approx(8.0)
    assert evictions_per_minute(samples, now, now=60.0, count=window_drops) == pytest.approx(42.0)
    frame = history_frame([(0.0, now)])
    assert (frame["evictions"][0], frame["window drops"][0]) == (8, 42)


def test_the_engine_counts_its_window_drops_among_its_evictions_and_apart(tmp_path):
    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.engine import Engine
    from tests.engine_support import HYBRID_WINDOW, tokens

    engine = Engine(EngineConfig(model="tiny-llama", attention_override=f"hybrid:{HYBRID_WINDOW}", device="cpu",
                                 block_size=4, num_blocks=64, data_dir=tmp_path))  # fmt: skip
    engine.submit(tokens(10, 40), SamplingParams(max_new_tokens=24, ignore_eos=True))
    engine.run_until_idle()
    stats = engine.stats()
    assert stats.window_evictions > 0, "a long request leaves window state behind it"
    assert stats.evictions - stats.window_evictions == 0, "nothing was evicted for room in a 64-block pool"


def test_csv_exports_write_times_in_utc_as_the_pages_show_them():
    exported = "id,time,reason,last_used\n1,1764893519.265,lru,\n2,0,reset,5.5\n"
    assert utc_csv(exported).splitlines() == [
        "id,time,reason,last_used",
        "1,2025-12-05T00:11:59.265Z,lru,",
        "2,1970-01-01T00:00:00.000Z,reset,1970-01-01T00:00:05.500Z",
    ]


def test_counts_agree_with_their_nouns_and_the_api_line_says_when_there_is_none():
    """Regression (issue 47, item 15): the sidebar said "1 threads" and Submit "1 full blocks of 16"."""
    from app.ui import api_text, plural

    assert [plural(1, "thread"), plural(4, "thread"), plural(1_024, "full block")] == ["1 thread", "4 threads", "1,024 full blocks"]
    assert plural(0, "copy", "copies") == "0 copies"
    assert api_text(None) == "no API"
    assert api_text("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"


def test_settings_says_how_long_the_forward_stepped_at_each_thread_count():
    """Issue 47 item 16: the governor's moves were invisible in the console."""
    from app.ui import threads_text

    assert threads_text(2, {}) == "2 now"
    assert threads_text(1, {1: 3.0, 2: 41.0}) == "1 now; stepped 41.0 s on 2, 3.0 s on 1"
    assert threads_text(2, {1: 0.0, 2: 5.0}) == "2 now; stepped 5.0 s on 2"
