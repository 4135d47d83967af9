"""The disk KV tier's bar (issue 44): reused prefixes four times the pool, with and without the tier.

Workload: the real SmolLM2-135M on the CPU, 32 distinct 1,024-token prefixes visited in turn, three rounds
(a request is a prefix and its own 32-token suffix, 4 new tokens, greedy, EOS ignored, one request at a
time: each is submitted when the last one finished). The pool holds about 8 requests' blocks, so an LRU
pool without a tier has evicted a prefix long before it comes round again: every visit is a cold prefill.
With the tier (a fresh temporary directory, sized to hold every block the run stores) the evicted blocks
are written to disk and a re-visit promotes its 64 prefix blocks back and computes only its suffix.

Each run is a fresh interpreter (the engine's OpenMP settings, engine/openmp.py, apply when torch loads)
that builds the engine, warms it up (as `cli serve` and the console do) and serves the whole sequence.
The two configurations run interleaved (no tier, tier, tier, no tier, ...) on the same prompts, each
repeat drawing new ones, and the machine is let settle before each run (benchmarks/peer_vllm.py's
`wait_until_quiet`). Every request's greedy output ids must be identical with and without the tier (a
difference makes the exit status 1).

Reported per configuration: the TTFT (submit to first token, the engine's own timestamps) of re-visits
(the second and later visit of a prefix) at p50 and p90 and of first visits at p50; throughput over the
whole run (requests/s, and prompt + generated tokens/s); hit tokens by tier; the tier's loads, stores
and drops; bytes read per promoted block (the tier's counters); bytes the process read from the block
device (/proc/self/io: zero when every promotion came from the page cache); what the step spends in the
tier (`DiskTier._store`, the copy-out of evicted blocks, per step that stores and per block;
`DiskTier._load`, per promoted block); the 1-minute load average; the forward's thread count at the end.

The warm-restart cell: an engine with a tier serves 4 prefixes and stops (`stop()` writes the pool's
cached blocks to the tier); then, each in a fresh interpreter, an engine restarted on that directory and
a cold engine without a tier serve the same first request (a known prefix, a new suffix). The restarted
engine runs twice: with the tier's data file in the page cache, and with the file's pages dropped first
(fsync, then posix_fadvise DONTNEED), so its blocks come from the disk itself.

Run: `make kv-tiers`, or `.venv/bin/python benchmarks/kv_tiers.py [--quick] [--repeats 2] [--neighbour]
[--dtype bfloat16]`. `--quick`: 8 prefixes, a pool for 2, two rounds, one repeat. `--neighbour`: a
process busy-looping 50 ms of every 200 ms on one core throughout.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after the repository: benchmarks/storage.py must not hide storage/

from peer_vllm import neighbour_loop, wait_until_quiet  # noqa: E402  (benchmarks/: a settled machine, a neighbour)

PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 32
NEW_TOKENS = 4
BLOCK_SIZE = 16
RESTART_PREFIXES = 4  # prefixes the engine serves before its restart
GOAL = 5.0  # re-visit TTFT p50 without the tier / with it
CONFIGURATIONS = ("no tier", "tier")
ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Workload:
    """The request sequence of one run: `rounds` visits of each of `num_prefixes` prefixes, in turn."""

    num_prefixes: int
    pool_prefixes: int  # requests whose blocks the pool holds
    rounds: int
    dtype: str
    seed: str  # draws the prompts: runs of one repeat share it

    @property
    def blocks_per_request(self) -> int:
        return math.ceil((PREFIX_TOKENS + SUFFIX_TOKENS + NEW_TOKENS) / BLOCK_SIZE)

    @property
    def num_blocks(self) -> int:
        return self.pool_prefixes * self.blocks_per_request

    @property
    def tier_blocks(self) -> int:
        """Every full block the run can store: each prefix's, and each request's own suffix blocks."""
        own = self.blocks_per_request - PREFIX_TOKENS // BLOCK_SIZE
        return self.num_prefixes * (PREFIX_TOKENS // BLOCK_SIZE) + self.rounds * self.num_prefixes * own

    def prompts(self, vocab: int) -> list[tuple[int, list[int]]]:
        """(prefix index, prompt) of every request, in the order they are served."""
        rng = random.Random(self.seed)

        def draw(n: int) -> list[int]:
            return [rng.randrange(100, vocab) for _ in range(n)]

        prefixes = [draw(PREFIX_TOKENS) for _ in range(self.num_prefixes)]
        return [(p, prefixes[p] + draw(SUFFIX_TOKENS)) for _ in range(self.rounds) for p in range(self.num_prefixes)]


# ---------------------------------------------------------------------- the child: one engine, one run
def tier_gib(model_dir: Path, dtype: str, blocks: int) -> float:
    """GiB that hold `blocks` blocks of the model's K/V (every layer is full attention), with 10 % to spare."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    slot_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * BLOCK_SIZE * head_dim * ITEMSIZE[dtype]
    return 1.1 * blocks * slot_bytes / (1 << 30)


