"""The collector against bad feeds: each fault is counted, the collector keeps going, the index stays right.

The feeds are raw ZeroMQ sockets on loopback speaking the wire format message by message
(`HandFeed`), so a test can lose, garble, reorder or restart exactly what it means to.
"""

from __future__ import annotations

import time
from dataclasses import replace

import msgspec
import pytest

from fleet.collector import Collector
from fleet.config import CollectorConfig
from fleet.pod_stats import PodStats
from fleet.decode import DecodeLimits, FeedErrorKind
from fleet.index import FleetIndex
from tests.fleet_support import HandFeed, StallingSink, encode_batch, removed_map, stored_map, wait_until

FAST = CollectorConfig(
    replay_idle_timeout_s=0.3,
    replay_backoff_s=0.01,
    replay_backoff_max_s=0.02,
    poll_interval_s=0.01,
    idle_replay_after_s=60.0,
)


@pytest.fixture
def feed():
    hand_feed = HandFeed()
    yield hand_feed
    hand_feed.close()


def start(feed: HandFeed, config: CollectorConfig = FAST, replay: bool = True) -> tuple[Collector, FleetIndex]:
    index = FleetIndex()
    collector = Collector([feed.source(replay=replay)], [index], config)
    collector.start()
    feed.wait_for_subscriber()
    wait_until(lambda: stats(collector).ready, "the start-up replay to be over")
    wait_until(lambda: "a" in index.pod_names(), "the pod to be opened")
    return collector, index


def applied(index: FleetIndex, seq: int):
    return lambda: index.pod("a").last_seq == seq


def stats(collector: Collector) -> PodStats:
    return collector.stats()["a"]


def test_garbage_frames_are_counted_and_the_next_batch_still_applies(feed):
    collector, index = start(feed)
    try:
        feed.send_frames([b"kv-events", b"only two frames"])
        feed.send_frames([b"kv-events", b"\x00" * 7, b"a seven-byte sequence number"])
        feed.send_frames([b"kv-events", (-3).to_bytes(8, "big", signed=True), b"a negative one"])
        feed.send(0, encode_batch([stored_map([1], [1, 2, 3, 4])]))
        wait_until(applied(index, 0), "the good batch")
        assert stats(collector).errors == {FeedErrorKind.BAD_FRAMES: 3}
        assert index.copies("a") == {("GPU", 0, 1): 1}
    finally:
        collector.stop()


def test_a_payload_that_is_not_msgpack_or_truncated_is_refused_whole(feed):
    collector, index = start(feed)
    try:
        feed.send(0, b"\xc1 not msgpack")
        feed.send(1, encode_batch([stored_map([1, 2], list(range(8)))])[:-5])
        feed.send(2, msgspec.msgpack.encode({"ts": 1.0}))  # msgpack, but not an EventBatch
        feed.send(3, encode_batch([stored_map([3], [9, 9, 9, 9])]))
        wait_until(applied(index, 3), "the good batch")
        assert stats(collector).errors == {FeedErrorKind.MALFORMED: 3}
        assert index.copies("a") == {("GPU", 0, 3): 1}, "nothing of the refused batches was applied"
        assert stats(collector).num_lost_batches == 0, "a refused batch is an error, not a loss"
    finally:
        collector.stop()


def test_an_unknown_event_type_is_skipped_and_the_rest_of_its_batch_applies(feed):
    collector, index = start(feed)
    try:
        events = [{"type": "BlockPinned", "block_hashes": [5]}, stored_map([6], [1, 1, 1, 1]), ["Future", 1, 2]]
        feed.send(0, encode_batch(events))
        wait_until(applied(index, 0), "the batch")
        assert stats(collector).num_unknown_events == 2
        assert index.pod("a").num_unknown_events == 2
        assert index.copies("a") == {("GPU", 0, 6): 1}
        assert stats(collector).num_errors == 0
    finally:
        collector.stop()


def test_a_bad_event_of_a_known_type_refuses_its_whole_batch(feed):
    collector, index = start(feed)
    try:
        bad = stored_map([8], [1, 2, 3, -4])  # a negative token id
        feed.send(0, encode_batch([stored_map([7], [1, 2, 3, 4]), bad]))
        feed.send(1, encode_batch([{"type": "BlockRemoved", "block_hashes": [1.5]}]))
        feed.send(2, encode_batch([removed_map([7])]))
        wait_until(applied(index, 2), "the last batch")
        assert stats(collector).errors == {FeedErrorKind.BAD_EVENT: 2}
        assert index.copies("a") == {}
        assert index.pod("a").num_unknown_removals == 1, "7 was never stored: its batch was refused"
        index.check_invariants()
    finally:
        collector.stop()


