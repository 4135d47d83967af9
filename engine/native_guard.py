"""Refuse to import a compiled block-pool module that is older than its source.

build_native.py compiles NATIVE_MODULES with mypyc and leaves each extension module beside its source.
Python then imports the compiled module in preference to the `.py` file, without looking at either
file's time: after an edit to the source, the console, the CLI and the tests would silently run code
that is no longer there. `engine/core/__init__.py` calls `refuse_stale_modules()` before any of its
modules is imported, so a stale build raises `StaleNativeModuleError` (an ImportError naming the stale
modules and the fix) instead.

A module counts as stale when its compiled module exists and was last modified before its source.
No compiled module is never stale: the plain source runs. build_native.py stamps every module it
builds with the build's time, so a fresh build is never older than the source it was built from.

This module lives outside `engine/core/` so that build_native.py can import it without importing
`engine.core` (and so without being refused by the very staleness it is about to repair).
"""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

# The modules build_native.py compiles (as one group), as paths relative to the repository root.
NATIVE_MODULES = (  # block_pool.py and the modules it imports, compiled as one group
    "engine/core/block.py",
    "engine/core/eviction.py",
    "engine/core/chain_keys.py",
    "engine/core/pool_invariants.py",
    "engine/core/block_pool.py",
)
REPOSITORY_ROOT = Path(__file__).resolve().parent.parent  # the folder that holds the `engine` package


class StaleNativeModuleError(ImportError):
    """A compiled module is older than its source, so importing it would run code that is no longer there.

    Attributes:
        stale: the stale modules' sources, relative to the repository root.
    """

    def __init__(self, stale: list[str]) -> None:
        super().__init__(stale_message(stale))
        self.stale = stale


def compiled_module(source: Path) -> Path | None:
    """The compiled module Python imports instead of `source`, if one was built."""
    built = (source.with_suffix(suffix) for suffix in EXTENSION_SUFFIXES)
    return next((path for path in built if path.is_file()), None)


def stale_modules(root: Path = REPOSITORY_ROOT) -> list[str]:
    """The NATIVE_MODULES under `root` whose compiled module is older than their source, in NATIVE_MODULES
    order (empty when nothing is compiled or every build is fresh)."""
    stale = []
    for name in NATIVE_MODULES:
        source = root / name
        built = compiled_module(source)
        if built is not None and source.is_file() and built.stat().st_mtime < source.stat().st_mtime:
            stale.append(name)
    return stale


def stale_message(stale: list[str]) -> str:
    """What to tell whoever is about to run stale compiled modules: which ones, and how to fix it."""
    return (
        f"compiled modules older than their source: {', '.join(stale)} (Python would import the compiled "
        "copy and run code that is no longer there): run `make native` to rebuild them, or delete "
        "engine/core/*.so to run the plain source"
    )


def refuse_stale_modules(root: Path = REPOSITORY_ROOT) -> None:
    """Return if no compiled module under `root` is older than its source.

    Raises:
        StaleNativeModuleError: one is (the message names them and says to run `make native`).
    """
    stale = stale_modules(root)
    if stale:
        raise StaleNativeModuleError(stale)
