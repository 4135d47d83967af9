"""The engine's own CPU kernels (engine/runner/csrc/*.cpp), compiled into one library by build_kernels.py.

`make install` compiles it beside its sources for the machine's vector instructions. Loading registers
`torch.ops.prefix_console.*` once per process:

    paged_decode     decode attention over paged K/V read in place (csrc/paged_decode.cpp)
    tiled_attention  attention of many queries over contiguous keys, causal or unmasked: a prefill's own
                     tokens, queries over a shared prefix (csrc/tiled_attention.cpp)
    merge_partials_  two partial attention results merged into the first, in place (csrc/merge_partials.cpp)
    panel_linear     a linear layer for few rows over a weight packed in column panels (csrc/panel_linear.cpp)
    add_rms_norm_, rms_norm, silu_and_mul, rope_
                     a decoder layer's elementwise steps, one pass each (csrc/decoder_ops.cpp)

A library that is missing, older than one of its sources, built from another set of sources (its
manifest, written by the build) or refused by the loader is not used: the runner then runs decodes
through the padded, masked fused call, its other attention through torch's CPU flash kernel, its
linears through oneDNN alone and the decoder's steps through torch's ops, and `load_ops` says
why (the runner's kernel notes carry it to the Settings page and the device check).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
LIBRARY = Path(__file__).resolve().parent / "csrc" / "prefix_console_ops.so"
MANIFEST = LIBRARY.with_suffix(".sources")  # written by build_kernels.py: the sources the library was built from


def unusable_reason(library: Path, manifest: Path, sources: Sequence[Path]) -> str | None:
    """Why a built library does not match its sources (None when it does)."""
    if not library.is_file():
        return f"{library.name} not built (make install, or .venv/bin/python build_kernels.py)"
    built_from = manifest.read_text().split() if manifest.is_file() else None
    if built_from != [source.name for source in sources]:
        return f"{library.name} was built from other sources (rebuild: .venv/bin/python build_kernels.py)"
    if any(library.stat().st_mtime < source.stat().st_mtime for source in sources):
        return f"{library.name} is older than its sources (rebuild: .venv/bin/python build_kernels.py)"
    return None


@functools.cache
def load_ops() -> tuple[Any | None, str]:
    """`torch.ops.prefix_console` with the library's ops registered, or None and why not."""
    reason = unusable_reason(LIBRARY, MANIFEST, SOURCES)
    if reason is not None:
        return None, reason
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as error:  # built against another torch, or for instructions this CPU lacks
        return None, f"{LIBRARY.name} failed to load: {str(error).splitlines()[0][:200]}"
    return torch.ops.prefix_console, "loaded"
