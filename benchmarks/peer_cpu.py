"""This engine against the CPU engines operators pick: vLLM's CPU build, llama.cpp's server, OpenVINO GenAI.

The cells are benchmarks/peer_vllm.py's (a 1,024-token shared prefix, 32-token private suffixes, N
requests at once, M new tokens, cached or cold, a single cached request after 5 s idle), each run twice:
on a quiet machine and beside a neighbour, a process that busy-loops 50 ms of every 200 ms on one core
(what an operator's machine has: a log shipper, a cron job, another service). Every engine loads the
same SmolLM2-135M safetensors, decodes greedily with EOS ignored from the same token ids, two threads,
its prefix caching on:

- this engine (`.venv`): the console's OpenMP settings and thread governor, block size 16;
- vLLM's CPU build (`.venv-vllm`, `make peer-vllm`'s environment), block size 32;
- llama.cpp (`.venv-llamacpp`): `llama-server` built from source for this CPU, over GGUFs that llama.cpp's
  own `convert_hf_to_gguf.py` wrote from the safetensors at F32 and BF16 (data/peer-cpu/);
- OpenVINO GenAI (`.venv-openvino`): `ContinuousBatchingPipeline` over the IR that optimum-intel exported
  from the safetensors at FP32 (optimum-intel writes no BF16 IR: OpenVINO's bf16 is a runtime precision
  hint over that IR, honoured only on CPUs with bf16 instructions).

`make peer-cpu` builds the three peer environments and the converted models once. How each peer is
driven, and which of its settings were chosen and why, is in benchmarks/peer_cpu_worker.py. Each engine is
a resident worker process, so none pays start-up or compilation inside a measurement; repeats interleave
the engines (the order rotates each repeat) on the same prompts, every repeat drawing new ones, and the
machine is let settle before each turn (peer_vllm.wait_until_quiet). The neighbour is paused while the
machine settles, then resumed 0.4 s before the engine's turn (reset, warm-up, idle, timed batch) and
paused again after it.

The table: per cell and neighbour, each engine's median seconds (submit to last token); for each peer, the
ratio this engine / peer (above 1: the peer is faster, shown in bold) and how many requests' greedy
outputs equal this engine's. fp32 outputs that differ from vLLM's make the exit status 1 (as in
peer_vllm.py); llama.cpp's and OpenVINO's are counted only: their kernels sum in other orders, and
random-token prompts leave near-ties.

Run: `make peer-cpu`, or `.venv/bin/python benchmarks/peer_cpu.py [--quick] [--repeats 3]
[--engine llamacpp --engine openvino] [--dtype float32] [--neighbour quiet|neighbour|both] [--cell TEXT]`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from peer_cpu_models import GGUF_NAMES, OPENVINO_NAME
from peer_vllm import (
    CELLS, PREFIX_TOKENS, QUICK_CELLS, SUFFIX_TOKENS, VLLM_BLOCK_SIZE, Cell, Worker, neighbour_loop, prompts_for,
    wait_until_quiet,
)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "peer_cpu_worker.py"
THIS_BLOCK_SIZE = 16
ENGINES = ("this", "vllm", "llamacpp", "openvino")  # the table's column order; "this" always runs
LABELS = {"this": "this engine", "vllm": "vLLM CPU", "llamacpp": "llama.cpp server", "openvino": "OpenVINO GenAI"}
PYTHONS = {
    "this": ROOT / ".venv" / "bin" / "python",
    "vllm": ROOT / ".venv-vllm" / "bin" / "python",
    "llamacpp": ROOT / ".venv-llamacpp" / "bin" / "python",
    "openvino": ROOT / ".venv-openvino" / "bin" / "python",
}


def model_path(engine: str, dtype: str, safetensors_dir: Path, peer_dir: Path) -> Path:
    """What the engine's worker loads: the safetensors folder, a GGUF at the dtype, or the OpenVINO IR."""
    if engine == "llamacpp":
        return peer_dir / GGUF_NAMES[dtype]
    if engine == "openvino":
        return peer_dir / OPENVINO_NAME
    return safetensors_dir


