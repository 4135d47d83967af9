"""The Overview's reuse numbers never over-claim (issue 15): each headline is what its label says.

Prefix-cache hits are vLLM's (prompt tokens of new requests found in the prefix index and not
computed), fork sharing is its own number, tokens saved are tokens not computed (a sliding-window hit
replayed from 0 saves nothing), and a preempted request's re-prefill is not a prefix hit.
"""

from __future__ import annotations

from engine.core.request import SamplingParams
from tests.test_app_support import console_env, host, no_exceptions, open_page, texts, wait_idle  # noqa: F401

ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)


def metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def test_reuse_that_came_from_forks_is_fork_sharing_not_a_prefix_hit(console_env):
    """Regression: the Overview said 84.7% "prefix hit rate" when all reuse came from forks, while the
    block inspector said "Prefix hits 0" for the same blocks."""
    engine = host().console.engine
    parent = engine.submit(list(range(100, 164)), SamplingParams(max_new_tokens=4, ignore_eos=True), retain=True)
    wait_idle()
    engine.fork_many(parent, [[5], [6], [7]], ONE)
    wait_idle()
    at = open_page("overview")
    no_exceptions(at)
    values = metrics(at)
    stats = engine.stats()
    assert values["Prefix-cache hit rate"] == "0.0%"
    assert "0 of 64 prompt tokens" in texts(at)
    assert values["Fork sharing"] == f"{stats.fork_share_rate:.1%}" and stats.fork_shared_tokens == 3 * (64 + 3)
    assert values["Tokens saved"] == f"{3 * (64 + 3):,}"


def test_a_sliding_window_hit_replayed_from_zero_saves_nothing(console_env):
    """Regression: an exact hit with r = 0 recomputed every token, yet the Overview counted its 272 hit
    tokens (and 598 ms of prefill) as saved."""
    console_env(block_size=4, attention="hybrid:8")
    engine = host().console.engine
    prefix = list(range(100, 140))
    engine.submit(prefix, ONE, request_id="doc")
    wait_idle()
    engine.submit(prefix[:36] + [7, 8, 9], ONE, request_id="reader")
    wait_idle()
    view = engine.get("reader")
    assert (view.replay_mode, view.cached_tokens, view.replay_from) == ("exact", 36, 0)
    at = open_page("overview")
    values = metrics(at)
    assert values["Tokens saved"] == "0" and values["Prefill time saved"] in ("0 ms", "—")
    assert values["Prefix-cache hit rate"] == "0.0%" and values["Replayed tokens"] == "36"


def test_a_preempted_requests_re_prefill_is_not_a_prefix_hit(console_env):
    """Regression (vLLM #25780's bug): a preempted request that finds its own blocks again on
    re-admission was counted as a prefix hit."""
    console_env(num_blocks=14, block_size=4)
    engine = host().console.engine
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.submit([300 + 40 * i + j for j in range(20)], long)
    wait_idle()
    stats = engine.stats()
    assert stats.preemptions > 0
    at = open_page("overview")
    values = metrics(at)
    assert values["Prefix-cache hit rate"] == "0.0%" and values["Tokens saved"] == "0"
    assert values["Re-prefill from cache"] == f"{stats.preempted_hit_tokens:,}"
    assert f"of {stats.preempted_query_tokens:,} tokens looked up again after preemption" in texts(at)
    assert stats.preempted_query_tokens > 0
