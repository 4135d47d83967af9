"""Soak: many short requests through the engine server's API; nothing may grow with the requests served.

Starts `python -m cli serve` (tiny-chat by default: the model is cheap, so the serving path's own memory
and bookkeeping show) with a SQLite history, then sends `--requests` short requests from `--clients`
concurrent openai SDK clients: completions and chats over a few shared prefixes, some streamed, one in
fifty abandoned mid-stream. At the checkpoint (`--checkpoint`, 2,000: the clients pause) and at the end,
both times idle, it measures:

    RSS            the server and every process under it (the engine process, its history writer)
    /metrics       median latency of 50 scrapes
    console data   median latency of 50 reads of what a console page reads (/engine/snapshot, /engine/stats)

and at the end checks that every request the client saw finish is in the history, and that the engine's
invariants hold (its per-request bookkeeping included: only live requests tracked). Exit status 1 when
RSS grew by more than 64 MB from the checkpoint, a latency grew past 1.2x, or a finished request is not in
the history.

    make soak                                   # 20,000 requests (several minutes)
    .venv/bin/python benchmarks/soak.py --requests 3000 --checkpoint 500
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after the repository: benchmarks/storage.py must not hide storage/

import openai  # noqa: E402

from serving_peer import start_server  # noqa: E402  (benchmarks/: start a server, wait until it answers)
from tests.ports import free_port  # noqa: E402

RSS_GROWTH_LIMIT_MB = 64
LATENCY_GROWTH_LIMIT = 1.2
ABANDON_EVERY = 50
DB_TIMEOUT_S = 120


def tree_rss_mb(pid: int) -> dict[int, float]:
    """RSS of `pid` and each of its descendants, in MB (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    sizes, stack = {}, [pid]
    while stack:
        current = stack.pop()
        stack += children.get(current, [])
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    sizes[current] = int(line.split()[1]) / 1024
        except OSError:
            continue
    return sizes


def latency_ms(url: str, times: int = 50) -> float:
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as response:
            response.read()
        samples.append(time.perf_counter() - started)
    return 1e3 * statistics.median(samples)


def measure(base: str, pid: int) -> dict[str, float]:
    sizes = tree_rss_mb(pid)
    print("  RSS MB per process: " + ", ".join(f"{p}: {mb:.0f}" for p, mb in sorted(sizes.items())), flush=True)
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
        tier = {line.split("{")[0].removeprefix("prefix_console:kv_tier_"): float(line.split()[-1])
                for line in response.read().decode().splitlines() if line.startswith("prefix_console:kv_tier_")}
    return {
        "tier": tier,
        "rss_mb": sum(sizes.values()),
        "metrics_ms": latency_ms(f"{base}/metrics"),
        "snapshot_ms": latency_ms(f"{base}/engine/snapshot"),
        "stats_ms": latency_ms(f"{base}/engine/stats"),
    }


async def send(base: str, model: str, total: int, clients: int, finished: list[str], checkpoint: int,
               at_checkpoint: asyncio.Event, resume: asyncio.Event) -> None:  # fmt: skip
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(0)
    prefixes = [" ".join(f"rule {i} of tenant {t}." for i in range(12)) for t in range(8)]
    counter = iter(range(total))

    async def one(index: int) -> None:
        prefix = prefixes[index % len(prefixes)]
        if index % ABANDON_EVERY == ABANDON_EVERY - 1:  # a client that leaves mid-stream
            stream = await client.completions.create(model=model, prompt=f"{prefix} story {index}", max_tokens=64,
                                                     stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            async for _ in stream:
                break
            await stream.close()
            return
        if index % 2:
            answer = await client.chat.completions.create(
                model=model, max_tokens=rng.randint(1, 4), temperature=0,
                messages=[{"role": "system", "content": prefix}, {"role": "user", "content": f"question {index}"}],
            )  # fmt: skip
        else:
            answer = await client.completions.create(model=model, prompt=f"{prefix} item {index}",
                                                     max_tokens=rng.randint(1, 4), temperature=0)  # fmt: skip
        finished.append(answer.id)

    async def worker() -> None:
        for index in counter:
            await one(index)
            if index + 1 == checkpoint:
                at_checkpoint.set()
            if at_checkpoint.is_set():
                await resume.wait()  # every client pauses while the checkpoint is measured, as at the end

    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()


async def soak(base: str, pid: int, args: argparse.Namespace) -> tuple[dict, dict, list[str], float]:
    finished: list[str] = []
    at_checkpoint, resume = asyncio.Event(), asyncio.Event()
    started = time.perf_counter()
    sender = asyncio.create_task(send(base, args.model, args.requests, args.clients, finished, args.checkpoint,
                                      at_checkpoint, resume))  # fmt: skip
    await at_checkpoint.wait()
    await asyncio.sleep(2)  # the clients' requests in flight end; then measured idle, like the end
    first = await asyncio.to_thread(measure, base, pid)
    print(f"after {args.checkpoint:,}: {first}", flush=True)
    resume.set()
    await sender
    elapsed = time.perf_counter() - started
    await asyncio.sleep(2)  # the last steps' stats and rows leave the engine
    last = await asyncio.to_thread(measure, base, pid)
    print(f"after {args.requests:,}: {last}", flush=True)
    return first, last, finished, elapsed


def engine_invariants(base: str) -> str | None:
    """What the engine's check_invariants command says is broken (the engine's and its loop's bounds), or
    None when everything holds."""
    request = urllib.request.Request(f"{base}/engine/check", method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=60):
            return None
    except urllib.error.HTTPError as exc:
        return exc.read().decode(errors="replace")


def missing_from_history(db_url: str, ids: list[str]) -> int:
    from sqlalchemy import select

    from storage.db import db_engine
    from storage.schema import RequestRecord

    db = db_engine(db_url)
    wanted = set(ids)
    deadline = time.monotonic() + DB_TIMEOUT_S
    try:
        while True:
            with db.connect() as connection:
                stored = {row[0] for row in connection.execute(select(RequestRecord.request_id))}
            missing = len(wanted - stored)
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(1)
    finally:
        db.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--checkpoint", type=int, default=2_000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--model", default="tiny-chat")
    parser.add_argument("--tier-gib", type=float, default=0.0, help="with a disk KV tier of this size (0: none)")
    args = parser.parse_args()
    if not 0 < args.checkpoint < args.requests:
        parser.error("--checkpoint must be between 0 and --requests")
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    db_url = f"sqlite:///{work / 'history.sqlite'}"
    argv = [sys.executable, "-m", "cli", "serve", "--model", args.model, "--device", "cpu", "--num-blocks", "512",
            "--port", str(free_port()), "--db", db_url, "--max-in-flight", "256"]  # fmt: skip
    if args.tier_gib:  # evicted blocks go to disk and come back: the tier's index and queues must stay bounded too
        argv += ["--offload-dir", str(work / "tier"), "--offload-gib", str(args.tier_gib)]
    server = start_server("the engine server", argv, dict(os.environ), work / "server.log")
    base = server.url
    try:
        first, last, finished, elapsed = asyncio.run(soak(base, server.process.pid, args))
        missing = missing_from_history(db_url, finished)
        invariants = engine_invariants(base)
    finally:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(60)
    growth = last["rss_mb"] - first["rss_mb"]
    print(f"\n{args.requests:,} requests in {elapsed:.0f} s ({args.requests / elapsed:.0f}/s), {args.clients} clients")
    print("| measure | after %s | after %s | change |" % (f"{args.checkpoint:,}", f"{args.requests:,}"))
    print("|---|---|---|---|")
    for key in ("rss_mb", "metrics_ms", "snapshot_ms", "stats_ms"):
        print(f"| {key} | {first[key]:.1f} | {last[key]:.1f} | "
              f"{last[key] - first[key]:+.1f} ({last[key] / max(first[key], 1e-9):.2f}x) |")  # fmt: skip
    print(f"history: {len(finished) - missing:,}/{len(finished):,} finished requests stored")
    if args.tier_gib:
        print("disk tier: " + ", ".join(f"{name} {value:,.0f}" for name, value in last["tier"].items()))
    failures = []
    if growth > RSS_GROWTH_LIMIT_MB:
        failures.append(f"RSS grew by {growth:.0f} MB")
    for key in ("metrics_ms", "snapshot_ms"):
        if last[key] > LATENCY_GROWTH_LIMIT * first[key] and last[key] - first[key] > 2.0:  # 2 ms: timer noise
            failures.append(f"{key} grew {last[key] / first[key]:.2f}x")
    if missing:
        failures.append(f"{missing} finished requests are not in the history")
    if invariants is not None:
        failures.append(f"the engine's invariants (its bounds included) do not hold: {invariants}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