def start_workers(engines: list[str], dtype: str, models: tuple[Path, Path], threads: int) -> dict[str, Worker]:
    """One worker per engine for one dtype, started together, returned once all are ready."""
    from engine.openmp import OPENMP_SETTINGS, set_openmp_defaults  # main() put the repository on the path

    this_env = {key: value for key, value in os.environ.items() if key not in OPENMP_SETTINGS}
    set_openmp_defaults(this_env)
    envs = {
        "this": this_env,
        "vllm": {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"},
    }
    block_sizes = {"this": THIS_BLOCK_SIZE, "vllm": VLLM_BLOCK_SIZE}
    workers = {}
    for engine in engines:
        args = ["--model-dir", str(model_path(engine, dtype, *models)), "--dtype", dtype, "--threads", str(threads),
                "--block-size", str(block_sizes.get(engine, THIS_BLOCK_SIZE))]
        env = envs.get(engine, dict(os.environ))
        workers[engine] = Worker(engine, PYTHONS[engine], args, env, script=WORKER, log_name="peer-cpu")
    for worker in workers.values():
        worker.wait_ready()
    return workers


@dataclass(frozen=True)
class Variant:
    """A cell as run: quiet, or beside the neighbour."""

    cell: Cell
    neighbour: bool

    def prompt_cell(self) -> Cell:
        """The cell whose name seeds the prompts: the neighbour's runs draw their own, so no cache holds them."""
        return replace(self.cell, name=self.cell.name + " | neighbour") if self.neighbour else self.cell


def measure(worker: Worker, variant: Variant, prompts: tuple[list[int], list[list[int]]], neighbour: int) -> dict:
    """The worker's reply to the timed run (seconds, outputs), the neighbour running around it if asked."""
    warm, timed = prompts
    wait_until_quiet()
    if variant.neighbour:
        os.kill(neighbour, signal.SIGCONT)
        time.sleep(0.4)
    try:
        worker.ask({"op": "reset"})
        if variant.cell.cached:
            worker.ask({"op": "run", "prompts": [warm], "max_tokens": 1})
        time.sleep(variant.cell.idle_s)
        return worker.ask({"op": "run", "prompts": timed, "max_tokens": variant.cell.new_tokens})
    finally:
        if variant.neighbour:
            os.kill(neighbour, signal.SIGSTOP)


@dataclass
class Row:
    """One variant's measurements: each engine's seconds per repeat, its outputs equal to this engine's."""

    variant: Variant
    seconds: dict[str, list[float]]
    same: dict[str, int]  # per peer: requests whose greedy outputs equal this engine's
    total: int
    threads: list[str]  # this engine's forward threads after each repeat (the thread governor's count)

    def format(self, engines: list[str]) -> str:
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[self.variant.cell.dtype]
        this = statistics.median(self.seconds["this"])
        cells = [f"{this:.2f} s"]
        for peer in engines[1:]:
            median = statistics.median(self.seconds[peer])
            ratio = f"{this / median:.2f}x"
            cells.append(f"{median:.2f} s · {f'**{ratio}**' if this > median else ratio} · {self.same[peer]}/{self.total}")
        where = "neighbour" if self.variant.neighbour else "quiet"
        return (f"| {self.variant.cell.name} | {dtype} | {where} | {' | '.join(cells)} | "
                f"{', '.join(sorted(set(self.threads)))} |")


def header(engines: list[str]) -> str:
    peers = [f"{LABELS[peer]} (s · this/peer · same)" for peer in engines[1:]]
    columns = ["cell", "dtype", "machine", "this engine", *peers, "this engine's threads"]
    return f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}"


