"""Linear layers on weights packed once, for models running on the CPU.

`F.linear` (what transformers calls) hands the weight to the BLAS in its plain row-major layout on every
call. Here each weight is packed once, twice over:

- for oneDNN's matmul, in its blocked layout (`mkldnn._reorder_linear_weight`);
- in column panels for the engine's own kernel (`panel_linear`, engine/runner/csrc/panel_linear.cpp), so
  that a thread streams its panels from memory in one sequential pass: float32 [N / 32, K, 32]; bf16 in
  pairs along K for the CPU's bf16 dot products where it has them (avx512_bf16), else like float32.

Calls of up to `PANEL_ROWS` rows (decode steps, small batches) run on the panels, the rest on oneDNN.
Measured by benchmarks/linear_kernels.py on SmolLM2-135M, two threads: 30 decoder layers (210 distinct
weights, so they stream from memory), ms per pass:

    rows                       1      8      32     64     128    256    1056
    fp32 panels                13.2   13.3   33.7   65.4   128    257    1040
    fp32 oneDNN                18.7   19.8   41.3   70.4   134    252    1017
    fp32 F.linear              32.5   39.8   82.2   101    173    312    1186
    bf16 panels (dot products) 6.2    6.9    18.9   34.0   64.8   129    545
    bf16 oneDNN                11.4   12.4   23.8   44.9   72.9   134    536

The LM head (49,152 x 576) agrees: fp32 1 row 3.3 ms vs 4.2, 8 rows 3.4 vs 4.5, 64 rows 17.6 vs 17.9,
128 rows 34.7 vs 33.5; bf16 1 row 1.1 vs 2.0, 8 rows 1.8 vs 2.4. Without the bf16 dot products the panel
kernel widens bf16 to float32 and multiplies there: faster than oneDNN's bf16 kernels (which use the dot
products) only up to about 4 rows (1 row 8-10 ms vs 14-17, 8 rows even, 32 rows 44 vs 27), so such
panels serve at most `WIDENED_BF16_ROWS`.

Results differ from `F.linear`'s in the last bits (another summation order: ~5e-5 on SmolLM2's logits in
fp32; in bf16 a rounding flips now and then). The panel kernel computes each output the same way whatever the number of rows, so a row's result
does not depend on the rows beside it. Fusing a gated MLP's gate and up projections into one weight
measured no faster (oneDNN, fp32 or bf16); the decoder forward (engine/runner/decoder_forward.py) fuses
them for its fused elementwise step.

Where oneDNN has no bf16 matmul (no AVX-512 BW/VL/DQ nor AVX-NE-CONVERT: an AVX2 machine), a bf16
weight's oneDNN copy is widened to float32 and the calls above the panels' rows widen their input and
round their output back: the same products (exact in float32) summed in another order. Its cost is
memory: that copy is twice the bf16 weight's size.

The original weights stay in place (state dicts, tied embeddings, the reference forward and other devices
are unchanged); each packed layout costs as much memory again as the packed layers' weights (SmolLM2
fp32: 425 MB of decoder linears, 113 MB of LM head; the panels only where the engine's library is loaded
and its panel linear passed its probe at the weight's dtype, engine/runner/native_kernels.py).
Panels of 2 MB or more live on transparent huge pages where the kernel grants them
(`host_memory.on_huge_pages`: a decode step streams them whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.runner.host_memory import on_huge_pages
from engine.runner.kernel_probes import ProbeCase
from engine.runner.native_kernels import probe

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 32  # rows oneDNN's weight layout is chosen for (measured best of 1, 8, 32 and none)
PANEL_WIDTH = 32  # outputs per column panel (panel_linear.cpp's P)
PANEL_ROWS = 128  # most rows a call runs on the panels (measured, above)
WIDENED_BF16_ROWS = 4  # the same for bf16 panels without the CPU's bf16 dot products


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's [N, K] weight packed once: oneDNN's layout, and column panels where they serve."""

    onednn: torch.Tensor  # float32 for a bf16 weight where oneDNN has no bf16 matmul (`widened`)
    widened: bool  # the oneDNN copy is the bf16 weight widened to float32: calls widen their input
    panels: torch.Tensor | None  # `pack_panels`' layout; None without a passing panel probe or when 32 does not divide N
    panel_rows: int  # calls of at most this many rows run on the panels


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over packed copies of its weight (same parameters, same results up to
    summation order)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the weight's packed copies (`pack_weight`)."""
    in_features = x.shape[-1]
    rows = x.numel() // max(1, in_features)
    if packed.panels is None or rows > packed.panel_rows or rows == 0:
        if packed.widened:  # bf16 products are exact in float32: only the summation order differs
            wide_bias = None if bias is None else bias.float()
            return torch.ops.mkldnn._linear_pointwise(x.float(), packed.onednn, wide_bias, "none", [], "").to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    flat = x.reshape(rows, in_features)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = torch.ops.prefix_console.panel_linear(flat, packed.panels, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """Packed copies of a linear layer's [out_features, in_features] weight (CPU, fp32 or bf16).

    Raises:
        StaleKernelLibraryError: the kernel library is stale (engine/runner/native_kernels.py).
    """
    weight = weight.detach()
    widened = weight.dtype == torch.bfloat16 and not onednn_has_bf16_matmul()
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.float() if widened else weight, BATCH_HINT)
    panel = probe("panel_linear", ProbeCase.tiny(weight.dtype))
    if not panel.passed or weight.shape[0] % PANEL_WIDTH != 0:
        return PackedWeight(onednn, widened, None, 0)
    panels = on_huge_pages(panel.ops.pack_panels(weight))  # streamed whole by every decode step
    return PackedWeight(onednn, widened, panels, panel_rows(panels))


def onednn_has_bf16_matmul() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); without, its
    reorder of a bf16 weight raises and `F.linear` in bf16 crawls (a served 8-client cell took 4.3x its
    float32 time), so bf16 linears multiply on float32 copies of their weights instead."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def panel_rows(panels: torch.Tensor) -> int:
    """Most rows a call runs on these panels: fewer for bf16 ones widened to float32 (3-D; pairs are 4-D)."""
    return WIDENED_BF16_ROWS if panels.dtype == torch.bfloat16 and panels.dim() == 3 else PANEL_ROWS


def packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears on this device and dtype run on packed weights (the CPU with oneDNN, fp32 or bf16)."""
    return device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()


def linear_kernels(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernels run the linears on this device and dtype, for an operator."""
    if not packs_linears(device, dtype):
        return "F.linear"
    panel = probe("panel_linear", ProbeCase.tiny(dtype))
    if not panel.passed:
        return f"oneDNN (no panel kernel: {panel.note})"
    rows = panel_rows(panel.ops.pack_panels(torch.zeros(PANEL_WIDTH, 2, dtype=dtype)))
    widened = dtype == torch.bfloat16 and not onednn_has_bf16_matmul()
    return f"panels up to {rows} rows, oneDNN above" + (" (on float32 copies: no bf16 matmul here)" if widened else "")


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
