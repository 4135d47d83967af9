"""The engine's own CPU kernels (engine/runner/csrc/*.cpp), compiled into one library by build_kernels.py.

`make install` compiles it beside its sources for the machine's vector instructions. Loading registers
`torch.ops.prefix_console.*` once per process:

    paged_decode     decode attention over paged K/V read in place (csrc/paged_decode.cpp)
    add_rms_norm_, rms_norm, silu_and_mul, rope_
                     a decoder layer's elementwise steps, one pass each (csrc/decoder_ops.cpp)

A library that is missing, older than one of its sources or refused by the loader is not used: the
runner then runs decodes through the padded, masked fused call and the decoder's steps through torch's
ops, and `load_ops` says why (the runner's kernel notes carry it to the Settings page and the device check).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
LIBRARY = Path(__file__).resolve().parent / "csrc" / "prefix_console_ops.so"


@functools.cache
def load_ops() -> tuple[Any | None, str]:
    """`torch.ops.prefix_console` with the library's ops registered, or None and why not."""
    if not LIBRARY.is_file():
        return None, f"{LIBRARY.name} not built (make install, or .venv/bin/python build_kernels.py)"
    if any(LIBRARY.stat().st_mtime < source.stat().st_mtime for source in SOURCES):
        return None, f"{LIBRARY.name} is older than its sources (rebuild: .venv/bin/python build_kernels.py)"
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as error:  # built against another torch, or for instructions this CPU lacks
        return None, f"{LIBRARY.name} failed to load: {str(error).splitlines()[0][:200]}"
    return torch.ops.prefix_console, "loaded"
