"""A decoder layer's elementwise steps between its linears: residual add and RMSNorm, SiLU-and-multiply,
the rotary embedding.

Each runs as torch ops (the functions here, also the reference the library's ops are probed against,
engine/runner/kernel_probes.py) or, on the CPU, as one op of the engine's library
(engine/runner/csrc/decoder_ops.cpp): a torch RMSNorm is six ops (15 us for 8 rows, 3 fused), and a
layer had about 20 such small ops. `LayerSteps` takes each step's fused op where it was handed one (its
probe passed) and torch's ops for the others, so one failing op costs only itself.

The fused steps round where the torch ops round, so their results are the torch ops' except where the
RMSNorm's mean, summed in another order, changes the last bit of its float32 scale factor: float32
outputs then move by an ulp or two, and in bf16 that flips a rounding now and then.

Invariants: the fused `add_rms_norm_` adds into `hidden` in place and the fused `rope_` rotates `qk` in
place (both are the forward's own tensors); the torch steps return new tensors. gate|up comes as one
[T, 2I] tensor exactly when SiLU-and-multiply is fused (`joined_gate_up`), else as two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch.nn import functional as F

FUSED_STEPS = ("rms_norm", "add_rms_norm_", "silu_and_mul", "rope_")  # the library's ops a layer's steps run on


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalized in float32, cast back to x's dtype, then scaled."""
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, its RMSNorm)."""
    hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk [T, heads, head_dim] rotated by cos, sin [T, head_dim] (a new tensor)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # every head alike
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos + rotated * sin


class LayerSteps:
    """A layer's steps: the fused op where one was handed, else torch's ops.

    Args:
        fused: op name (of FUSED_STEPS) -> the library's op, for the ops whose probe passed (empty: all torch).
        notes: why the others are not fused, for an operator.
    """

    def __init__(self, fused: Mapping[str, Callable[..., torch.Tensor]], notes: Sequence[str] = ()) -> None:
        self._rms_norm = fused.get("rms_norm")
        self._add_rms_norm = fused.get("add_rms_norm_")
        self._silu_and_mul = fused.get("silu_and_mul")
        self._rope = fused.get("rope_")
        self.fused = tuple(name for name in FUSED_STEPS if name in fused)
        self.notes = tuple(notes)
        self.joined_gate_up = self._silu_and_mul is not None

    @property
    def name(self) -> str:
        """Which steps run fused, for an operator (the forward's line on the Settings page)."""
        if len(self.fused) == len(FUSED_STEPS):
            text = "fused CPU ops"
        elif self.fused:
            text = f"fused CPU ops for {', '.join(self.fused)}, torch ops for the rest"
        else:
            text = "torch ops"
        return text + "".join(f" ({note})" for note in self.notes)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps) if self._rms_norm is None else self._rms_norm(x, weight, eps)

    def add_norm(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, its RMSNorm); fused, the sum is written into `hidden`."""
        if self._add_rms_norm is None:
            return add_rms_norm(hidden, delta, weight, eps)
        return hidden, self._add_rms_norm(hidden, delta, weight, eps)

    def silu_and_mul(self, gate_up: Sequence[torch.Tensor]) -> torch.Tensor:
        """SiLU(gate) * up from [gate|up] when `joined_gate_up`, else from [gate, up]."""
        if self._silu_and_mul is None:
            gate, up = gate_up
            return silu_and_mul(gate, up)
        (joined,) = gate_up
        return self._silu_and_mul(joined)

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk rotated by cos, sin; fused, in place."""
        if self._rope is None:
            return rope(qk, cos, sin)
        self._rope(qk, cos, sin)
        return qk
