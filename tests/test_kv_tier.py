"""The disk tier (issue 44): evicted full-attention blocks kept in files, promoted back on a hit.

Every engine here is a seeded random tiny-llama on the CPU with a pool small enough that a second prompt
evicts the first one's blocks; "recompute" is the same engine without a tier, "memory hit" one whose pool
keeps everything.
"""

from __future__ import annotations

import json
import queue
import random
import threading

import numpy as np

import pytest
import torch
from hypothesis import settings
from prometheus_client import generate_latest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.core.block import Block
from engine.core.chain_keys import ChainKeys, chain_key
from engine.core.config import EngineConfig
from engine.core.events import EventKind, EventLog, TierReason
from engine.core.kv_tier import TierIndex, TierStore, TierTransfers, TierWrite
from engine.core.namespace import CacheNamespace
from cli.__main__ import main
from engine.core.request import SamplingParams
from engine.engine import Engine
from engine.feeds.metrics_server import BlockResidency, engine_registry
from engine.runner.kv_tier_files import DATA, TierFiles, TierGeometry, TierMismatchError, TierUnavailableError
from engine.runner.kv_tier_io import DiskTier
from tests.engine_reference import LogitSpy
from tests.engine_support import HYBRID_WINDOW, tokens

BS = 4
SMALL_POOL = 12  # blocks: a 30-token prompt takes 8, so the next prompt evicts most of the last one's
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
TIER_GIB = 0.001


def engine(tmp_path, tier: bool, *, num_blocks: int = SMALL_POOL, **overrides) -> Engine:
    fields = dict(model="tiny-llama", device="cpu", block_size=BS, num_blocks=num_blocks, data_dir=tmp_path)
    if tier:
        fields.update(offload_dir=tmp_path / "tier", offload_gib=TIER_GIB)
    fields.update(overrides)
    return Engine(EngineConfig(**fields))


def run(e: Engine, prompt: list[int]):
    rid = e.submit(prompt, GREEDY)
    e.run_until_idle()
    e.check_invariants()
    return e.get(rid)


def first_prompt_again(e: Engine):
    """Run prompt A, then B (which evicts A's blocks from a small pool), then A again; returns A's last view."""
    a, b = tokens(30, 1), tokens(30, 2)
    run(e, a)
    run(e, b)
    e.stop()  # waits for the tier's writer (stores are written off the step, so a step does not wait)
    return run(e, a)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attention", [None, f"hybrid:{HYBRID_WINDOW}"])
def test_promotion_from_disk_equals_recompute(tmp_path, dtype, attention):
    recompute = engine(tmp_path / "r", tier=False, dtype=dtype, attention_override=attention)
    tiered = engine(tmp_path / "t", tier=True, dtype=dtype, attention_override=attention)
    spies = LogitSpy(recompute), LogitSpy(tiered)
    expected, promoted = first_prompt_again(recompute), first_prompt_again(tiered)
    assert promoted.disk_cached_tokens > 0, "the second run of A must reach the disk tier"
    assert expected.disk_cached_tokens == 0
    assert promoted.output_token_ids == expected.output_token_ids
    for got, want in zip(spies[1].logits[promoted.request_id], spies[0].logits[expected.request_id]):
        torch.testing.assert_close(got, want, atol=2e-2 if dtype == "bfloat16" else 1e-4, rtol=0)
    stats = tiered.stats()
    assert stats.tier is not None and stats.tier.loads * BS == stats.tier.hit_tokens > 0
    assert promoted.cached_tokens_by_tier == {
        "memory": promoted.cached_tokens - promoted.disk_cached_tokens,
        "disk": promoted.disk_cached_tokens,
    }


def test_promoted_blocks_hold_the_same_bytes_as_a_memory_hit(tmp_path):
    """Full attention: a hit read from disk computes exactly what the same hit in memory computes."""
    in_memory = engine(tmp_path / "m", tier=False, num_blocks=64)
    tiered = engine(tmp_path / "t", tier=True)
    spies = LogitSpy(in_memory), LogitSpy(tiered)
    memory_hit, disk_hit = first_prompt_again(in_memory), first_prompt_again(tiered)
    assert disk_hit.cached_tokens == memory_hit.cached_tokens and disk_hit.disk_cached_tokens > 0
    for got, want in zip(spies[1].logits[disk_hit.request_id], spies[0].logits[memory_hit.request_id]):
        assert torch.equal(got, want)