def test_payloads_and_counts_over_the_limits_are_refused(feed):
    limits = DecodeLimits(
        max_payload_bytes=2_000, max_events_per_batch=3, max_blocks_per_event=4, max_block_size=8
    )
    config = replace(FAST, limits=limits)
    collector, index = start(feed, config)
    try:
        feed.send(0, encode_batch([stored_map([1], [0] * 4)] * 4))  # 4 events
        feed.send(1, encode_batch([stored_map([1, 2, 3, 4, 5], [0] * 20)]))  # 5 blocks
        feed.send(2, encode_batch([stored_map([1], [0] * 16, block_size=16)]))  # 16 tokens a block
        feed.send(3, encode_batch([stored_map([1], [0] * 4), "x" * 3_000]))  # 3 kB
        feed.send(4, encode_batch([stored_map([9], [0] * 4)]))
        wait_until(applied(index, 4), "the good batch")
        assert stats(collector).errors == {FeedErrorKind.OVER_LIMIT: 3, FeedErrorKind.TOO_LARGE: 1}
        assert index.copies("a") == {("GPU", 0, 9): 1}
    finally:
        collector.stop()


def test_a_frame_far_over_the_bound_drops_the_connection_unread_and_the_collector_resubscribes(feed):
    """ZeroMQ itself does not reconnect after that protocol error: the collector makes a new socket."""
    config = replace(FAST, limits=DecodeLimits(max_payload_bytes=2_000), resubscribe_after_s=0.2)
    collector, index = start(feed, config)
    try:
        feed.send(0, encode_batch(["x" * 50_000]))  # over 2 x max_payload_bytes: not even read
        feed.wait_for_subscriber()  # the new SUB socket's
        feed.send(1, encode_batch([stored_map([1], [1] * 4)]))
        wait_until(applied(index, 1), "the next good batch")
        pod_stats = stats(collector)
        assert pod_stats.num_disconnects >= 1 and pod_stats.num_resubscribes >= 1
        assert index.copies("a") == {("GPU", 0, 1): 1}
    finally:
        collector.stop()


def test_a_gap_is_recovered_through_a_replay_socket_that_sends_the_topic_frame(feed):
    collector, index = start(feed)
    try:
        feed.send(0, encode_batch([stored_map([1], [1, 1, 1, 1])]))
        feed.send(1, encode_batch([stored_map([2], [2, 2, 2, 2], parent=1)]), live=False)
        feed.send(2, encode_batch([removed_map([1])]), live=False)
        feed.send(3, encode_batch([stored_map([3], [3, 3, 3, 3], parent=2)]))
        wait_until(applied(index, 3), "the batch after the gap")
        assert stats(collector).num_gaps == 1
        assert stats(collector).num_replayed_batches == 2
        assert stats(collector).num_lost_batches == 0
        assert index.copies("a") == {("GPU", 0, 2): 1, ("GPU", 0, 3): 1}
    finally:
        collector.stop()


def test_a_gap_is_recovered_through_a_replay_socket_without_the_topic_frame():
    feed = HandFeed(replay_mode="legacy")
    collector, index = start(feed)
    try:
        feed.send(0, encode_batch([stored_map([1], [1, 1, 1, 1])]))
        feed.send(1, encode_batch([stored_map([2], [2, 2, 2, 2], parent=1)]), live=False)
        feed.send(2, encode_batch([stored_map([3], [3, 3, 3, 3], parent=2)]))
        wait_until(applied(index, 2), "the batch after the gap")
        assert stats(collector).num_replayed_batches == 1
        assert index.route([1] * 4 + [2] * 4 + [3] * 4 + [0]).matches[0].matched_blocks == 3
    finally:
        collector.stop()
        feed.close()


def test_a_replay_socket_that_never_answers_times_out_and_the_collector_goes_on():
    feed = HandFeed(replay_mode="silent")
    collector, index = start(feed)
    try:
        wait_until(lambda: stats(collector).num_replay_timeouts == 1, "the start-up replay to time out")
        time.sleep(0.05)  # past the backoff (at most 0.02 s in FAST) after a timed-out replay
        feed.send(0, encode_batch([stored_map([1], [1, 1, 1, 1])]))
        feed.send(1, encode_batch([stored_map([2], [2, 2, 2, 2], parent=1)]), live=False)
        feed.send(2, encode_batch([stored_map([3], [3, 3, 3, 3], parent=2)]))
        wait_until(applied(index, 2), "the batch after the unanswered gap")
        feed.send(3, encode_batch([removed_map([3])]))
        wait_until(applied(index, 3), "the next batch")
        pod_stats = stats(collector)
        assert pod_stats.num_replay_timeouts == 2
        assert pod_stats.num_lost_batches == 1
        assert feed.num_replay_requests == 2
        assert index.copies("a") == {("GPU", 0, 1): 1}
        assert index.route([1] * 4 + [2] * 4).matches[0].matched_blocks == 1, "block 2 was lost"
        index.check_invariants()
    finally:
        collector.stop()
        feed.close()


