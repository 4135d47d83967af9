"""When cascade attention pays on the CPU: the measurement behind `engine.runner.attention_plan.CPU_CASCADE`.

Model: SmolLM2-135M's attention (30 layers, 9 query heads over 3 KV heads of 64, fp32) with random
weights and its MLP and vocabulary shrunk (benchmarks/random_models.py), so that a step is mostly
attention; block size 16, as the engine's default.

Each cell is one step of R chunks whose tables share D leading blocks (a parent's prefix, as forks or
prefix hits hold it), on scattered physical blocks (gathered once by cascade) or consecutive ones (read
in place by cascade); private blocks are always scattered:

    decode    each chunk holds 40 private tokens after the shared blocks and adds one
    prefill   each chunk adds 32 tokens right after the shared blocks (a prefix hit's suffix);
              R = 1 is a lone request with a cached prefix (cascade splits its prefix off)

Two runners on the same weights and tables run the same step: the plain path (`NO_CASCADE`) and cascade
for every shareable run (`ALWAYS_CASCADE`). Their outputs are checked equal (1e-4) and their times taken
interleaved, `--reps` rounds; each side's fastest round is kept (the one least disturbed by other
processes on a shared machine) and the difference is reported per layer (cascade minus plain, negative =
cascade faster), by wall clock and by process CPU time. Before every timed step a 1 GiB buffer is read:
in the real model each layer's K/V comes from memory, because 540 MB of weights (SmolLM2) stream through
the caches between two reads of it, and without the flush this small model's whole step stays cached.

The x axis is the rule's: block copies a layer saves, (R - 1) x D gathered or R x D in place. The
threshold fitted is the one that misclassifies fewest cells, decode and prefill together, per clock.

Run: `.venv/bin/python benchmarks/cascade_attention.py` (about 8 minutes on 2 cores) or `--quick`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/prefix_reuse.py

import torch  # noqa: E402

from benchmarks.random_models import SMOLLM2_ATTENTION, write_random_model  # noqa: E402
from engine.core.arith import ceil_div  # noqa: E402
from engine.core.config import EngineConfig  # noqa: E402
from engine.runner.attention_plan import ALWAYS_CASCADE, CPU_CASCADE, NO_CASCADE  # noqa: E402
from engine.runner.model_runner import ModelRunner, SeqChunk  # noqa: E402
from engine.runner.model_loading import load_model  # noqa: E402

BLOCK_SIZE = 16
PRIVATE_TOKENS = 40  # a decode's own tokens after the shared blocks
SUFFIX_TOKENS = 32  # a prefill chunk's tokens after the shared blocks
DECODE_GRID = ((1, 2, 4, 8, 16, 64), (1, 2, 4, 8, 16, 64))  # sharers R, shared blocks D
PREFILL_GRID = ((1, 2, 8), (1, 4, 16, 64))
QUICK_DECODE_GRID = ((2, 8), (1, 16))
QUICK_PREFILL_GRID = ((1,), (16,))
LAYOUTS = ("scattered", "consecutive")


class CacheFlush:
    """Reading it pushes every cached K/V block out of the CPU caches, as a real model's weights do."""

    def __init__(self, num_bytes: int = 1 << 30) -> None:
        self.buffer = torch.ones(num_bytes // 4)

    def __call__(self) -> None:
        self.buffer.sum()


class Cell:
    """One step's chunks for both runners, with its prefix and private tokens already in their blocks."""

    def __init__(self, runners, sharers: int, shared_blocks: int, decode: bool, consecutive: bool, rng: random.Random):
        num_blocks = runners[0].num_blocks[0]
        if consecutive:
            first = rng.randrange(num_blocks - shared_blocks)
            shared = list(range(first, first + shared_blocks))
        free = [b for b in rng.sample(range(num_blocks), num_blocks) if not consecutive or b not in shared]
        if not consecutive:
            shared = [free.pop() for _ in range(shared_blocks)]
        prefix_len = shared_blocks * BLOCK_SIZE
        own_len = PRIVATE_TOKENS if decode else 0
        new_len = 1 if decode else SUFFIX_TOKENS
        own_blocks = ceil_div(own_len + new_len, BLOCK_SIZE)
        tables = [shared + [free.pop() for _ in range(own_blocks)] for _ in range(sharers)]
        vocab = runners[0].loaded.vocab_size
        prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
        own = [[rng.randrange(3, vocab) for _ in range(own_len)] for _ in tables]
        for runner in runners:
            runner.execute([SeqChunk.of_table(prefix, 0, shared)])
            if own_len:
                runner.execute([SeqChunk.of_table(o, prefix_len, t) for o, t in zip(own, tables)])
        start = prefix_len + own_len
        self.chunks = [SeqChunk.of_table([rng.randrange(3, vocab) for _ in range(new_len)], start, t) for t in tables]

    def time(self, runner: ModelRunner, flush: CacheFlush) -> tuple[tuple[float, float], torch.Tensor]:
        """((wall, process CPU) seconds, logits) of one step, its K/V out of the caches."""
        flush()
        t0, c0 = time.perf_counter(), time.process_time()
        logits = runner.execute(self.chunks)
        return (time.perf_counter() - t0, time.process_time() - c0), logits


def measure(runners, flush: CacheFlush, sharers: int, shared_blocks: int, decode: bool, consecutive: bool, reps: int, rng):
    """Per clock (wall, CPU): (difference per layer in ms, plain ms, cascade ms), each side's fastest round."""
    plain, cascade = runners
    cell = Cell(runners, sharers, shared_blocks, decode, consecutive, rng)
    _, want = cell.time(plain, flush)
    _, got = cell.time(cascade, flush)
    if not (got - want).abs().max().item() < 1e-4:
        raise AssertionError(f"R={sharers} D={shared_blocks}: cascade differs from the plain path")
    rounds = []
    for rep in range(reps):
        order = (plain, cascade) if rep % 2 == 0 else (cascade, plain)
        times = {id(r): cell.time(r, flush)[0] for r in order}
        rounds.append((times[id(plain)], times[id(cascade)]))
    results = []
    for clock in (0, 1):
        fastest_plain, fastest_cascade = min(p[clock] for p, _ in rounds), min(c[clock] for _, c in rounds)
        diff = (fastest_cascade - fastest_plain) / plain.loaded.num_layers * 1e3
        results.append((diff, fastest_plain * 1e3, fastest_cascade * 1e3))
    return results


def saved_copies(sharers: int, shared_blocks: int, consecutive: bool) -> int:
    return (sharers - (0 if consecutive else 1)) * shared_blocks


def fit_threshold(cells: list[tuple[str, int, int, bool, float]]) -> tuple[int, list]:
    """The threshold on saved copies misclassifying fewest cells (ties: the smallest), and those cells."""
    best = None
    for threshold in sorted({saved_copies(r, d, c) for _, r, d, c, _ in cells} | {0}):
        wrong = [cell for cell in cells if (saved_copies(*cell[1:4]) >= threshold) != (cell[4] < 0)]
        if best is None or len(wrong) < len(best[1]):
            best = (threshold, wrong)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4-cell smoke run")
    parser.add_argument("--reps", type=int, default=None, help="interleaved rounds per cell (default 7, quick 3)")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    decode_grid, prefill_grid = (QUICK_DECODE_GRID, QUICK_PREFILL_GRID) if args.quick else (DECODE_GRID, PREFILL_GRID)
    num_blocks = max(decode_grid[0]) * 4 + max(decode_grid[1]) + max(prefill_grid[0]) * 3 + max(prefill_grid[1]) + 8
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        path = write_random_model(SMOLLM2_ATTENTION, Path(directory), dtype=torch.float32)
        loaded = [load_model(EngineConfig(model=str(path), device="cpu", data_dir=Path(directory))) for _ in range(2)]
    runners = (
        ModelRunner(loaded[0], num_blocks, BLOCK_SIZE, cascade=NO_CASCADE),
        ModelRunner(loaded[1], num_blocks, BLOCK_SIZE, cascade=ALWAYS_CASCADE),
    )
    rng = random.Random(0)
    flush = CacheFlush()
    print(
        f"SmolLM2-135M attention shape (30 layers, 9/3 heads of 64, MLP and vocab shrunk), fp32, CPU, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; block size {BLOCK_SIZE}; "
        f"{reps} interleaved rounds per cell; 'diff' = cascade minus plain per layer (negative: cascade faster)",
        flush=True,
    )
    cells = []
    for kind, grid in (("decode", decode_grid), ("prefill", prefill_grid)):
        sharers_list, depths = grid
        print(f"\n{kind}: one step of R chunks sharing D blocks " + (
            f"(each with {PRIVATE_TOKENS} private tokens, adding 1)" if kind == "decode" else f"(each adding {SUFFIX_TOKENS})"))
        print(f"  {'R':>3s} {'D':>3s} {'shared blocks':>13s} {'saved':>6s}         {'plain':>9s} {'cascade':>9s} {'ratio':>5s} "
              f"{'diff/layer':>10s}        {'plain':>9s} {'cascade':>9s} {'ratio':>5s} {'diff/layer':>10s}")
        for sharers in sharers_list:
            for depth in depths:
                for layout in LAYOUTS:
                    consecutive = layout == "consecutive"
                    if saved_copies(sharers, depth, consecutive) == 0 and sharers > 1:
                        continue
                    per_clock = measure(runners, flush, sharers, depth, kind == "decode", consecutive, reps, rng)
                    columns = "   ".join(
                        f"{'wall' if clock == 0 else 'CPU':>4s}: {p:7.2f}ms {c:7.2f}ms {c / p:5.2f}x {d * 1e3:7.0f} us"
                        for clock, (d, p, c) in enumerate(per_clock)
                    )
                    print(f"  {sharers:3d} {depth:3d} {layout:>13s} {saved_copies(sharers, depth, consecutive):6d}   {columns}", flush=True)
                    cells.append((kind, sharers, depth, consecutive, per_clock[0][0], per_clock[1][0]))
    for clock, name in ((0, "wall clock"), (1, "process CPU time")):
        threshold, wrong = fit_threshold([cell[:4] + (cell[4 + clock],) for cell in cells])
        print(
            f"\nfitted on {name}: cascade when it saves >= {threshold} block copies per layer ({len(wrong)} of "
            f"{len(cells)} cells on the wrong side" + (": " + ", ".join(
                f"{k} R={r} D={d} {'consecutive' if c else 'scattered'} ({x * 1e3:+.0f} us)" for k, r, d, c, x in wrong
            ) if wrong else "") + ")"
        )
    print(f"the engine's CPU_CASCADE uses min_saved_blocks={CPU_CASCADE.min_saved_blocks}")
    print(f"total {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
