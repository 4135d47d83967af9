"""Linear layers on weights packed once for oneDNN, for models running on the CPU.

`F.linear` (what transformers calls) hands the weight to the BLAS in its plain row-major layout on every
call; oneDNN's matmul reads a weight reordered once into its blocked layout (`mkldnn._reorder_linear_weight`)
faster. Measured on SmolLM2-135M, two threads, process wall time:

    30 decoder layers (210 distinct weights, so they stream from memory)
        fp32    1 row 23 ms vs F.linear 36     8 rows 23 vs 43     64 rows 73 vs 108
        bf16    1 row 13 ms vs F.linear 18     8 rows 14 vs 22     64 rows 40 vs 50   (bit-identical results)
    the LM head (49,152 x 576)
        fp32    1 row 4.7 ms vs F.linear 9.9   8 rows 4.8 vs 17.3  64 rows 18 vs 35
        bf16    1 row 2.5 ms vs F.linear 4.5   8 rows 2.4 vs 4.5   64 rows 10 vs 13

So every decoder-layer linear and the LM head get a packed copy of their weight, whatever the number of
rows (an earlier measurement on one thread had MKL's matrix-vector product ahead for one row; with the
engine's two threads it is not). fp32 results differ from `F.linear`'s in the last bits (another
summation order: ~5e-5 on SmolLM2's logits); bf16's do not. Fusing a gated MLP's gate and up
projections into one packed weight measured no faster in the engine, fp32 or bf16, and is not done.

The original weights stay in place (state dicts, tied embeddings, the reference forward and other devices
are unchanged); the packed copies cost as much memory again as the packed layers' weights (SmolLM2 fp32:
425 MB of decoder linears, 113 MB of LM head).
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 32  # rows oneDNN's weight layout is chosen for (measured best of 1, 8, 32 and none)


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-packed copy of its weight (same parameters, same results up to
    summation order)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the weight's packed copy (`pack_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-packed copy of a linear layer's [out_features, in_features] weight (CPU, fp32 or bf16)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears on this device and dtype run on packed weights (the CPU with oneDNN, fp32 or bf16)."""
    return device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` of the model's decoder layers, and its LM head, by a `PackedLinear`, on the CPU.

    Idempotent (packed layers are skipped). Does nothing off the CPU, for dtypes other than fp32/bf16,
    or without oneDNN. Returns how many layers were packed.
    """
    if not packs_linears(device, dtype):
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return 0
    targets = [
        (parent, name, child)
        for parent in layers.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    if type(getattr(model, "lm_head", None)) is nn.Linear:
        targets.append((model, "lm_head", model.lm_head))
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
