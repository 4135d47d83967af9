"""The engine's own CPU kernel: decode attention over paged K/V read in place (engine/runner/csrc/paged_decode.cpp).

`make install` compiles it (build_kernels.py) beside its source for the machine's vector instructions.
Loading registers `torch.ops.prefix_console.paged_decode` once per process. A library that is missing,
older than its source or refused by the loader is not used: the runner then runs decodes through the
padded, masked fused call instead, and `load_paged_decode` says why (the runner's kernel notes carry it
to the Settings page and the device check).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
LIBRARY = SOURCE.with_suffix(".so")

# (query [B, H, D], key_cache [KV, N, S, D], value_cache, blocks [B, M], fields [B, 2 + M], block_size, window
#  (0: none), scale) -> (out [B, H, D], lse [B, H] float32); see the source's header for the contract.
PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float], tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def load_paged_decode() -> tuple[PagedDecode | None, str]:
    """The op, or None and why it is not available."""
    if not LIBRARY.is_file():
        return None, f"{LIBRARY.name} not built (make install, or .venv/bin/python build_kernels.py)"
    if LIBRARY.stat().st_mtime < SOURCE.stat().st_mtime:
        return None, f"{LIBRARY.name} is older than its source (rebuild: .venv/bin/python build_kernels.py)"
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as error:  # built against another torch, or for instructions this CPU lacks
        return None, f"{LIBRARY.name} failed to load: {str(error).splitlines()[0][:200]}"
    return torch.ops.prefix_console.paged_decode, "loaded"
