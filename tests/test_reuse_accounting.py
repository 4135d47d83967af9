"""The engine's reuse counters never claim more than happened (issue 15), counted as vLLM counts them.

Prefix-index hits (vLLM's prefix_cache_queries / prefix_cache_hits, in tokens) are kept apart from
fork sharing and from a preempted request's re-prefill, and a hit counts only the tokens it did not
compute: a sliding-window hit replayed from r = 0 saves nothing.
"""

from __future__ import annotations

from engine.core.config import EngineConfig
from engine.engine import Engine
from engine.core.request import SamplingParams
from tests.engine_support import HYBRID_WINDOW, tokens

ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)


def engine(tmp_path, **overrides) -> Engine:
    fields = dict(model="tiny-llama", device="cpu", block_size=4, num_blocks=64, data_dir=tmp_path)
    return Engine(EngineConfig(**{**fields, **overrides}))


def test_reuse_by_forks_is_fork_sharing_not_a_prefix_hit(tmp_path):
    """Regression: the Overview said 84.7% "prefix hit rate" when all reuse came from forks."""
    e = engine(tmp_path)
    parent = e.submit(tokens(22, 1), SamplingParams(max_new_tokens=3, ignore_eos=True), retain=True)
    e.run_until_idle()
    e.fork_many(parent, [[5], [6]], ONE)
    e.run_until_idle()
    stats = e.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.prefix_hit_rate) == (22, 0, 0.0)
    shared = 22 + 2  # the parent's prompt and the two sampled tokens it fed back
    assert (stats.fork_query_tokens, stats.fork_shared_tokens) == (2 * (shared + 1 + 1), 2 * shared)
    assert stats.tokens_saved == 2 * shared


def test_a_prefix_hit_counts_the_tokens_it_did_not_compute(tmp_path):
    e = engine(tmp_path)
    prompt = tokens(21, 2)
    e.submit(prompt, ONE)
    e.run_until_idle()
    again = e.submit(prompt[:20] + [7, 8], ONE)
    e.run_until_idle()
    stats = e.stats()
    assert e.get(again).cached_tokens == 20
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.tokens_saved) == (21 + 22, 20, 20)
    assert stats.prefix_hit_rate == 20 / 43


def test_a_sliding_window_hit_replayed_from_zero_saves_nothing(tmp_path):
    """Regression: an exact hit with r = 0 recomputed every token, yet the Overview counted its hit
    position (272 tokens, 598 ms of prefill) as saved."""
    e = engine(tmp_path, attention_override=f"hybrid:{HYBRID_WINDOW}")
    prompt = tokens(40, 3)
    e.submit(prompt, ONE)  # its window state stays cached only near its end
    e.run_until_idle()
    b = e.submit(prompt[:24] + tokens(3, 4), ONE)
    e.run_until_idle()
    view = e.get(b)
    assert (view.replay_mode, view.cached_tokens, view.replay_from) == ("exact", 24, 0)
    stats = e.stats()
    assert stats.prefix_hit_tokens == 0 and stats.tokens_saved == 0
    assert stats.replayed_tokens == 24


def test_a_preempted_requests_re_prefill_is_counted_apart_from_prefix_hits(tmp_path):
    """Regression (vLLM #25780's bug): the tokens a preempted request finds again in the cache are its
    own recomputation, not a prefix hit."""
    e = engine(tmp_path, num_blocks=14)
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for i in range(3):
        e.submit(tokens(20, 30 + i), long)
    e.run_until_idle()
    stats = e.stats()
    assert stats.preemptions > 0
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (60, 0)  # distinct prompts: no prefix hit
    # Its own full blocks stayed cached: found again, counted here, not as prefix hits.
    assert 0 < stats.preempted_hit_tokens <= stats.preempted_query_tokens
    assert stats.tokens_saved == 0
