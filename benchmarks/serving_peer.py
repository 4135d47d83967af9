"""This engine's server against vLLM's OpenAI server (CPU build), through the door real clients use.

Both servers load the same SmolLM2-135M-Instruct safetensors (the packaged GGUF converted once, as the
console does), two threads each, prefix caching on; the client is the official openai SDK (AsyncOpenAI,
streaming, greedy, EOS ignored). Cells, each on a fresh random 1,024-token prefix per repeat (so both
servers meet it cold), 32 own tokens per request, 16 new tokens:

    1x16      1 client, 16 requests in a row
    8x64      8 clients, 64 requests
    32x128    32 clients, 128 requests
    agents    4 agents x 6 chat turns, each turn's messages the whole history so far (growing)

Per cell and server: wall seconds, requests/s, TTFT p50 / p99 (first streamed token, client side), the gaps
between a stream's tokens (p50 / p99 / max, the 8x64 cell shows whether tokens come one per step or in
bursts), and the output token ids (both return them: this engine always, vLLM with `return_token_ids`),
compared request by request. Repeats are interleaved (the order of the servers alternates), each run
starts once the machine is quiet (benchmarks/peer_vllm.py's check), and `--neighbour` adds a process that
busy-loops 50 ms of every 200 ms on one core during every run.

    make serving-peer                                  # fp32 then bf16, 2 repeats (tens of minutes)
    .venv/bin/python benchmarks/serving_peer.py --dtypes float32 --repeats 2 [--cells 1x16,8x64] [--no-vllm]

Not part of `make test`: it takes the machine for many minutes and needs .venv-vllm (`make serving-peer`
installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after the repository: benchmarks/storage.py must not hide storage/

import openai  # noqa: E402

from peer_vllm import wait_until_quiet  # noqa: E402  (benchmarks/: the same quiet-machine check)
from tests.ports import free_port  # noqa: E402

PREFIX_TOKENS, SUFFIX_TOKENS, NEW_TOKENS = 1024, 32, 16
THREADS = 2
VLLM_BLOCK_SIZE = 32  # vLLM's CPU build takes multiples of 32
START_TIMEOUT_S = 900


@dataclass(frozen=True)
class Cell:
    name: str
    clients: int
    requests: int  # for agents: agents x turns
    chat_turns: int = 0  # > 0: the agents cell


CELLS = (Cell("1x16", 1, 16), Cell("8x64", 8, 64), Cell("32x128", 32, 128), Cell("agents", 4, 24, chat_turns=6))


@dataclass
class Run:
    """One server's run of one cell."""

    wall_s: float
    ttfts: list[float]
    gaps: list[float]
    outputs: list[tuple[int, ...]]


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen
    runs: dict[str, list[Run]] = field(default_factory=dict)


def start_server(name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> Server:
    port = int(argv[argv.index("--port") + 1])
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return Server(name, url, process)
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{name} did not start; see {log}")


def this_server(model_dir: Path, dtype: str, log: Path, tree: Path = ROOT, name: str = "this") -> Server:
    """`python -m cli serve` from the checkout at `tree` (another commit's, for a before/after in one run)."""
    argv = [sys.executable, "-m", "cli", "serve", "--model", str(model_dir), "--dtype", dtype, "--port",
            str(free_port()), "--max-in-flight", "256"]  # fmt: skip
    return start_server(name, argv, {**os.environ, "HF_HUB_OFFLINE": "1"}, log, cwd=tree)


def vllm_server(python: str, model_dir: Path, dtype: str, log: Path) -> Server:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
            str(model_dir), "--host", "127.0.0.1", "--port", str(free_port()), "--block-size", str(VLLM_BLOCK_SIZE),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", "2048",
            "--dtype", dtype]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    return start_server("vllm", argv, env, log)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_stream(client: openai.AsyncOpenAI, model: str, extra: dict, *, prompt: list[int] | None = None,
                     messages: list[dict] | None = None) -> tuple[float, list[float], tuple[int, ...], str]:  # fmt: skip
    """(TTFT, gaps between token arrivals, token ids, text) of one streamed request."""
    common = dict(model=model, max_tokens=NEW_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True, **extra})
    started = time.perf_counter()
    if messages is not None:
        stream = await client.chat.completions.create(messages=messages, **common)
    else:
        stream = await client.completions.create(prompt=prompt, **common)
    arrivals, ids, text = [], [], []
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        new = list(getattr(choice, "token_ids", None) or [])
        if new:
            arrivals.append(time.perf_counter())
            ids += new
        piece = choice.delta.content if messages is not None else choice.text
        text.append(piece or "")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return (arrivals[0] - started if arrivals else float("nan")), gaps, tuple(ids), "".join(text)