def test_after_a_timed_out_replay_the_next_waits_for_the_backoff():
    feed = HandFeed(replay_mode="silent")
    collector, index = start(feed, replace(FAST, replay_backoff_s=30.0, replay_backoff_max_s=60.0))
    try:
        feed.send(0, encode_batch([stored_map([1], [1] * 4)]), live=False)
        feed.send(1, encode_batch([stored_map([2], [2] * 4)]))
        wait_until(applied(index, 1), "the batch after the gap")
        pod_stats = stats(collector)
        assert (pod_stats.num_replay_timeouts, pod_stats.num_replays_skipped) == (1, 1)
        assert feed.num_replay_requests == 1, "no second request inside the backoff"
    finally:
        collector.stop()
        feed.close()


def test_a_sequence_that_jumps_back_is_a_restarted_server_and_resets_the_pod(feed):
    collector, index = start(feed)
    try:
        for seq in range(3):
            feed.send(seq, encode_batch([stored_map([10 + seq], [seq] * 4)]))
        wait_until(applied(index, 2), "the first server's batches")
        feed.replace_history([])  # the new process's replay buffer
        feed.send(0, encode_batch([stored_map([99], [7] * 4)]))
        wait_until(lambda: stats(collector).num_restarts == 1, "the restart")
        wait_until(applied(index, 0), "the new server's batch")
        assert index.copies("a") == {("GPU", 0, 99): 1}
        assert index.pod("a").num_resets == 1
        feed.send(1, encode_batch([removed_map([99])]))
        wait_until(applied(index, 1), "the next batch of the new server")
        assert index.copies("a") == {}
        assert stats(collector).num_lost_batches == 0
    finally:
        collector.stop()


def test_a_server_that_restarted_and_overtook_the_old_numbers_is_seen_by_the_replayed_batch(feed):
    """The sequence alone cannot show it: the new server's seq 4 looks like a gap after the old seq 1.
    The replay from seq 1 shows a different batch under 1 than the one applied."""
    collector, index = start(feed)
    try:
        feed.send(0, encode_batch([stored_map([1], [1] * 4)]))
        feed.send(1, encode_batch([stored_map([2], [2] * 4, parent=1)]))
        wait_until(applied(index, 1), "the old server's batches")
        new_history = [(seq, encode_batch([stored_map([100 + seq], [seq] * 4)])) for seq in range(4)]
        feed.replace_history(new_history)
        feed.send(4, encode_batch([stored_map([104], [4] * 4)]))
        wait_until(applied(index, 4), "the new server's batch")
        assert stats(collector).num_restarts == 1
        assert index.copies("a") == {("GPU", 0, 100 + seq): 1 for seq in range(5)}
    finally:
        collector.stop()


def test_live_batches_already_replayed_at_start_are_dropped_as_duplicates(feed):
    second = encode_batch([stored_map([2], [2] * 4)])
    feed.send(0, encode_batch([stored_map([1], [1] * 4)]), live=False)
    feed.send(1, second, live=False)
    collector, index = start(feed)
    try:
        wait_until(applied(index, 1), "the start-up replay")
        feed.send_frames([feed.topic, (1).to_bytes(8, "big"), second])  # the same bytes, as a server resends
        feed.send(2, encode_batch([removed_map([2])]))
        wait_until(applied(index, 2), "the next live batch")
        assert stats(collector).num_duplicates == 1
        assert stats(collector).num_restarts == 0
        assert index.copies("a") == {("GPU", 0, 1): 1}
    finally:
        collector.stop()


def test_a_feed_without_a_replay_socket_counts_what_it_missed_before_joining(feed):
    collector, index = start(feed, replay=False)
    try:
        feed.send(5, encode_batch([stored_map([1], [1] * 4)]))
        wait_until(applied(index, 5), "the first batch seen")
        assert stats(collector).num_lost_batches == 5
        assert stats(collector).num_replays_skipped == 1
    finally:
        collector.stop()


def test_messages_under_another_topic_are_dropped(feed):
    collector, index = start(feed)
    try:
        feed.send_frames([b"kv-events-other", (0).to_bytes(8, "big"), encode_batch([stored_map([1], [1] * 4)])])
        feed.send(0, encode_batch([stored_map([2], [2] * 4)]))
        wait_until(applied(index, 0), "the batch")
        assert stats(collector).num_wrong_topic == 1
        assert index.copies("a") == {("GPU", 0, 2): 1}
    finally:
        collector.stop()


