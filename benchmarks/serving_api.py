"""The HTTP layer's cost: the same workload through the Python API and through the OpenAI-compatible API.

Workload: N requests share a P-token prefix (cached before timing starts), each adds its own S tokens and
generates T tokens greedily (EOS ignored). Two shapes, each on the Python API and on the HTTP API (the
official openai SDK, streaming, against serving/server.py on 127.0.0.1):

    burst        all N arrive together: requests/s = N / (last token - t0), TTFT per request
    one by one   N requests in turn: TTFT and end-to-end latency of a lone request

TTFT is measured by the client in both cases: from just before the call to the first token seen (the
engine's own first_token_time for the Python API, which its caller could see no sooner; the first SSE
chunk for the HTTP API). Defaults: tiny-chat (random weights: the model is cheap, so the HTTP layer's
share shows), N=32, P=96, S=8, T=16, block size 16.

    .venv/bin/python benchmarks/serving_api.py [--model tiny-chat] [--requests 32] ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine.openmp import set_openmp_defaults  # noqa: E402  (stdlib only)

set_openmp_defaults()  # as `python -m cli serve` and the console run torch

import openai  # noqa: E402

from engine.core.config import EngineConfig  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.engine import Engine  # noqa: E402
from serving.server import ApiServer  # noqa: E402

ENDED = ("finished", "aborted", "failed", "rejected")


def prompts(n: int, prefix: int, suffix: int, vocab: int) -> list[list[int]]:
    shared = [(7 * i) % (vocab - 10) + 5 for i in range(prefix)]
    return [shared + [(13 * i + 31 * j) % (vocab - 10) + 5 for j in range(suffix)] for i in range(n)]


def python_burst(engine: Engine, batch: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.time()
    ids = [engine.submit(p, sampling) for p in batch]
    while any(engine.get(i).status not in ENDED for i in ids):
        time.sleep(0.001)
    views = [engine.get(i) for i in ids]
    return time.time() - t0, [v.first_token_time - t0 for v in views]


def python_one(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    t0 = time.time()
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    while engine.get(rid).status not in ENDED:
        time.sleep(0.0005)
    view = engine.get(rid)
    return view.first_token_time - t0, view.finish_time - t0


async def http_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], new_tokens: int,
                       t0: float) -> tuple[float, float]:  # fmt: skip
    first = None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    async for chunk in stream:
        if first is None and any(choice.token_ids for choice in chunk.choices):
            first = time.time() - t0
    return first or float("nan"), time.time() - t0


async def http_burst(client, model, batch, new_tokens) -> tuple[float, list[float]]:
    t0 = time.time()
    results = await asyncio.gather(*(http_request(client, model, p, new_tokens, t0) for p in batch))
    return time.time() - t0, [ttft for ttft, _ in results]


def summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{name} median {statistics.median(ms):.1f} ms, p90 {ms[int(0.9 * (len(ms) - 1))]:.1f} ms"


def run_http(url: str, model: str, batch: list[list[int]], new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """The HTTP measurements, as a separate client process runs them."""

    async def measure() -> dict[str, list[float]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out: dict[str, list[float]] = {"rates": [], "ttfts": [], "lone_ttft": [], "lone_e2e": []}
        for _ in range(rounds):
            elapsed, firsts = await http_burst(client, model, batch, new_tokens)
            out["rates"].append(len(batch) / elapsed)
            out["ttfts"] += firsts
        for prompt in batch:
            ttft, e2e = await http_request(client, model, prompt, new_tokens, time.time())
            out["lone_ttft"].append(ttft)
            out["lone_e2e"].append(e2e)
        await client.close()
        return out

    return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-chat")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=96)
    parser.add_argument("--suffix", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # URL: run as the HTTP client process
    parser.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        batch = prompts(args.requests, args.prefix, args.suffix, args.vocab)
        print(json.dumps(run_http(args.client, args.model, batch, args.new_tokens, args.rounds)))
        return
    engine = Engine(EngineConfig(model=args.model, device="cpu", num_blocks=1024))
    engine.warm_up()
    engine.start()
    server = ApiServer(lambda: engine, port=0)
    batch = prompts(args.requests, args.prefix, args.suffix, engine.vocab_size)
    python_burst(engine, batch[:1], 1)  # the shared prefix is cached before anything is timed
    python: dict[str, list[float]] = {"rates": [], "ttfts": [], "lone_ttft": [], "lone_e2e": []}
    for _ in range(args.rounds):
        elapsed, firsts = python_burst(engine, batch, args.new_tokens)
        python["rates"].append(len(batch) / elapsed)
        python["ttfts"] += firsts
    for prompt in batch:
        ttft, e2e = python_one(engine, prompt, args.new_tokens)
        python["lone_ttft"].append(ttft)
        python["lone_e2e"].append(e2e)
    command = [sys.executable, __file__, "--client", server.url, "--model", str(engine.loaded.model_id),
               "--vocab", str(engine.vocab_size), *sys.argv[1:]]  # fmt: skip
    http = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    server.close()
    engine.stop()
    print(f"{args.model}: {args.requests} requests, prefix {args.prefix} (cached), suffix {args.suffix}, "
          f"{args.new_tokens} new tokens, {args.rounds} rounds; the HTTP client is another process")  # fmt: skip
    for name, results in (("python", python), ("http  ", http)):
        rate = statistics.median(results["rates"])
        print(f"  {name} burst {rate:.1f} requests/s, {summary('TTFT', results['ttfts'])}; "
              f"one by one {summary('TTFT', results['lone_ttft'])}, {summary('end to end', results['lone_e2e'])}")


if __name__ == "__main__":
    main()