def disk_read_bytes() -> int:
    """Bytes this process made the block device read (page-cache hits excluded); 0 without /proc/self/io."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith("read_bytes:")), 0)


class TierTimer:
    """Wraps a DiskTier's `execute`, `_store` and `_load` to add up the seconds a step spends storing
    (copying evicted blocks out) and loading (promoting blocks in), and to count the steps that store."""

    def __init__(self, disk) -> None:
        self.store_s = self.load_s = 0.0
        self.store_steps = self.store_blocks = self.load_blocks = 0
        execute, store, load = disk.execute, disk._store, disk._load

        def counted_execute(transfers):
            self.store_steps += bool(transfers.stores)
            return execute(transfers)

        def timed_store(*args, **kwargs):
            started = time.perf_counter()
            try:
                return store(*args, **kwargs)
            finally:
                self.store_s += time.perf_counter() - started
                self.store_blocks += 1

        def timed_load(*args, **kwargs):
            started = time.perf_counter()
            try:
                return load(*args, **kwargs)
            finally:
                self.load_s += time.perf_counter() - started
                self.load_blocks += 1

        disk.execute, disk._store, disk._load = counted_execute, timed_store, timed_load


def build_engine(dtype: str, num_blocks: int, tier_dir: Path | None, gib: float):
    """A warmed-up SmolLM2 engine (the project's default model) on the CPU; returns it and its start seconds."""
    from engine.core.config import EngineConfig
    from engine.engine import Engine

    started = time.perf_counter()
    fields = dict(device="cpu", dtype=dtype, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    if tier_dir is not None:
        fields.update(offload_dir=tier_dir, offload_gib=gib)
    engine = Engine(EngineConfig(**fields))
    start_s = time.perf_counter() - started
    engine.warm_up()
    return engine, start_s


def serve(engine, prompts: list[list[int]]) -> tuple[list[dict], float]:
    """Each prompt submitted once the last one finished; returns per request its TTFT, hits and output ids."""
    from engine.core.request import SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    served, started = [], time.perf_counter()
    for prompt in prompts:
        request_id = engine.submit(prompt, params)
        engine.run_until_idle()
        view = engine.get(request_id)
        served.append({
            "ttft_s": view.first_token_time - view.arrival_time,
            "cached": view.cached_tokens,
            "disk": view.disk_cached_tokens,
            "outputs": list(view.output_token_ids),
        })
    return served, time.perf_counter() - started


def child(args: argparse.Namespace) -> None:
    """One run in this fresh interpreter; prints one JSON line."""
    from engine.openmp import set_openmp_defaults

    set_openmp_defaults()  # before torch loads, as the CLI and the console do
    from engine.core.config import default_data_dir
    from engine.runner.model_loading import SMOLLM2_VOCAB_SIZE, ensure_smollm2_converted

    workload = Workload(**json.loads(args.workload))
    tier_dir = Path(args.tier_dir) if args.tier_dir else None
    gib = tier_gib(ensure_smollm2_converted(default_data_dir()), workload.dtype, workload.tier_blocks)
    engine, start_s = build_engine(workload.dtype, workload.num_blocks, tier_dir, gib)
    disk = engine._forward.tier  # the DiskTier (engine/forward.py), timed from outside
    timer = TierTimer(disk) if disk is not None else None
    prompts = workload.prompts(SMOLLM2_VOCAB_SIZE)
    if args.child == "fill":
        serve(engine, [prompt for _, prompt in prompts])
        engine.stop()  # the pool's cached blocks to the tier, and the writer drained
        print(json.dumps({}))
        return
    if args.child == "first":
        prefix, prompt = prompts[args.prefix]
        rng = random.Random(f"{workload.seed}|{args.suffix_seed}")
        prompts = [(prefix, prompt[:PREFIX_TOKENS] + [rng.randrange(100, SMOLLM2_VOCAB_SIZE) for _ in range(SUFFIX_TOKENS)])]
    read_before = disk_read_bytes()
    served, wall_s = serve(engine, [prompt for _, prompt in prompts])
    stats = engine.stats().tier
    result = {
        "start_s": start_s,
        "wall_s": wall_s,
        "requests": [{**r, "prefix": p} for (p, _), r in zip(prompts, served)],
        "prompt_tokens": sum(len(prompt) for _, prompt in prompts),
        "disk_read_bytes": disk_read_bytes() - read_before,
        "threads": engine.forward_threads(),
        "tier": asdict(stats) if stats is not None else None,
        "timer": vars(timer) if timer is not None else None,
    }
    print(json.dumps(result))


def run_child(mode: str, workload: Workload, tier_dir: Path | None, *extra: str) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--workload", json.dumps(asdict(workload)), *extra]
    if tier_dir is not None:
        command += ["--tier-dir", str(tier_dir)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the {mode} run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- the parent: interleaved runs, the tables
def percentile(values: list[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


def visits(run: dict) -> tuple[list[dict], list[dict]]:
    """The run's requests split into first visits of their prefix and re-visits (the second or later)."""
    seen: set[int] = set()
    first, again = [], []
    for request in run["requests"]:
        (again if request["prefix"] in seen else first).append(request)
        seen.add(request["prefix"])
    return first, again


def ttfts_ms(runs: list[dict], which: int) -> list[float]:
    """TTFTs of the runs' first visits (`which` 0) or re-visits (1), in ms."""
    return [request["ttft_s"] * 1e3 for run in runs for request in visits(run)[which]]


def row(name: str, runs: list[dict], loads: list[float]) -> str:
    first, again = ttfts_ms(runs, 0), ttfts_ms(runs, 1)
    wall = sum(run["wall_s"] for run in runs)
    requests = sum(len(run["requests"]) for run in runs)
    tokens = sum(run["prompt_tokens"] + NEW_TOKENS * len(run["requests"]) for run in runs)
    disk = sum(r["disk"] for run in runs for r in run["requests"]) // len(runs)
    memory = sum(r["cached"] for run in runs for r in run["requests"]) // len(runs) - disk
    tier, timer = runs[0]["tier"], runs[0]["timer"]
    if tier is None:
        tier_cells = "- | - | - | -"
    else:
        per_block = tier["bytes_read"] // max(1, tier["loads"])
        stores = sum(run["timer"]["store_s"] for run in runs) / max(1, sum(run["timer"]["store_steps"] for run in runs))
        store_block = sum(run["timer"]["store_s"] for run in runs) / max(1, sum(run["timer"]["store_blocks"] for run in runs))
        load_block = sum(run["timer"]["load_s"] for run in runs) / max(1, sum(run["timer"]["load_blocks"] for run in runs))
        device = sum(run["disk_read_bytes"] for run in runs) / len(runs) / 1e6
        tier_cells = (
            f"{tier['loads']:,} / {tier['stores']:,} / {tier['drops']:,} | {per_block:,} B ({device:,.0f} MB from the device) | "
            f"{stores * 1e3:.1f} ({store_block * 1e3:.2f} per block, {timer['store_steps']} steps) | {load_block * 1e3:.2f}"
        )
    return (
        f"| {name} | {len(runs)} | {percentile(again, 0.5):,.0f} / {percentile(again, 0.9):,.0f} | "
        f"{percentile(first, 0.5):,.0f} | {requests / wall:.2f} | {tokens / wall:,.0f} | {memory:,} / {disk:,} | "
        f"{tier_cells} | {min(loads):.1f}-{max(loads):.1f} | {', '.join(sorted({str(r['threads']) for r in runs}))} |"
    )


HEADER = (
    "| configuration | runs | re-visit TTFT p50 / p90 ms | first-visit TTFT p50 ms | req/s | tokens/s | "
    "hit tokens memory / disk (per run) | tier loads / stores / drops (run 1) | bytes read per promoted block | "
    "store copy-out in the step, ms per storing step | load ms per block | load avg | threads |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def tiers_cell(args: argparse.Namespace, scratch: Path, max_busy: float) -> int:
    """The interleaved runs and their table; returns how many requests' outputs differ between the configurations."""
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGURATIONS}
    loads: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    different = 0
    for repeat in range(args.repeats):
        workload = Workload(args.prefixes, args.pool_prefixes, args.rounds, args.dtype, f"kv-tiers|{repeat}")
        outputs = {}
        for name in CONFIGURATIONS if repeat % 2 == 0 else CONFIGURATIONS[::-1]:
            tier_dir = scratch / f"tier-{repeat}" if name == "tier" else None
            wait_until_quiet(max_busy=max_busy)
            run = run_child("serve", workload, tier_dir)
            if tier_dir is not None:
                shutil.rmtree(tier_dir)
            runs[name].append(run)
            loads[name].append(os.getloadavg()[0])
            outputs[name] = [r["outputs"] for r in run["requests"]]
            print(f"<!-- repeat {repeat} {name}: {run['wall_s']:.0f} s, re-visit TTFT p50 "
                  f"{percentile(ttfts_ms([run], 1), 0.5):,.0f} ms, load avg {loads[name][-1]:.1f} -->", flush=True)  # fmt: skip
        different += sum(a != b for a, b in zip(outputs["no tier"], outputs["tier"]))
    print(HEADER)
    for name in CONFIGURATIONS:
        print(row(name, runs[name], loads[name]))
    cold, warm = percentile(ttfts_ms(runs["no tier"], 1), 0.5), percentile(ttfts_ms(runs["tier"], 1), 0.5)
    total = sum(len(run["requests"]) for run in runs["tier"])
    print(f"\nre-visit TTFT p50: {cold:,.0f} ms without the tier, {warm:,.0f} ms with it: "
          f"{cold / warm:.1f}x lower (goal {GOAL:.0f}x: {'met' if cold / warm >= GOAL else 'NOT met'}); "
          f"greedy outputs identical on {total - different}/{total} requests", flush=True)  # fmt: skip
    return different


def drop_from_page_cache(path: Path) -> None:
    """Write the file's dirty pages, then ask the kernel to forget its cached pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_into_page_cache(path: Path) -> None:
    with open(path, "rb") as file:
        while file.read(16 << 20):
            pass


def restart_cell(args: argparse.Namespace, scratch: Path, max_busy: float) -> int:
    """The warm-restart table; returns how many first requests' outputs differ from the cold engine's."""
    workload = Workload(RESTART_PREFIXES, args.pool_prefixes, 1, args.dtype, "kv-tiers|restart")
    tier_dir = scratch / "restart"
    run_child("fill", workload, tier_dir)
    data = tier_dir / "kv-tier.data"
    cells: dict[str, list[dict]] = {"cold engine, no tier": [], "restarted, tier file in the page cache": [],
                                    "restarted, tier file read from the disk": []}  # fmt: skip
    different = 0
    for repeat in range(args.repeats):
        extra = ["--prefix", str(repeat % RESTART_PREFIXES), "--suffix-seed", str(repeat)]
        order = list(cells) if repeat % 2 == 0 else list(cells)[::-1]
        for name in order:
            wait_until_quiet(max_busy=max_busy)
            if name.endswith("page cache"):
                read_into_page_cache(data)
            elif name.endswith("disk"):
                drop_from_page_cache(data)
            run = run_child("first", workload, None if name.startswith("cold") else tier_dir, *extra)
            cells[name].append(run["requests"][0] | {"start_s": run["start_s"], "device": run["disk_read_bytes"]})
        outputs = [cells[name][-1]["outputs"] for name in cells]
        different += sum(out != outputs[0] for out in outputs[1:])
    print("\n| first request after a start | TTFT ms (each run) | cached tokens: disk of all | "
          "engine start s (model load, tier index) | MB read from the device |\n|---|---|---|---|---|")
    for name, firsts in cells.items():
        each = ", ".join(f"{f['ttft_s'] * 1e3:,.0f}" for f in firsts)
        print(f"| {name} | {each} | "
              f"{firsts[0]['disk']} of {firsts[0]['cached']} | {statistics.median(f['start_s'] for f in firsts):.1f} | "
              f"{statistics.median(f['device'] for f in firsts) / 1e6:,.0f} |")  # fmt: skip
    return different


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 prefixes, a pool for 2, two rounds, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 2, quick 1)")
    parser.add_argument("--prefixes", type=int, default=None, help="distinct prefixes (default 32, quick 8)")
    parser.add_argument("--pool-prefixes", type=int, default=None, help="requests the pool holds (default 8, quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="visits of each prefix (default 3, quick 2)")
    parser.add_argument("--dtype", choices=sorted(ITEMSIZE), default="float32")
    parser.add_argument("--neighbour", action="store_true", help="a process busy 50 ms of every 200 ms on one core")
    parser.add_argument("--skip-restart", action="store_true", help="only the interleaved runs")
    parser.add_argument("--child", choices=("serve", "fill", "first"), help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--tier-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--suffix-seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    defaults = (1, 8, 2, 2) if args.quick else (2, 32, 8, 3)
    for name, default in zip(("repeats", "prefixes", "pool_prefixes", "rounds"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    busy = multiprocessing.Process(target=neighbour_loop, daemon=True) if args.neighbour else None
    max_busy = 0.3 if busy is not None else 0.05
    print(f"SmolLM2-135M {args.dtype} on the CPU ({os.cpu_count()} cores), block size {BLOCK_SIZE}; {args.prefixes} "
          f"prefixes of {PREFIX_TOKENS} tokens x {args.rounds} rounds, own {SUFFIX_TOKENS}-token suffixes, "
          f"{NEW_TOKENS} new tokens, one request at a time; pool for {args.pool_prefixes} requests; {args.repeats} "
          f"interleaved repeats; {'with' if busy else 'without'} a neighbour", flush=True)  # fmt: skip
    different = 0
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as scratch:
        if busy is not None:
            busy.start()
        try:
            different += tiers_cell(args, Path(scratch), max_busy)
            if not args.skip_restart:
                different += restart_cell(args, Path(scratch), max_busy)
        finally:
            if busy is not None:
                busy.terminate()
    if different:
        sys.exit(f"{different} requests' greedy outputs differ with and without the tier")


if __name__ == "__main__":
    main()
