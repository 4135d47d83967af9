"""The engine's tiled attention kernel against torch's CPU flash kernel, per layer, on SmolLM2's shapes.

The runner's unmasked calls (engine/runner/attention_kernels.py): a prefill's own tokens (causal) and the
queries of several requests over one shared prefix. SmolLM2-135M: 9 query heads over 3 KV heads of 64,
30 layers. Each cell runs one call per layer over 30 layers' own K/V, as the engine does, so that the
keys of a layer come from memory rather than from the caches the previous call warmed:

    cold prefill      1,056 own tokens, causal (K/V: the fresh rows of the fused projection)
    8 / 64 decodes    over a 1,024-token prefix read in place from a head-major block cache
    8 x 32 suffixes   8 requests' 32 own tokens each, causal

The two kernels alternate, `--reps` rounds of 30 layers each; the median per layer is reported with the
ratio (tiled / flash: below 1 the tiled kernel is faster). Outputs are checked against each other
(fp32 within 1e-4, bf16 within 3e-2) before anything is timed.

Run: `.venv/bin/python benchmarks/attention_kernels.py [--reps 7] [--dtype float32 --dtype bfloat16]`
(about a minute on 2 cores; `make install` builds the kernel).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.runner.attention_kernels import Kernel, attend  # noqa: E402
from engine.runner.native_kernels import load_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE = 9, 3, 64, 30, 16
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def rows_of_heads(batch: int, length: int, heads: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """[batch, heads, length, d] as the runner passes it: a transposed view of rows of heads."""
    return torch.randn(batch, length, heads, HEAD_DIM, generator=generator).to(dtype).transpose(1, 2)


def layer_calls(cell: str, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
    """(q, k, v, causal) for each of the 30 layers of one cell."""
    calls = []
    for _ in range(LAYERS):
        if cell == "cold prefill, 1,056 tokens":
            q, k, v = (rows_of_heads(1, 1056, h, dtype, generator) for h in (HEADS, KV_HEADS, KV_HEADS))
            calls.append((q, k, v, True))
        elif cell == "8 x 32 own tokens":
            q, k, v = (rows_of_heads(8, 32, h, dtype, generator) for h in (HEADS, KV_HEADS, KV_HEADS))
            calls.append((q, k, v, True))
        else:  # decodes over a prefix in a head-major block cache [KV, blocks, slots, d]
            decodes = int(cell.split()[0])
            cache = torch.randn(2, KV_HEADS, 1024 // BLOCK_SIZE, BLOCK_SIZE, HEAD_DIM, generator=generator).to(dtype)
            k, v = (c.view(1, KV_HEADS, 1024, HEAD_DIM) for c in cache)
            calls.append((rows_of_heads(1, decodes, HEADS, dtype, generator), k, v, False))
    return calls


CELLS = ("cold prefill, 1,056 tokens", "8 decodes over 1,024 keys", "64 decodes over 1,024 keys", "8 x 32 own tokens")


def per_layer_us(kernel: Kernel, calls: list[tuple]) -> float:
    started = time.perf_counter()
    for q, k, v, causal in calls:
        attend(q, k, v, scale=HEAD_DIM**-0.5, causal=causal, kernel=kernel)
    return (time.perf_counter() - started) / len(calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="default: both")
    args = parser.parse_args()
    ops, why_not = load_ops()
    if ops is None:
        sys.exit(f"the engine's kernel library is not usable: {why_not}")
    torch.set_num_threads(args.threads)
    print(f"per layer, {args.threads} threads, median of {args.reps} rounds of {LAYERS} layers")
    print("| cell | dtype | tiled | CPU flash | tiled / flash |\n|---|---|---|---|---|")
    for dtype in [getattr(torch, name) for name in (args.dtype or ["float32", "bfloat16"])]:
        generator = torch.Generator().manual_seed(0)
        for cell in CELLS:
            calls = layer_calls(cell, dtype, generator)
            q, k, v, causal = calls[0]
            tiled, _ = attend(q, k, v, scale=HEAD_DIM**-0.5, causal=causal, kernel=Kernel.CPU_TILED)
            flash, _ = attend(q, k, v, scale=HEAD_DIM**-0.5, causal=causal, kernel=Kernel.CPU_FLASH)
            error = (tiled.float() - flash.float()).abs().max().item()
            if not error <= TOLERANCE[dtype]:
                sys.exit(f"{cell}, {dtype}: the kernels differ by {error:.3g}")
            times: dict[Kernel, list[float]] = {Kernel.CPU_TILED: [], Kernel.CPU_FLASH: []}
            for _ in range(args.reps):
                for kernel in times:
                    times[kernel].append(per_layer_us(kernel, calls))
            tiled_us, flash_us = (statistics.median(times[kernel]) for kernel in (Kernel.CPU_TILED, Kernel.CPU_FLASH))
            name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
            print(f"| {cell} | {name} | {tiled_us:,.0f} us | {flash_us:,.0f} us | {tiled_us / flash_us:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
