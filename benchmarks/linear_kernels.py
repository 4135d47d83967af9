"""The engine's panel linear kernel against oneDNN's packed matmul and F.linear, on SmolLM2's linears.

engine/runner/packed_linear.py runs a linear of up to `PANEL_ROWS` rows on the panel kernel
(engine/runner/csrc/panel_linear.cpp) and the rest on oneDNN, both over weights packed once. SmolLM2-135M's
decoder linears per layer: q|k|v 960 x 576, o 576 x 576, gate|up 3,072 x 576, down 576 x 1,536, over 30
layers, each layer's weights its own (425 MB in fp32), so that they stream from memory as in a decode step;
and its LM head, 49,152 x 576.

Per row count the three run in turn, `--reps` rounds; the median per pass is reported, with GFLOP/s and
the ratio panels / oneDNN (below 1 the panels are faster). Results are checked against F.linear in float64
(within the bound of a float32 sum, plus one bf16 rounding) before anything is timed.

Run: `.venv/bin/python benchmarks/linear_kernels.py [--reps 7] [--dtype float32 --dtype bfloat16]
[--rows 1,8,64]` (about two minutes on 2 cores; `make install` builds the kernel).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from engine.runner.native_kernels import load_ops  # noqa: E402
from engine.runner.packed_linear import pack_weight  # noqa: E402

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of SmolLM2's fused linears
LM_HEAD = (49152, 576)
LAYERS = 30
ROWS = (1, 8, 32, 64, 128, 256, 1056)


def check(x: torch.Tensor, weight: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """Exit unless `got` is within the error bound of a float32 sum over K (plus a bf16 rounding)."""
    exact = x.double() @ weight.double().T
    bound = (x.shape[1] + 1) * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    if got.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8
    excess = ((got.double() - exact).abs() - bound).max().item()
    if excess > 0:
        sys.exit(f"{what}: off by {excess:.3g} beyond the error bound")


def timed_ms(passes: list, reps: int) -> dict[str, float]:
    """Median ms per pass of each way, the ways interleaved `reps` times."""
    times: dict[str, list[float]] = {name: [] for name, _ in passes}
    for _ in range(reps):
        for name, run in passes:
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="default: both")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    args = parser.parse_args()
    ops, why_not = load_ops()
    if ops is None:
        sys.exit(f"the engine's kernel library is not usable: {why_not}")
    torch.set_num_threads(args.threads)
    rows_list = [int(value) for value in args.rows.split(",")]
    print(f"{args.threads} threads, median of {args.reps} passes")
    print("| linears | dtype | rows | panels | oneDNN | F.linear | panels / oneDNN |\n|---|---|---|---|---|---|---|")
    for dtype in [getattr(torch, name) for name in (args.dtype or ["float32", "bfloat16"])]:
        generator = torch.Generator().manual_seed(0)
        sets = {
            f"{LAYERS} decoder layers": [torch.randn(*shape, generator=generator).to(dtype) for _ in range(LAYERS) for shape in LAYER_SHAPES],
            "LM head": [torch.randn(*LM_HEAD, generator=generator).to(dtype) / 8],
        }
        for label, weights in sets.items():
            packed = [pack_weight(weight) for weight in weights]
            flops_per_row = 2 * sum(weight.numel() for weight in weights)
            for rows in rows_list:
                inputs = {shape: torch.randn(rows, shape, generator=generator).to(dtype) for shape in {w.shape[1] for w in weights}}
                first = inputs[weights[0].shape[1]]
                check(first, weights[0], ops.panel_linear(first, packed[0].panels, None), f"{label}, {rows} rows, panels")
                check(first, weights[0], torch.ops.mkldnn._linear_pointwise(first, packed[0].onednn, None, "none", [], ""),
                      f"{label}, {rows} rows, oneDNN")

                def panels() -> None:
                    for weight, pack in zip(weights, packed):
                        ops.panel_linear(inputs[weight.shape[1]], pack.panels, None)

                def onednn() -> None:
                    for weight, pack in zip(weights, packed):
                        torch.ops.mkldnn._linear_pointwise(inputs[weight.shape[1]], pack.onednn, None, "none", [], "")

                def plain() -> None:
                    for weight in weights:
                        F.linear(inputs[weight.shape[1]], weight)

                panels(), onednn(), plain()  # warm
                ms = timed_ms([("panels", panels), ("oneDNN", onednn), ("F.linear", plain)], args.reps)
                name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
                cells = " | ".join(f"{ms[way]:,.1f} ms ({flops_per_row * rows / ms[way] / 1e6:,.0f} GFLOP/s)" for way in ms)
                print(f"| {label} | {name} | {rows} | {cells} | {ms['panels'] / ms['oneDNN']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