def test_a_corrupted_tier_file_is_detected_and_its_blocks_recomputed(tmp_path):
    recompute = engine(tmp_path / "r", tier=False)
    expected = first_prompt_again(recompute)
    tiered = engine(tmp_path / "t", tier=True)
    run(tiered, tokens(30, 1))
    run(tiered, tokens(30, 2))
    tiered.stop()  # every store written
    data = tmp_path / "t" / "tier" / DATA
    data.write_bytes(random.Random(0).randbytes(data.stat().st_size))
    again = run(tiered, tokens(30, 1))
    stats = tiered.stats()
    assert stats.tier.corrupt > 0
    assert again.output_token_ids == expected.output_token_ids
    assert again.disk_cached_tokens == 0 and stats.tier_hit_tokens == 0


def test_a_full_tier_drops_stores_and_counts_them(tmp_path):
    slot_bytes = engine(tmp_path / "probe", tier=True).kv.tier.slot_bytes
    tiny = engine(tmp_path, tier=True, offload_gib=2 * slot_bytes / (1 << 30))
    a = first_prompt_again(tiny)
    stats = tiny.stats()
    assert stats.tier.num_slots == 2
    assert stats.tier.drops > 0
    assert a.output_token_ids == first_prompt_again(engine(tmp_path / "r", tier=False)).output_token_ids


@pytest.mark.parametrize("directory", ["/proc/prefix-console-tier", "/proc"])
def test_a_tier_on_an_unwritable_directory_is_refused_at_start(tmp_path, directory):
    with pytest.raises(TierUnavailableError, match="not a writable directory"):
        engine(tmp_path, tier=True, offload_dir=directory)


def test_a_tier_of_another_block_size_is_refused(tmp_path):
    engine(tmp_path, tier=True).stop()
    with pytest.raises(TierMismatchError, match="block_size"):
        engine(tmp_path, tier=True, block_size=8)


def test_an_all_sliding_model_has_no_blocks_to_offload(tmp_path):
    with pytest.raises(ValueError, match="all-sliding"):
        engine(tmp_path, tier=True, attention_override="sliding:8")


def test_a_restarted_engine_serves_the_first_requests_prefix_from_disk(tmp_path):
    first = engine(tmp_path, tier=True)
    before = run(first, tokens(30, 1))
    first.stop()  # writes the pool's cached blocks back and waits for the writer
    second = engine(tmp_path, tier=True)
    assert second.stats().tier.ready_blocks > 0
    again = run(second, tokens(30, 1))
    assert again.disk_cached_tokens == again.cached_tokens == (30 - 1) // BS * BS
    assert again.output_token_ids == before.output_token_ids
    text = generate_latest(engine_registry(second, BlockResidency())).decode()
    assert 'prefix_console:kv_tier_hit_tokens_total{engine="0",model_name="tiny-llama"} 28.0' in text


def test_salts_do_not_share_tier_blocks(tmp_path):
    e = engine(tmp_path, tier=True)
    a = tokens(30, 1)
    e.submit(a, GREEDY, salt="tenant-1")
    e.run_until_idle()
    run(e, tokens(30, 2))
    e.stop()
    rid = e.submit(a, GREEDY, salt="tenant-2")
    e.run_until_idle()
    assert e.get(rid).cached_tokens == 0