def test_a_quiet_feed_is_asked_for_batches_it_lost_at_its_end(feed):
    config = replace(FAST, idle_replay_after_s=0.2)
    collector, index = start(feed, config)
    try:
        feed.send(0, encode_batch([stored_map([1], [1] * 4)]))
        feed.send(1, encode_batch([stored_map([2], [2] * 4, parent=1)]), live=False)
        wait_until(applied(index, 1), "the lost last batch, by the quiet-feed check")
        assert stats(collector).num_replayed_batches == 1
    finally:
        collector.stop()


def test_a_batch_lost_right_after_the_start_up_replay_is_asked_for_once_the_feed_is_quiet(feed):
    """No live batch follows it, so no gap shows it: the quiet-feed check, armed by the start, finds it."""
    config = replace(FAST, idle_replay_after_s=3.0)  # the batch is "lost" well before the check
    collector, index = start(feed, config)
    try:
        feed.send(0, encode_batch([stored_map([1], [1] * 4)]), live=False)
        wait_until(applied(index, 0), "the lost first batch, by the quiet-feed check")
        assert stats(collector).num_replays == 2 and stats(collector).num_replayed_batches == 1
    finally:
        collector.stop()


def test_a_sink_that_raises_is_counted_and_the_other_sinks_still_get_every_batch(feed):
    class Broken:
        def open_pod(self, source, at):
            pass

        def apply_batch(self, batch):
            raise RuntimeError("broken sink")

        def reset_pod(self, reset):
            pass

        def pod_status(self, status):
            pass

        def apply_metrics(self, metrics):
            pass

    index = FleetIndex()
    collector = Collector([feed.source()], [Broken(), index], FAST)
    with collector:
        feed.wait_for_subscriber()
        feed.send(0, encode_batch([stored_map([1], [1] * 4)]))
        wait_until(lambda: "a" in index.pod_names() and index.pod("a").last_seq == 0, "the batch")
    assert collector.num_sink_errors == 1


def test_stop_returns_promptly_and_ends_every_thread(feed):
    collector, _ = start(feed)
    began = time.monotonic()
    assert collector.stop() is True  # everything queued was handed over
    assert time.monotonic() - began < 2.0
    assert not any(thread.is_alive() for thread in collector._threads + [collector._dispatcher])
    assert collector.stop() is True  # idempotent


def test_stop_does_not_wait_forever_on_a_sink_that_takes_nothing(feed):
    """A storage sink whose database takes no rows holds the dispatcher, and the full queue the pod
    threads: stop gives up after its timeout and says so; the dispatcher ends once the sink is released."""
    stall = StallingSink()
    collector = Collector([feed.source()], [stall], replace(FAST, queue_size=2))
    collector.start()
    feed.wait_for_subscriber()
    for seq in range(6):
        feed.send(seq, encode_batch([stored_map([seq + 1], [1] * 4)]))
    wait_until(lambda: collector.num_queued == 2, "the queue to fill behind the stalled sink")
    began = time.monotonic()
    assert collector.stop(timeout_s=0.3) is False
    assert time.monotonic() - began < 2.0
    assert not any(thread.is_alive() for thread in collector._threads)
    stall.release.set()
    wait_until(lambda: not collector._dispatcher.is_alive(), "the dispatcher to hand over the rest and end")
    assert collector.stop() is True and collector.num_queued == 0


def test_the_queue_holds_at_most_max_queued_bytes_of_payloads(feed):
    """Servers sending large batches fill the queue by bytes before its record count: with room for three
    payloads, three wait behind a stalled sink (one is in its hands, one decoded in the pod thread waits
    for room, the rest wait in ZeroMQ), and all ten arrive in order once it lets them through."""
    payloads = [encode_batch([stored_map([seq + 1], [1] * 4)]) for seq in range(10)]
    stall, index = StallingSink(), FleetIndex()
    config = replace(FAST, queue_size=100, max_queued_bytes=3 * max(map(len, payloads)))
    collector = Collector([feed.source()], [stall, index], config)
    collector.start()
    try:
        feed.wait_for_subscriber()
        for seq, payload in enumerate(payloads):
            feed.send(seq, payload)
        wait_until(lambda: collector.num_queued == 3, "three batches to wait")
        time.sleep(0.3)
        assert collector.num_queued == 3 and stats(collector).num_batches == 5
        stall.release.set()
        wait_until(applied(index, 9), "every batch to arrive")
        assert stats(collector).num_lost_batches == 0
    finally:
        stall.release.set()
        collector.stop()


def test_pod_names_must_be_unique(feed):
    with pytest.raises(ValueError, match="unique"):
        Collector([feed.source("a"), feed.source("a")], [])
