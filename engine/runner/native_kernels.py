"""The engine's own CPU kernels (engine/runner/csrc/*.cpp), compiled into one library by build_kernels.py;
this module owns it: where it is, whether its build is current, loading it, one probe per op before its
first use, and the notes an operator reads about it.

Loading registers `torch.ops.prefix_console.*` once per process:

    paged_decode     decode attention over paged K/V read in place (csrc/paged_decode.cpp)
    tiled_attention  attention of many queries over contiguous keys, causal or unmasked: a prefill's own
                     tokens, queries over a shared prefix (csrc/tiled_attention.cpp)
    merge_partials_  two partial attention results merged into the first, in place (csrc/merge_partials.cpp)
    panel_linear     a linear layer for few rows over a weight packed in column panels (with pack_panels,
                     csrc/panel_linear.cpp)
    add_rms_norm_, rms_norm, silu_and_mul, rope_
                     a decoder layer's elementwise steps, one pass each (csrc/decoder_ops.cpp)

The build follows the engine's one stale-build policy (engine/native_guard.py): a library that is not
built is no error (torch's ops run and the notes say so); one older than one of its sources, built from
another set of them (its manifest, written by the build, lists them) or refused by the loader (built
against another torch, or for instructions this CPU lacks) raises `StaleKernelLibraryError`, naming
`make native`, where it is first loaded.

Every op is probed (`probe`) against plain torch ops on tiny inputs of its callers' dtype and head
layout before it is handed out (engine/runner/kernel_probes.py); one that raises or disagrees is not
handed out, its caller runs torch's ops instead, and the probe's note says why.

Invariants: the library is loaded at most once per process; each op is probed at most once per case; an
op is handed out only for a case whose probe passed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.native_guard import REPOSITORY_ROOT, StaleBuildError
from engine.runner.kernel_probes import PROBES, ProbeCase, tolerance

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))  # what build_kernels.py compiles: every source in csrc/
LIBRARY = CSRC / "prefix_console_ops.so"
MANIFEST = LIBRARY.with_suffix(".sources")  # written by build_kernels.py: the sources the library was built from


class StaleKernelLibraryError(StaleBuildError):
    """The kernel library no longer matches its sources or this process (the kernels' side of the policy)."""

    def __init__(self, why: str) -> None:
        super().__init__(why, os.path.relpath(LIBRARY, REPOSITORY_ROOT), "torch's ops")


def stale_reason(library: Path, manifest: Path, sources: Sequence[Path]) -> str | None:
    """Why a built library does not match its sources (None when it does)."""
    built_from = manifest.read_text().split() if manifest.is_file() else None
    if built_from != [source.name for source in sources]:
        return f"{library.name} was built from other sources than {', '.join(source.name for source in sources)}"
    if any(library.stat().st_mtime < source.stat().st_mtime for source in sources):
        return f"{library.name} is older than its sources"
    return None


@functools.cache
def load_ops() -> tuple[Any | None, str]:
    """`torch.ops.prefix_console` with the library's ops registered, or None and why (it is not built).

    Raises:
        StaleKernelLibraryError: the library is built but stale, or the loader refuses it.
    """
    if not LIBRARY.is_file():
        return None, f"{LIBRARY.name} not built (`make native` builds it)"
    why = stale_reason(LIBRARY, MANIFEST, SOURCES)
    if why is not None:
        raise StaleKernelLibraryError(why)
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as error:  # built against another torch, or for instructions this CPU lacks
        raise StaleKernelLibraryError(f"{LIBRARY.name} failed to load: {str(error).splitlines()[0][:200]}") from error
    return torch.ops.prefix_console, "loaded"


@dataclass(frozen=True)
class Probed:
    """One op's probe on one case."""

    ops: Any | None  # the library's ops (`torch.ops.prefix_console`) when the op passed, else None
    note: str | None  # why the op is not handed out, for an operator; None when it passed

    @property
    def passed(self) -> bool:
        return self.ops is not None


@functools.cache
def probe(name: str, case: ProbeCase) -> Probed:
    """Op `name` (a key of kernel_probes.PROBES) checked against its torch reference on `case`, once.

    Raises:
        StaleKernelLibraryError: the library is stale (see `load_ops`).
    """
    ops, why_not = load_ops()
    label = f"{name} ({str(case.dtype).removeprefix('torch.')})"
    if ops is None:
        return Probed(None, f"{label} unavailable: {why_not}")
    note = probe_note(label, lambda: PROBES[name](ops, case), case.dtype)
    return Probed(ops if note is None else None, note)


def probe_note(label: str, measure: Callable[[], float], dtype: torch.dtype) -> str | None:
    """Why the kernel `label` fails its probe, or None when it passes: `measure` returns the probe's
    largest error against its reference (kernel_probes), or raises where the kernel refuses the inputs."""
    try:
        error = measure()
    except (RuntimeError, NotImplementedError, AttributeError) as refused:  # the op missing or refusing these shapes
        return f"{label} unavailable: {str(refused).splitlines()[0][:200]}"
    if not error <= tolerance(dtype):
        return f"{label} differs from its reference by {error:.3g}"
    return None


def probe_notes(names: Sequence[str], case: ProbeCase) -> tuple[str, ...]:
    """The notes of those of `names` that fail on `case` (probing them if not yet), in order; where the
    library is not built, the one reason.

    Raises:
        StaleKernelLibraryError: the library is stale (see `load_ops`).
    """
    ops, why_not = load_ops()
    if ops is None:
        return (why_not,)
    notes = (probe(name, case).note for name in names)
    return tuple(note for note in notes if note is not None)


def passing_ops(names: Sequence[str], case: ProbeCase) -> dict[str, Any]:
    """name -> the library's op, for those of `names` whose probe passes on `case` (empty where the library
    is not built).

    Raises:
        StaleKernelLibraryError: the library is stale (see `load_ops`).
    """
    ops, _ = load_ops()
    return {name: getattr(ops, name) for name in names if ops is not None and probe(name, case).passed}