def test_run_trace_takes_the_tier_and_a_second_run_starts_warm(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    line = {"op": "submit", "id": "a", "tokens": tokens(30, 1), "max_new_tokens": 2, "ignore_eos": True}
    trace.write_text(json.dumps(line) + "\n" + json.dumps({"op": "run"}) + "\n")
    args = ["run-trace", str(trace), "--model", "tiny-llama", "--device", "cpu", "--block-size", str(BS),
            "--offload-dir", str(tmp_path / "tier"), "--offload-gib", "0.001"]  # fmt: skip
    assert main(args) == 0 and main(args) == 0
    second = [json.loads(text) for text in capsys.readouterr().out.splitlines()][-2:]
    assert second[0]["cached_tokens_by_tier"] == {"memory": 0, "disk": 28}
    assert second[1]["summary"]["tier_hit_tokens"] == 28


def test_run_trace_refuses_an_unwritable_tier_clearly(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"op": "run"}) + "\n")
    args = ["run-trace", str(trace), "--model", "tiny-llama", "--device", "cpu",
            "--offload-dir", "/proc/prefix-console-tier", "--offload-gib", "1"]  # fmt: skip
    assert main(args) == 2
    assert "not a writable directory" in capsys.readouterr().err


def small_disk_tier(tmp_path, queue_blocks: int) -> tuple[DiskTier, torch.Tensor]:
    """A DiskTier over random block memory of 5 blocks (2 layers, 2 heads, head dim 16)."""
    kv = torch.randn(2, 2, 2, 5, BS, 16)
    namespace = CacheNamespace("m", "w", "float32", BS, ("full", "full"))
    files = TierFiles(tmp_path, namespace, TierGeometry.sized((2, 2, 2, BS, 16), 4, TIER_GIB))
    return DiskTier(files, kv, queue_blocks=queue_blocks), kv


def stuck_writes(disk: DiskTier) -> tuple[threading.Event, threading.Event]:
    """(entered, release): the writer's first write waits for `release`; `entered` says it got there."""
    entered, release, write_slot = threading.Event(), threading.Event(), disk.files.write_slot

    def slow_write(store, raw, checksum):
        entered.set()
        release.wait(timeout=10)
        write_slot(store, raw, checksum)

    disk.files.write_slot = slow_write
    return entered, release


def stores_of(blocks: range) -> list[TierStore]:
    return [TierStore(b, b, bytes([b]) * 16, ROOT, (b,) * BS, b) for b in blocks]


def test_a_slow_disk_drops_stores_instead_of_stalling_the_step(tmp_path):
    """The writer is stuck on its first store: the second takes the last staging row, the third is dropped at once."""
    disk, kv = small_disk_tier(tmp_path, queue_blocks=2)
    entered, release = stuck_writes(disk)
    stores = stores_of(range(3))
    disk.execute(TierTransfers(stores[:1], []))
    assert entered.wait(timeout=10)
    disk.execute(TierTransfers(stores[1:], []))  # returns at once: one staged, one dropped
    dropped = disk.writes.get(timeout=1)
    assert dropped.checksum is None and dropped.slot == 2
    release.set()
    disk.drain()
    written = [disk.writes.get(timeout=1) for _ in range(2)]
    assert [w.slot for w in written] == [0, 1] and all(w.checksum is not None for w in written)
    raw = np.empty(disk.files.geometry.slot_bytes, np.uint8)
    disk.files.read_slot(1, raw)
    assert torch.equal(torch.from_numpy(raw).view(torch.float32).view(2, 2, 2, BS, 16), kv[:, :, :, 1])


def test_an_engine_stopping_waits_for_the_writer_instead_of_dropping(tmp_path):
    """`write_back` (stop) stores every block through one staging row, however slow the writer."""
    disk, kv = small_disk_tier(tmp_path, queue_blocks=1)
    entered, release = stuck_writes(disk)
    threading.Timer(0.2, release.set).start()  # the writer is stuck while the write-back asks for rows
    disk.write_back(TierTransfers(stores_of(range(4)), []))
    written = [disk.writes.get(timeout=1) for _ in range(4)]
    assert [w.slot for w in written] == [0, 1, 2, 3] and all(w.checksum is not None for w in written)
    raw = np.empty(disk.files.geometry.slot_bytes, np.uint8)
    for block in range(4):
        disk.files.read_slot(block, raw)
        assert torch.equal(torch.from_numpy(raw).view(torch.float32).view(2, 2, 2, BS, 16), kv[:, :, :, block])


