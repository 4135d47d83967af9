"""The fleet index: copies per hash, clears and resets, the cross-pod prefix tree, routing, staleness."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fleet.events import AllBlocksCleared, BlockRemoved, BlockStored, PodReset, ResetReason
from fleet.index import FleetIndex
from fleet.source import PodSource
from tests.fleet_support import pod_batch


def stored(hashes, tokens, parent=None, block_size=4, medium="GPU", group=0) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), block_size, medium, group)


def removed(hashes, medium="GPU", group=0) -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium, group)


def test_a_hash_stored_twice_is_held_until_its_second_removal():
    """Regression guard: vLLM sends one BlockRemoved per physical copy; the first is not the last."""
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1], [1, 2, 3, 4]), stored([1], [1, 2, 3, 4])]))
    assert index.copies("a") == {("GPU", 0, 1): 2}
    index.apply_batch(pod_batch([removed([1])], seq=1))
    assert index.copies("a") == {("GPU", 0, 1): 1}
    assert index.route([1, 2, 3, 4, 5]).matches[0].matched_blocks == 1
    index.apply_batch(pod_batch([removed([1])], seq=2))
    assert index.copies("a") == {}
    assert index.pod("a").num_unknown_removals == 0
    index.check_invariants()


def test_a_removal_of_a_hash_the_pod_does_not_hold_is_counted_and_changes_nothing():
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1], [1, 2, 3, 4]), removed([2]), removed([1], medium="CPU")]))
    assert index.copies("a") == {("GPU", 0, 1): 1}
    assert index.pod("a").num_unknown_removals == 2


def test_the_same_hash_in_another_medium_or_group_is_another_block():
    index = FleetIndex()
    index.apply_batch(
        pod_batch([stored([1], [1] * 4), stored([1], [1] * 4, medium="CPU"), stored([1], [1] * 4, group=1)])
    )
    index.apply_batch(pod_batch([removed([1], medium="CPU")], seq=1))
    assert index.copies("a") == {("GPU", 0, 1): 1, ("GPU", 1, 1): 1}
    summary = index.pod("a")
    assert [(g.medium, g.group_idx, g.num_blocks) for g in summary.groups] == [("GPU", 0, 1), ("GPU", 1, 1)]


def test_all_blocks_cleared_drops_every_medium_and_group_of_that_pod_only():
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1], [1] * 4), stored([2], [2] * 4, medium="CPU", group=1)]))
    index.apply_batch(pod_batch([stored([1], [1] * 4)], pod="b"))
    index.apply_batch(pod_batch([AllBlocksCleared(), stored([3], [3] * 4)], seq=1))
    assert index.copies("a") == {("GPU", 0, 3): 1}
    assert index.copies("b") == {("GPU", 0, 1): 1}
    assert index.pod("a").num_clears == 1


def test_a_reset_pod_starts_from_empty():
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1, 2], list(range(8)))], seq=9))
    index.reset_pod(PodReset("a", ResetReason.RESTARTED, 2.0, 9, 0))
    assert index.copies("a") == {}
    assert index.pod("a").num_resets == 1 and index.pod("a").last_seq is None


def test_blocks_whose_tokens_do_not_split_per_hash_are_held_but_have_no_place_in_the_tree():
    """vLLM skips null (sliding-window) blocks in block_hashes but not in token_ids."""
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1, 2], list(range(12)), group=1)]))
    assert index.copies("a") == {("GPU", 1, 1): 1, ("GPU", 1, 2): 1}
    assert index.pod("a").num_unaligned_stores == 1
    assert index.blocks("a", group_idx=1)[1].token_ids is None
    assert index.route(list(range(12)), group_idx=1).matches[0].matched_blocks == 0
    assert index.prefix_tree(group_idx=1).unreachable == {"a": 2}
    index.check_invariants()


def test_blocks_report_their_parent_tokens_and_store_times():
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1, 2], list(range(8)))], ts=5.0))
    index.apply_batch(pod_batch([stored([2], [4, 5, 6, 7], parent=1)], seq=1, ts=9.0))
    block = index.blocks("a")[2]
    assert (block.copies, block.parent_hash, block.token_ids) == (2, 1, (4, 5, 6, 7))
    assert (block.first_stored, block.last_stored) == (5.0, 9.0)


def test_routing_picks_the_pod_with_the_longest_consecutive_prefix():
    index = FleetIndex()
    prompt = list(range(16))
    index.apply_batch(pod_batch([stored([1, 2, 3], prompt[:12])], pod="a"))
    index.apply_batch(pod_batch([stored([1], prompt[:4]), stored([9], [99] * 4, parent=1)], pod="b"))
    index.apply_batch(pod_batch([stored([1, 2], prompt[:8]), removed([1])], pod="c"))  # its first block is gone
    result = index.route(prompt + [100])
    assert [(m.pod, m.matched_blocks, m.matched_tokens) for m in result.matches] == [
        ("a", 3, 12),
        ("b", 1, 4),
        ("c", 0, 0),
    ]
    assert result.best_pods == ("a",)
    assert index.route([5, 5, 5, 5]).best_pods == ()


def test_routing_follows_every_branch_with_the_same_tokens():
    """Two hashes for the same tokens at the root (different cache salts): the deeper one counts."""
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1], [1] * 4), stored([2, 3], [1] * 4 + [2] * 4)]))
    assert index.route([1] * 4 + [2] * 4 + [0]).matches[0].matched_blocks == 2


def test_routing_chunks_the_prompt_by_each_pods_block_size():
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1], list(range(16)), block_size=16)], pod="big"))
    index.apply_batch(pod_batch([stored([1, 2, 3], list(range(12)))], pod="small"))
    result = index.route(list(range(20)))
    assert [(m.pod, m.matched_tokens) for m in result.matches] == [("big", 16), ("small", 12)]


def test_a_child_whose_parent_was_evicted_is_unreachable_until_the_parent_is_back():
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1, 2], list(range(8))), removed([1])]))
    assert index.route(list(range(9))).matches[0].matched_blocks == 0
    index.apply_batch(pod_batch([stored([1], list(range(4)))], seq=1))
    assert index.route(list(range(9))).matches[0].matched_blocks == 2


def test_the_prefix_tree_merges_pods_by_token_content():
    index = FleetIndex()
    shared, tail_a, tail_b = [1] * 4, [2] * 4, [3] * 4
    index.apply_batch(pod_batch([stored([10, 11], shared + tail_a), stored([10], shared)], pod="a"))
    index.apply_batch(pod_batch([stored([77, 78], shared + tail_b)], pod="b"))  # its own hash function
    tree = index.prefix_tree()
    by_tokens = {node.token_ids: node for node in tree.nodes}
    root = by_tokens[tuple(shared)]
    assert (root.depth, root.parent_id, root.pods, root.replicas, root.copies) == (1, None, {"a", "b"}, 2, 3)
    assert by_tokens[tuple(tail_a)].pods == {"a"} and by_tokens[tuple(tail_a)].num_tokens == 8
    assert by_tokens[tuple(tail_b)].parent_id == root.node_id
    assert not tree.truncated and tree.unreachable == {"a": 0, "b": 0}
    assert index.prefix_tree(max_nodes=1).truncated


def test_a_pod_that_stops_sending_is_stale_and_still_listed():
    now = [100.0]
    index = FleetIndex(stale_after_s=30.0, clock=lambda: now[0])
    index.open_pod(PodSource("quiet", "tcp://127.0.0.1:5557"), at=100.0)
    index.apply_batch(pod_batch([stored([1], [1] * 4)], pod="busy", ts=100.0))
    now[0] = 120.0
    assert [(p.pod, p.stale) for p in index.pods()] == [("busy", False), ("quiet", False)]
    now[0] = 140.0
    assert [(p.pod, p.stale, p.seconds_silent) for p in index.pods()] == [
        ("busy", True, 40.0),
        ("quiet", True, 40.0),
    ]
    assert index.copies("busy") == {("GPU", 0, 1): 1}, "stale is a mark, not a drop"
    assert all(match.stale for match in index.route([1] * 4).matches)


def test_a_fully_cached_prompt_of_whole_blocks_is_predicted_one_block_short_as_vllm_recomputes_its_last_token():
    """Bug 3 of issue 31: vLLM caps a prefix hit at num_tokens - 1, so 8 of 8 cached comes back as 4."""
    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1, 2], list(range(8)))]))
    whole = index.route(list(range(8)))
    assert (whole.max_cached_tokens, whole.matches[0].matched_blocks, whole.matches[0].matched_tokens) == (7, 1, 4)
    assert index.route(list(range(9))).matches[0].matched_tokens == 8, "one token more: both blocks reused"
    assert index.route([0]).matches[0].matched_tokens == 0 and index.route([]).max_cached_tokens == 0


def test_stale_after_must_be_positive():
    with pytest.raises(ValueError):
        FleetIndex(stale_after_s=0)


# --- properties -------------------------------------------------------------------------------

BLOCK = 2  # tokens per block in the model
CHUNKS = [(0, 0), (0, 1)]  # the possible blocks' tokens (few: the same blocks come back often)
MAX_DEPTH = 3
PODS = ["p0", "p1"]
PLACES = [("GPU", 0), ("CPU", 1)]


def path_hash(path: tuple[tuple[int, int], ...]) -> int:
    """A hash per block path (a pod's hash function; the index never sees how it is made)."""
    value = 1
    for chunk in path:
        value = value * 5 + CHUNKS.index(chunk) + 1
    return value


paths = st.lists(st.sampled_from(CHUNKS), min_size=1, max_size=MAX_DEPTH).map(tuple)


class FleetIndexMachine(RuleBasedStateMachine):
    """Random stores, removals, clears and resets against a model: a multiset of held blocks."""

    @initialize()
    def start(self):
        self.index = FleetIndex()
        self.model: Counter[tuple[str, str, int, int]] = Counter()  # (pod, medium, group, hash) -> copies
        self.unknown_removals = Counter()
        self.seq = 0

    def apply(self, pod, events):
        self.index.apply_batch(pod_batch(events, seq=self.seq, pod=pod))
        self.seq += 1

    @rule(
        pod=st.sampled_from(PODS), place=st.sampled_from(PLACES), path=paths, start=st.integers(0, MAX_DEPTH - 1)
    )
    def store_a_chain(self, pod, place, path, start):
        start = min(start, len(path) - 1)
        hashes = [path_hash(path[: depth + 1]) for depth in range(start, len(path))]
        parent = path_hash(path[:start]) if start else None
        tokens = [token for chunk in path[start:] for token in chunk]
        self.apply(pod, [BlockStored(tuple(hashes), parent, tuple(tokens), BLOCK, *place)])
        for block_hash in hashes:
            self.model[(pod, *place, block_hash)] += 1

    @rule(pod=st.sampled_from(PODS), place=st.sampled_from(PLACES), path=paths)
    def remove_one_copy(self, pod, place, path):
        block_hash = path_hash(path)
        self.apply(pod, [BlockRemoved((block_hash,), *place)])
        key = (pod, *place, block_hash)
        if self.model[key]:
            self.model[key] -= 1
        else:
            self.unknown_removals[pod] += 1
        self.model += Counter()  # drop zero counts

    @precondition(lambda self: sum(self.model.values()) > 8)  # only once there is something to drop
    @rule(pod=st.sampled_from(PODS), how=st.sampled_from(["clear", "restart"]))
    def drop_everything(self, pod, how):
        if how == "clear":
            self.apply(pod, [AllBlocksCleared()])
        else:
            self.index.reset_pod(PodReset(pod, ResetReason.RESTARTED, 0.0, None, 0))
        self.model = Counter({key: n for key, n in self.model.items() if key[0] != pod})

    @invariant()
    def copies_match_the_model(self):
        for pod in PODS:
            expected = {key[1:]: n for key, n in self.model.items() if key[0] == pod}
            assert self.index.copies(pod) == expected
            if pod in self.index.pod_names():
                assert self.index.pod(pod).num_unknown_removals == self.unknown_removals[pod]

    @invariant()
    def the_index_is_consistent(self):
        self.index.check_invariants()

    @rule(path=paths, place=st.sampled_from(PLACES))
    def routing_matches_the_longest_fully_held_prefix(self, path, place):
        prompt = [token for chunk in path for token in chunk]
        result = self.index.route(prompt + [7], *place)
        for match in result.matches:
            depth = 0
            while depth < len(path) and self.model[(match.pod, *place, path_hash(path[: depth + 1]))]:
                depth += 1
            assert (match.matched_blocks, match.matched_tokens) == (depth, depth * BLOCK)

    @rule(place=st.sampled_from(PLACES))
    def the_prefix_tree_holds_what_is_reachable(self, place):
        tree = self.index.prefix_tree(*place)
        for node in tree.nodes:
            chain = []
            current = node
            while current is not None:
                chain.append(tuple(current.token_ids))
                current = tree.nodes[current.parent_id] if current.parent_id is not None else None
            path = tuple(reversed(chain))
            holders = {
                pod
                for pod in PODS
                if all(self.model[(pod, *place, path_hash(path[: d + 1]))] for d in range(len(path)))
            }
            assert node.pods == holders
            assert node.copies == sum(self.model[(pod, *place, path_hash(path))] for pod in holders)


FleetIndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_fleet_index_properties = FleetIndexMachine.TestCase
