"""Helpers for the fleet tests: loopback endpoints, waiting, a hand-driven feed, and a vLLM pod.

`VllmPod` is vLLM 0.33's own `KVCacheManager` (prefix caching and KV events on) publishing through
vLLM's own `ZmqEventPublisher`: the tests drive allocate / free / prefix hits / evictions / reset on it
and compare the collector's index with the hashes vLLM's block pool holds. It is imported lazily, so
the tests that do not need vLLM run without it. `fleet_console` (a fixture) serves the console watching
two of them, for the real-browser test.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from fleet.events import BatchOrigin, BlockHash, EventBatch, KVEvent, PodBatch
from fleet.source import PodSource
from tests.browser_support import serve_console
from tests.ports import free_port

TOPIC = "kv-events"


def bind_loopback(sock: zmq.Socket) -> int:
    """Bind `sock` to a loopback port the kernel picks (no window for another bind to take it); its port."""
    sock.bind("tcp://127.0.0.1:*")
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


def wait_port_free(port: int, timeout_s: float = 5.0) -> None:
    """Wait until a loopback port can be bound again (ZeroMQ closes a socket's listener asynchronously)."""

    def free() -> bool:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    wait_until(free, f"port {port} to be released", timeout_s)


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Poll `predicate` until it holds; fail the test naming `what` if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


class StallingSink:
    """A sink that holds the dispatcher in its first batch until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()  # set to let batches through

    def open_pod(self, source: PodSource, at: float) -> None:
        pass

    def apply_batch(self, batch: PodBatch) -> None:
        self.release.wait(10)

    def reset_pod(self, reset: object) -> None:
        pass

    def pod_status(self, status: object) -> None:
        pass

    def apply_metrics(self, metrics: object) -> None:
        pass


def pod_batch(events: Iterable[KVEvent], seq: int = 0, pod: str = "a", ts: float = 1.0) -> PodBatch:
    """A decoded batch as the collector would hand it on (for index tests)."""
    return PodBatch(pod, seq, EventBatch(ts, tuple(events), 0), ts, BatchOrigin.LIVE)


# --- a hand-driven feed: raw ZeroMQ sockets speaking the wire format ---------------------------


def encode_batch(events: list[object], ts: float | None = None, rank: int | None = 0) -> bytes:
    """An EventBatch payload: `[ts, events, rank]` in MessagePack; events are maps or arrays as given."""
    batch: list[object] = [time.time() if ts is None else ts, events]
    if rank is not None:
        batch.append(rank)
    return msgspec.msgpack.encode(batch)


def stored_map(
    hashes: list[BlockHash], tokens: list[int], parent: BlockHash | None = None, block_size: int = 4
) -> dict:
    """A BlockStored the way vLLM 0.33 encodes it."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


def removed_map(hashes: list[BlockHash]) -> dict:
    """A BlockRemoved the way vLLM 0.33 encodes it."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


class HandFeed:
    """A PUB socket and a replay ROUTER on loopback ports, driven message by message by the test.

    The ROUTER is served by a thread of its own, as a server's publisher thread does. `replay_mode`
    says how it answers: "vllm" (topic frame in replies, as vLLM >= 0.26 and SGLang 0.5.23),
    "legacy" (no topic frame, as older vLLM and SGLang) or "silent" (never answers).
    """

    def __init__(self, replay_mode: str = "vllm", topic: str = TOPIC) -> None:
        self.replay_mode = replay_mode  # how the replay socket answers
        self.topic = topic.encode()  # the topic frame
        self.num_replay_requests = 0  # replay requests received
        self._published: list[tuple[int, bytes]] = []  # (seq, payload) the replay socket offers
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.context = zmq.Context()
        try:
            # An XPUB is a PUB that also hands up its subscribers' subscriptions: `wait_for_subscriber`
            # knows when a message sent now reaches the collector.
            self.pub = self.context.socket(zmq.XPUB)
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.port = bind_loopback(self.pub)
            router = self.context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_port = bind_loopback(router)
        except BaseException:
            # Left to the garbage collector, a context whose sockets are still open hangs the process
            # in `term` (its socket list is weak and cleared first).
            self.context.destroy(linger=0)
            raise
        self._server = threading.Thread(target=self._serve, args=(router,), daemon=True)
        self._server.start()

    def source(self, name: str = "a", replay: bool = True) -> PodSource:
        """The PodSource a collector watches this feed with (without its replay socket if not `replay`)."""
        replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}" if replay else None
        return PodSource(name, f"tcp://127.0.0.1:{self.port}", replay_endpoint, topic=self.topic.decode())

    def wait_for_subscriber(self, timeout_s: float = 15.0) -> None:
        """Block until a subscriber's subscription has reached the PUB socket."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.pub.poll(50) and self.pub.recv().startswith(b"\x01"):
                return
        raise AssertionError("no subscriber subscribed")

    def send(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        """Offer (seq, payload) for replay and, if `live`, publish it (else it is "lost" on the way)."""
        with self._lock:
            self._published.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def send_frames(self, frames: list[bytes]) -> None:
        """Publish raw frames, whatever their shape."""
        self.pub.send_multipart(frames)

    def replace_history(self, published: list[tuple[int, bytes]]) -> None:
        """What the replay socket offers from now on (a restarted server's buffer)."""
        with self._lock:
            self._published = list(published)

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(20):
                    continue
                identity, _, start = router.recv_multipart()
                self.num_replay_requests += 1
                if self.replay_mode == "silent":
                    continue
                first = int.from_bytes(start, "big")
                with self._lock:
                    wanted = [(seq, payload) for seq, payload in self._published if seq >= first]
                for seq, payload in wanted:
                    router.send_multipart([identity, b"", *self._reply(seq, payload)])
                router.send_multipart([identity, b"", *self._reply(-1, b"")])
        finally:
            router.close(linger=0)

    def _reply(self, seq: int, payload: bytes) -> list[bytes]:
        seq_bytes = seq.to_bytes(8, "big", signed=True)
        if self.replay_mode == "legacy":
            return [seq_bytes, payload]
        return [b"" if seq < 0 else self.topic, seq_bytes, payload]

    def close(self) -> None:
        self._stop.set()
        self._server.join(5)
        self.pub.close(linger=0)
        self.context.term()


# --- vLLM ---------------------------------------------------------------------------------------


class VllmPod:
    """vLLM's KVCacheManager with KV events on, publishing each step through vLLM's ZmqEventPublisher.

    A "step" is what a vLLM engine step does to the cache for the requests it touches; `publish`
    then sends that step's `take_events()` as one KVEventBatch, as vLLM's scheduler does.
    """

    def __init__(
        self,
        name: str = "vllm-0",
        num_blocks: int = 16,
        block_size: int = 4,
        pub_endpoint: str | None = None,
        replay_port: int | None = None,
        hwm: int = 100_000,
        sliding_window_blocks: int | None = None,
    ) -> None:
        """Args:
        name: the pod's name.
        num_blocks: blocks in vLLM's pool (one is vLLM's null block).
        block_size: tokens per block.
        pub_endpoint: the PUB socket's bind address (default: an ephemeral loopback port).
        replay_port: the replay socket's loopback port (default: a free one).
        hwm: the PUB socket's high-water mark (vLLM's `hwm`): what a slow subscriber may lag by.
        sliding_window_blocks: add a second KV group, sliding-window attention over this many blocks
            (a hybrid model: group 0 full attention, group 1 the window).
        """
        import torch
        from vllm.distributed.kv_events import ZmqEventPublisher
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        init_none_hash(sha256)
        self.name = name
        self.block_size = block_size
        shape = {"block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
        groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(**shape))]
        if sliding_window_blocks is not None:
            window = SlidingWindowSpec(**shape, sliding_window=sliding_window_blocks * block_size)
            groups.append(KVCacheGroupSpec(["window"], window))
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.manager = KVCacheManager(
            config,
            max_model_len=4096,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.replay_port = replay_port or free_port()
        # vLLM binds a PUB endpoint only when it has a wildcard: "tcp://127.0.0.1:*" is loopback, port
        # chosen by ZeroMQ (which vLLM does not report; the bound socket does).
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=pub_endpoint or "tcp://127.0.0.1:*",
            replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}",
            topic=TOPIC,
            hwm=hwm,
        )
        self.endpoint = self.publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_published = 0  # batches published; the last one's seq is num_published - 1
        self._num_requests = 0

    def source(self) -> PodSource:
        """The PodSource a collector watches this pod with."""
        return PodSource(self.name, self.endpoint, f"tcp://127.0.0.1:{self.replay_port}", topic=TOPIC)

    def request(self, token_ids: list[int]):
        """A vLLM Request for a prompt, its block hashes computed by vLLM's hasher."""
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=64)
        params.update_from_generation_config({}, eos_token_id=100_000)
        self._num_requests += 1
        return Request(
            request_id=str(self._num_requests),
            prompt_token_ids=token_ids,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block_size, sha256),
        )

    def lookup(self, request):
        """The scheduler's prefix lookup: (computed blocks, their tokens)."""
        blocks, num_tokens, _ = self.manager.get_computed_blocks(request)
        return blocks, num_tokens

    def allocate(self, request, lookup=None) -> None:
        """Allocate (and cache) the prompt after its prefix hit, as one prefill step does."""
        blocks, num_cached = lookup if lookup is not None else self.lookup(request)
        allocated = self.manager.allocate_slots(request, request.num_tokens - num_cached, num_cached, blocks)
        if allocated is None:
            raise RuntimeError(f"vLLM could not allocate {request.num_tokens} tokens")
        request.num_computed_tokens = request.num_tokens

    def decode(self, request, token_ids: list[int]) -> None:
        """Append generated tokens one decode step each (a block that fills is cached)."""
        for token_id in token_ids:
            request.append_output_token_ids(token_id)
            if self.manager.allocate_slots(request, 1) is None:
                raise RuntimeError("vLLM could not allocate a decode slot")
            request.num_computed_tokens = request.num_tokens

    def free(self, request) -> None:
        """The request finished: vLLM frees its blocks (cached ones stay cached, no event)."""
        self.manager.free(request)

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache (refused while blocks are in use)."""
        return self.manager.reset_prefix_cache()

    def publish(self) -> int:
        """Publish this step's events as one batch; returns how many events (0: nothing published)."""
        from vllm.distributed.kv_events import KVEventBatch

        events = self.manager.take_events()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.num_published += 1
        return len(events)

    def wait_sent(self) -> None:
        """Wait until vLLM's publisher thread has sent every published batch and buffered it for replay.

        That thread takes one batch off its queue per turn and serves a replay request first: a
        subscriber that asks for a replay while batches are still queued gets only those sent so far.
        """
        wait_until(lambda: len(self.publisher._buffer) == self.num_published, "vLLM's publisher to send its queue")

    def cached(self) -> dict[tuple[str, int, int], int]:
        """What vLLM's block pool caches: physical blocks per (medium, group, published hash)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

        pool = self.manager.block_pool
        copies: Counter[tuple[str, int, int]] = Counter()
        for block in pool.blocks:
            key = block.block_hash
            if key is not None and pool.cached_block_hash_to_block.contain(key, block.block_id):
                copies[(pool.medium, get_group_id(key), maybe_convert_block_hash(get_block_hash(key)))] += 1
        return dict(copies)

    def close(self) -> None:
        self.publisher.shutdown()


# --- the array encoding of older releases (vLLM before events became tagged maps) -------------


class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """EventBatch as older vLLM encoded it (its subscriber example has the same shape)."""

    ts: float
    events: list


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """An event of older releases: an array whose first element is the type."""


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


# --- a /metrics endpoint ------------------------------------------------------------------------


def vllm_metrics_text(
    queries: float,
    hits: float,
    usage: tuple[float, ...] = (0.25, 0.75),
    lifetimes=(3.0, 40.0),
    scheduler: bool = False,
) -> str:
    """Prometheus text with vLLM's metric names, labels and help, made by prometheus_client as vLLM does.

    One series per engine; the histograms carry `lifetimes` (engine 0) with vLLM's residency shape.
    With `scheduler`, also engine i's running (i + 1) and waiting (i) requests, and its
    cache_config_info with num_gpu_blocks 1000.
    """
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    query_counter = Counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        labels,
        registry=registry,
    )
    hit_counter = Counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        labels,
        registry=registry,
    )
    preemptions = Counter(
        "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=registry
    )
    usage_gauge = Gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=registry
    )
    histograms = [
        Histogram(name, "KV cache block residency.", labels, buckets=[1, 10, 100, 1000], registry=registry)
        for name in (
            "vllm:kv_block_lifetime_seconds",
            "vllm:kv_block_idle_before_evict_seconds",
            "vllm:kv_block_reuse_gap_seconds",
        )
    ]
    for engine, engine_usage in enumerate(usage):
        share = 1 / len(usage)
        query_counter.labels("m", str(engine)).inc(queries * share)
        hit_counter.labels("m", str(engine)).inc(hits * share)
        preemptions.labels("m", str(engine)).inc(engine)
        usage_gauge.labels("m", str(engine)).set(engine_usage)
    for histogram in histograms:
        for value in lifetimes:
            histogram.labels("m", "0").observe(value)
    if scheduler:
        running = Gauge("vllm:num_requests_running", "Running requests.", labels, registry=registry)
        waiting = Gauge("vllm:num_requests_waiting", "Waiting requests.", labels, registry=registry)
        info = Gauge("vllm:cache_config_info", "CacheConfig.", ["block_size", "num_gpu_blocks", "engine"],
                     registry=registry)  # fmt: skip
        for engine in range(len(usage)):
            running.labels("m", str(engine)).set(engine + 1)
            waiting.labels("m", str(engine)).set(engine)
            info.labels("16", "1000", str(engine)).set(1)
    return generate_latest(registry).decode()


class MetricsServer:
    """An HTTP server on a loopback port answering GET /metrics with `body` (after `delay_s`)."""

    def __init__(self, body: str = "", delay_s: float = 0.0) -> None:
        import http.server

        self.body = body  # what /metrics answers
        self.delay_s = delay_s  # how long each answer takes
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                time.sleep(server.delay_s)
                payload = server.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except BrokenPipeError:  # the client stopped reading (a size bound)
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


# --- a console watching vLLM pods, for the real-browser test ----------------------------------


@pytest.fixture
def fleet_console(tmp_path: Path) -> Iterator[tuple[str, list[VllmPod]]]:
    """`streamlit run app` watching two vLLM pods ("vllm-a", "vllm-b", with /metrics), stale after 600 s;
    yields (the console's URL, the pods). Publish on the pods once the console's collector is up."""
    pods = [VllmPod(name="vllm-a"), VllmPod(name="vllm-b")]
    metrics = [
        MetricsServer(vllm_metrics_text(1000.0, 600.0, usage=(0.6,))),
        MetricsServer(vllm_metrics_text(1000.0, 250.0, usage=(0.2,))),
    ]
    spec = " ".join(
        f"{pod.name}={pod.endpoint},replay=tcp://127.0.0.1:{pod.replay_port},topic={TOPIC},metrics={server.url}"
        for pod, server in zip(pods, metrics, strict=True)
    )
    # Stale after 10 min: the pods publish before the console starts, and nothing here waits for staleness.
    env = {"PREFIX_CONSOLE_FLEET_PODS": spec, "PREFIX_CONSOLE_FLEET_STALE_AFTER_S": "600"}
    try:
        with serve_console(tmp_path, env) as server:
            yield server.url, pods
    finally:
        for pod in pods:
            pod.close()
        for server in metrics:
            server.close()