def test_a_truncated_tier_file_is_detected_and_its_blocks_recomputed(tmp_path):
    """A data file cut short (a copy that stopped, a full disk) fails the loads it cannot give back whole."""
    expected = first_prompt_again(engine(tmp_path / "r", tier=False))
    tiered = engine(tmp_path / "t", tier=True)
    run(tiered, tokens(30, 1))
    run(tiered, tokens(30, 2))
    tiered.stop()
    with open(tmp_path / "t" / "tier" / DATA, "r+b") as data:
        data.truncate(0)
    again = run(tiered, tokens(30, 1))
    assert tiered.stats().tier.corrupt > 0
    assert again.output_token_ids == expected.output_token_ids and again.disk_cached_tokens == 0


@pytest.mark.parametrize(
    "attention, policy", [(None, "lru"), (f"hybrid:{HYBRID_WINDOW}", "lru"), (None, "reuse-lru")]
)
def test_a_mixed_workload_through_both_tiers_answers_as_a_large_pool_does(tmp_path, attention, policy):
    """Shared prefixes, batches, chunked prefill and a pool that keeps evicting: every answer equals the
    answer of a pool that never evicts, and every invariant holds after every step."""
    rng = random.Random(7)
    prefixes = [tokens(rng.randrange(8, 24), seed) for seed in range(3)]
    prompts = [rng.choice(prefixes) + tokens(rng.randrange(1, 9), 100 + i) for i in range(14)]
    small = engine(
        tmp_path / "t", tier=True, attention_override=attention, max_num_batched_tokens=16, offload_policy=policy
    )
    large = engine(tmp_path / "l", tier=False, num_blocks=256, attention_override=attention)
    answers: dict[str, list] = {"small": [], "large": []}
    for name, e in (("small", small), ("large", large)):
        i = 0
        while i < len(prompts):
            batch = prompts[i : i + 1 + i % 3]
            ids = [e.submit(prompt, GREEDY) for prompt in batch]
            while e.has_work():
                e.step()
                e.check_invariants()
            answers[name] += [e.get(rid).output_token_ids for rid in ids]
            i += len(batch)
            if i % 4 == 0:
                e.stop()  # lets the writer catch up now and then, so that later prompts find the tier
    assert answers["small"] == answers["large"]
    assert small.stats().tier.loads > 0


# ---------------------------------------------------------------------- the index alone
ROOT = b"\0" * 16
KEYS = [chain_key(ROOT, [i, i]) for i in range(8)]  # one-block contexts [i, i] under one root