def run_variant(variant: Variant, workers: dict[str, Worker], repeats: int, neighbour: int) -> Row:
    from engine.runner.model_loading import SMOLLM2_VOCAB_SIZE

    engines = list(workers)
    row = Row(variant, {name: [] for name in engines}, dict.fromkeys(engines[1:], 0), 0, [])
    for repeat in range(repeats):
        prompts = prompts_for(variant.prompt_cell(), repeat, SMOLLM2_VOCAB_SIZE)
        outputs = {}
        for name in engines[repeat % len(engines):] + engines[:repeat % len(engines)]:
            reply = measure(workers[name], variant, prompts, neighbour)
            outputs[name] = reply["outputs"]
            row.seconds[name].append(reply["seconds"])
            if name == "this":
                row.threads.append(reply["threads"])
        for peer in engines[1:]:
            row.same[peer] += sum(a == b for a, b in zip(outputs["this"], outputs[peer]))
        row.total += len(prompts[1])
    return row


def missing_setup(engines: list[str], dtypes: list[str], models: tuple[Path, Path]) -> list[str]:
    """The interpreters and converted models the chosen engines need that are not there."""
    needed = [PYTHONS[engine] for engine in engines]
    needed += [model_path(engine, dtype, *models) for engine in engines for dtype in dtypes]
    return [str(path) for path in needed if not path.exists()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the small cells, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per cell (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", action="append", choices=ENGINES[1:], help="peers to run (default: all)")
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="default: both")
    parser.add_argument("--neighbour", choices=("quiet", "neighbour", "both"), default="both")
    parser.add_argument("--cell", action="append", help="only cells whose name contains this text (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine.core.config import default_data_dir
    from engine.runner.model_loading import ensure_smollm2_converted

    data_dir = default_data_dir()
    models = (ensure_smollm2_converted(data_dir), data_dir / "peer-cpu")
    engines = ["this", *(e for e in ENGINES[1:] if e in (args.engine or ENGINES))]
    dtypes = args.dtype or ["float32", "bfloat16"]
    missing = missing_setup(engines, dtypes, models)
    if missing:
        sys.exit(f"missing: {', '.join(missing)} (`make peer-cpu` builds the peers' environments and models)")
    repeats = args.repeats or (1 if args.quick else 3)
    places = {"quiet": (False,), "neighbour": (True,), "both": (False, True)}[args.neighbour]
    (ROOT / "artifacts").mkdir(exist_ok=True)
    neighbour = multiprocessing.Process(target=neighbour_loop, daemon=True)
    neighbour.start()
    os.kill(neighbour.pid, signal.SIGSTOP)
    print(f"SmolLM2-135M, {PREFIX_TOKENS}-token shared prefix, {SUFFIX_TOKENS}-token suffixes, greedy, ignore EOS, "
          f"{args.threads} threads each; {repeats} interleaved repeats; {os.cpu_count()} CPUs; "
          f"neighbour: 50 ms busy of every 200 ms on CPU 0")
    print(header(engines), flush=True)
    rows: list[Row] = []
    try:
        for dtype in dtypes:
            cells = [c for c in (QUICK_CELLS if args.quick else CELLS)
                     if c.dtype == dtype and (not args.cell or any(text in c.name for text in args.cell))]
            if not cells:
                continue
            started = time.perf_counter()
            workers = start_workers(engines, dtype, models, args.threads)
            print(f"<!-- {dtype}: all engines ready after {time.perf_counter() - started:.0f} s -->", flush=True)
            try:
                for cell in cells:
                    for place in places:
                        rows.append(run_variant(Variant(cell, place), workers, repeats, neighbour.pid))
                        print(rows[-1].format(engines), flush=True)
            finally:
                for worker in workers.values():
                    worker.close()
    finally:
        neighbour.kill()
    if args.json:
        args.json.write_text(json.dumps([
            {"cell": r.variant.cell.name, "dtype": r.variant.cell.dtype, "neighbour": r.variant.neighbour,
             "seconds": r.seconds, "same": r.same, "total": r.total, "threads": r.threads} for r in rows
        ], indent=1))
    different = sum(r.total - r.same["vllm"] for r in rows if "vllm" in r.same and r.variant.cell.dtype == "float32")
    if different:
        sys.exit(f"{different} requests' fp32 greedy outputs differ between this engine and vLLM")


if __name__ == "__main__":
    main()
