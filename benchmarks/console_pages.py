"""How long each console page takes to produce its data, idle and during a 32-client burst.

Starts an engine server (`python -m cli serve`, SmolLM2 by default, a SQLite history), attaches the
console to it as `make run` does (PREFIX_CONSOLE_ENGINE), and runs each engine page's whole script with
Streamlit's AppTest: the seconds from the script's start to its end, which is what a browser waits for
before the page's data shows. Each page is timed with the engine idle, then again while 32 openai SDK
clients stream requests (a 1,024-token shared prefix, 32 own tokens, 16 new tokens each) through the
server's API. The goal (issue 47 item 13): under a second idle, under two seconds during the burst.

    .venv/bin/python benchmarks/console_pages.py [--model smollm2] [--clients 32] [--repeats 3]
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
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after the repository: benchmarks/storage.py must not hide storage/

import openai  # noqa: E402

from serving_peer import start_server  # noqa: E402  (benchmarks/: start a server, wait until it answers)
from tests.ports import free_port  # noqa: E402

PAGES = ("overview", "submit", "blocks", "prefix_tree", "replay", "why", "evictions", "settings")
ENTRY = ROOT / "app" / "streamlit_app.py"


def time_pages(repeats: int) -> dict[str, float]:
    from streamlit.testing.v1 import AppTest

    times: dict[str, list[float]] = {page: [] for page in PAGES}
    for _ in range(repeats):
        for page in PAGES:
            at = AppTest.from_file(str(ENTRY), default_timeout=120)
            if page != "overview":
                at.switch_page(f"../pages/{page}.py")
            started = time.perf_counter()
            at.run()
            times[page].append(time.perf_counter() - started)
            if at.exception:
                raise RuntimeError(f"{page}: {at.exception[0].value}")
    return {page: statistics.median(values) for page, values in times.items()}


def burst(url: str, model: str, clients: int, stop: threading.Event) -> None:
    """Clients streaming requests over one shared prefix until `stop` is set."""

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        rng = random.Random(0)
        prefix = [rng.randrange(100, 40000) for _ in range(1024)]

        async def one() -> None:
            while not stop.is_set():
                prompt = prefix + [rng.randrange(100, 40000) for _ in range(32)]
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                                         stream=True, extra_body={"ignore_eos": True})  # fmt: skip
                async for _ in stream:
                    pass

        await asyncio.gather(*(one() for _ in range(clients)))
        await client.close()

    asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="console-pages-"))
    db_url = f"sqlite:///{work / 'history.sqlite'}"
    argv = [sys.executable, "-m", "cli", "serve", "--model", args.model, "--port", str(free_port()), "--db", db_url,
            "--max-in-flight", "256"]  # fmt: skip
    server = start_server("the engine server", argv, dict(os.environ), work / "server.log")
    process, url = server.process, server.url
    os.environ["PREFIX_CONSOLE_ENGINE"] = url
    os.environ["PREFIX_CONSOLE_DB_URL"] = db_url
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
            import json

            model = json.loads(response.read())["data"][0]["id"]
        time_pages(1)  # the console attaches, imports and warms up once
        idle = time_pages(args.repeats)
        stop = threading.Event()
        load = threading.Thread(target=burst, args=(url, model, args.clients, stop), daemon=True)
        load.start()
        time.sleep(5)  # the burst under way
        busy = time_pages(args.repeats)
        stop.set()
        load.join(120)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    print(f"\n{args.model}, {args.clients} clients in the burst, median of {args.repeats} runs per page\n")
    print("| page | idle s | during the burst s |")
    print("|---|---|---|")
    for page in PAGES:
        print(f"| {page} | {idle[page]:.2f} | {busy[page]:.2f} |")


if __name__ == "__main__":
    main()