class TierIndexMachine(RuleBasedStateMachine):
    """Offers, stores, writer reports, lookups, loads and corrupt loads in any order keep the index whole."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.writes: queue.SimpleQueue[TierWrite] = queue.SimpleQueue()
        self.log = EventLog()
        self.index = TierIndex(4, 2, 64, self.writes, self.log, self.policy)
        self.in_flight: list = []
        self.events: list = []
        self.planned_stores = 0

    @rule(i=st.integers(0, len(KEYS) - 1))
    def offer(self, i):
        block = Block(i, token_ids=[i, i], key=KEYS[i], parent_key=ROOT)
        self.index.offer(block)

    @rule()
    def take(self):
        stores = list(self.index.take_transfers().stores)
        self.in_flight += stores
        self.planned_stores += len(stores)

    @rule(ok=st.booleans())
    def writer_reports(self, ok):
        if self.in_flight:
            store = self.in_flight.pop(0)
            self.writes.put(TierWrite(store.slot, store.key, 7 if ok else None))
        self.index.settle()

    @rule(i=st.integers(0, len(KEYS) - 1), corrupt=st.booleans())
    def load(self, i, corrupt):
        keys = ChainKeys(ROOT, 2)
        found = self.index.find(keys, [i, i], 0, 1)
        if found:
            self.index.plan_loads("r", found, [0])
            loads = self.index.take_transfers()
            self.in_flight += list(loads.stores)
            self.planned_stores += len(loads.stores)
            if corrupt:
                self.index.discard(loads.loads[0])
                assert not self.index.find(keys, [i, i], 0, 1)

    @invariant()
    def whole(self):
        self.index.check_invariants()
        stats = self.index.stats()
        assert stats.ready_blocks + stats.writing_blocks <= stats.num_slots

    @invariant()
    def every_counted_change_is_an_event(self):
        """The history sees what the counters count: a DEMOTE per planned store, a TIER_DROP per drop, a
        TIER_EVICT per LRU eviction and per corrupt load of a held block, PROMOTE tokens = hit tokens."""
        self.events += self.log.take()
        stats = self.index.stats()
        count = lambda kind, reason=None: sum(  # noqa: E731
            1 for e in self.events if e.kind is kind and (reason is None or e.detail["reason"] == reason)
        )
        assert count(EventKind.DEMOTE) == self.planned_stores
        assert count(EventKind.TIER_DROP) == stats.drops
        assert count(EventKind.TIER_EVICT, TierReason.LRU) == stats.evictions
        assert count(EventKind.TIER_EVICT, TierReason.CORRUPT) <= stats.corrupt
        assert sum(e.tokens for e in self.events if e.kind is EventKind.PROMOTE) == stats.hit_tokens


TestTierIndex = TierIndexMachine.TestCase
TestTierIndex.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class ReuseTierIndexMachine(TierIndexMachine):
    policy = "reuse-lru"


TestReuseTierIndex = ReuseTierIndexMachine.TestCase
TestReuseTierIndex.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("policy, kept", [("lru", False), ("reuse-lru", True)])
def test_reuse_lru_keeps_a_promoted_block_through_a_scan_of_blocks_stored_once(policy, kept):
    """A 4-slot tier: block 0 is stored and promoted once, then six blocks are stored once each. LRU lets
    the scan push block 0 out; reuse-LRU keeps it (victims come from the never-promoted blocks first)."""
    writes: queue.SimpleQueue[TierWrite] = queue.SimpleQueue()
    index = TierIndex(4, 2, 64, writes, policy=policy)
    keys = ChainKeys(ROOT, 2)

    def store(i: int) -> None:
        index.offer(Block(i, token_ids=[i, i], key=KEYS[i], parent_key=ROOT))
        for s in index.take_transfers().stores:
            writes.put(TierWrite(s.slot, s.key, 7))
        index.settle()

    store(0)
    index.plan_loads("r", index.find(keys, [0, 0], 0, 1), [0])
    index.take_transfers()
    for i in range(1, 7):
        store(i)
        index.check_invariants()
    assert bool(index.find(keys, [0, 0], 0, 1)) is kept
    assert index.stats().ready_blocks == 4


def test_an_unknown_tier_policy_is_refused():
    with pytest.raises(ValueError, match="offload_policy must be one of lru, reuse-lru"):
        EngineConfig(model="tiny-llama", offload_policy="fifo")


def test_the_api_reports_cached_tokens_by_tier(tmp_path, test_data_dir):
    """`usage.prompt_tokens_details.cached_tokens` counts both tiers; `cached_tokens_by_tier` splits them."""
    import time

    from tests.serving_support import MODEL, serve, shut

    served = serve(test_data_dir, num_blocks=9, offload_dir=tmp_path / "tier", offload_gib=TIER_GIB)
    try:
        def complete(prompt: list[int]):
            return served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})

        first, other = tokens(100, 1), tokens(100, 2)  # 7 of the 9 blocks each: the second evicts the first's
        cold = complete(first).usage.prompt_tokens_details
        assert cold.cached_tokens == 0 and cold.cached_tokens_by_tier == {"memory": 0, "disk": 0}
        complete(other)
        time.sleep(0.5)  # the tier's writer stores the evicted blocks off the step
        complete(tokens(3, 3))  # a step that takes the writer's finished stores in
        again = complete(first).usage.prompt_tokens_details
        by_tier = again.cached_tokens_by_tier
        assert by_tier["disk"] > 0 and by_tier["memory"] + by_tier["disk"] == again.cached_tokens
    finally:
        shut(served)