async def run_cell(server: Server, model: str, cell: Cell, repeat: int, vocab: int) -> Run:
    rng = random.Random(f"{cell.name}|{repeat}")
    prefix = [rng.randrange(100, vocab) for _ in range(PREFIX_TOKENS)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    extra = {} if server.name == "this" else {"return_token_ids": True}  # this server always returns them
    ttfts: list[float] = []
    gaps: list[float] = []
    outputs: dict[int, tuple[int, ...]] = {}
    started = time.perf_counter()
    if cell.chat_turns:
        system = " ".join(f"rule {i}: answer briefly about invoice {rng.randrange(10**6)}." for i in range(60))

        async def agent(index: int) -> None:
            history = [{"role": "system", "content": system}]
            for turn in range(cell.chat_turns):
                history.append({"role": "user", "content": f"agent {index} turn {turn}: what is next?"})
                ttft, g, ids, text = await one_stream(client, model, extra, messages=history)
                ttfts.append(ttft)
                gaps.extend(g)
                outputs[index * cell.chat_turns + turn] = ids
                history.append({"role": "assistant", "content": text})

        await asyncio.gather(*(agent(i) for i in range(cell.clients)))
    else:
        prompts = [prefix + [rng.randrange(100, vocab) for _ in range(SUFFIX_TOKENS)] for _ in range(cell.requests)]
        queue = list(enumerate(prompts))

        async def worker() -> None:
            while queue:
                index, prompt = queue.pop(0)
                ttft, g, ids, _ = await one_stream(client, model, extra, prompt=prompt)
                ttfts.append(ttft)
                gaps.extend(g)
                outputs[index] = ids

        await asyncio.gather(*(worker() for _ in range(cell.clients)))
    wall = time.perf_counter() - started
    await client.close()
    return Run(wall, ttfts, gaps, [outputs[i] for i in sorted(outputs)])


def neighbour(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    """Busy-loops 50 ms of every 200 ms on one core until told to stop."""
    os.sched_setaffinity(0, {0})
    while not stop.is_set():
        until = time.perf_counter() + 0.05
        while time.perf_counter() < until:
            pass
        time.sleep(0.15)


def report(servers: list[Server], cells: tuple[Cell, ...]) -> None:
    peer = next((s for s in servers if s.name == "vllm"), None)
    print("| cell | server | req/s | wall s (runs) | TTFT p50 / p99 ms | token gap p50 / p99 / max ms | wall / vLLM's |")
    print("|---|---|---|---|---|---|---|")
    for cell in cells:
        for server in servers:
            runs = server.runs.get(cell.name, [])
            if not runs:
                continue
            walls = [r.wall_s for r in runs]
            ttfts = [t for r in runs for t in r.ttfts]
            gaps = [g for r in runs for g in r.gaps]
            ratio = ""
            if server is not peer and peer is not None and peer.runs.get(cell.name):
                ratio = f"{statistics.median(walls) / statistics.median(r.wall_s for r in peer.runs[cell.name]):.2f}x"
            print(f"| {cell.name} | {server.name} | {cell.requests / statistics.median(walls):.2f} | "
                  f"{statistics.median(walls):.2f} ({', '.join(f'{w:.2f}' for w in walls)}) | "
                  f"{1e3 * percentile(ttfts, 0.5):,.0f} / {1e3 * percentile(ttfts, 0.99):,.0f} | "
                  f"{1e3 * percentile(gaps, 0.5):.0f} / {1e3 * percentile(gaps, 0.99):.0f} / "
                  f"{1e3 * max(gaps, default=float('nan')):.0f} | {ratio} |")  # fmt: skip
    for other in servers[1:]:
        for cell in cells:
            pairs = list(zip(servers[0].runs.get(cell.name, []), other.runs.get(cell.name, [])))
            same = sum(a == b for x, y in pairs for a, b in zip(x.outputs, y.outputs))
            total = sum(len(x.outputs) for x, _ in pairs)
            print(f"outputs {cell.name}, {servers[0].name} vs {other.name}: {same}/{total} identical token ids")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cells", default=",".join(c.name for c in CELLS))
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--no-vllm", action="store_true", help="this engine's server alone")
    parser.add_argument("--neighbour", action="store_true", help="a busy-loop neighbour during every run")
    parser.add_argument("--baseline", default=None,
                        help="a checkout of another commit (native modules built): its server runs too, as 'before'")
    parser.add_argument("--logs", default=str(ROOT / "artifacts"))
    args = parser.parse_args()
    from engine.core.config import default_data_dir
    from engine.runner.model_loading import ensure_smollm2_converted

    cells = tuple(c for c in CELLS if c.name in args.cells.split(","))
    model_dir = ensure_smollm2_converted(default_data_dir()).resolve()  # both servers name the model by it
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    vocab = 49152
    for dtype in args.dtypes.split(","):
        servers = [this_server(model_dir, dtype, logs / "serving-peer-this.log")]
        if args.baseline is not None:
            servers.append(this_server(model_dir, dtype, logs / "serving-peer-before.log", Path(args.baseline), "before"))
        if not args.no_vllm:
            servers.append(vllm_server(args.vllm_python, model_dir, dtype, logs / "serving-peer-vllm.log"))
        stop = multiprocessing.Event()
        busy = multiprocessing.Process(target=neighbour, args=(stop,), daemon=True) if args.neighbour else None
        try:
            print(f"\n## {dtype}: {len(cells)} cells, {args.repeats} interleaved repeats, "
                  f"{'with' if busy else 'without'} a neighbour; {os.cpu_count()} CPUs", flush=True)  # fmt: skip
            if busy is not None:
                busy.start()
            for repeat in range(args.repeats):
                order = servers if repeat % 2 == 0 else servers[::-1]
                for cell in cells:
                    for server in order:
                        wait_until_quiet(max_busy=0.3 if busy else 0.05)
                        run = asyncio.run(run_cell(server, str(model_dir), cell, repeat, vocab))
                        server.runs.setdefault(cell.name, []).append(run)
                        print(f"  {dtype} {cell.name} {server.name} repeat {repeat}: {run.wall_s:.2f} s", flush=True)
            report(servers, cells)
        finally:
            stop.set()
            for server in servers:
                os.killpg(server.process.pid, signal.SIGTERM)
                server.process.wait(60)


if __name__ == "__main__":
    main()
