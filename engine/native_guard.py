"""The one stale-build policy of the engine's two native builds, and its check for the compiled block pool.

Two builds leave native code beside its sources: build_native.py compiles NATIVE_MODULES with mypyc (each
extension module beside its source), build_kernels.py compiles engine/runner/csrc/*.cpp into one library
(engine/runner/native_kernels.py owns it). Both follow one policy:

    not built    the engine runs without it (the plain source; torch's ops) and says so where it matters
    stale        using it raises a `StaleBuildError` that names the stale build and REBUILD (`make native`),
                 never a silent fallback: the console, the CLI and the tests would otherwise run code that
                 is no longer there, or run slower than the build they think they run
    to opt out   delete the build: not built is never an error

A compiled module is stale when it was last modified before its source (build_native.py stamps every
module it builds with the build's time). Python imports an extension module in preference to its `.py`
file without looking at either's time, so `engine/core/__init__.py` calls `refuse_stale_modules()` before
any of its modules is imported: the stale build raises at import. The kernel library raises where it is
first loaded (`native_kernels.load_ops`).

This module imports only the standard library and lives outside `engine/core/`, so that build_native.py
can import it without importing `engine.core` (and so without being refused by the very staleness it is
about to repair).
"""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

# The modules build_native.py compiles (as one group), as paths relative to the repository root. The one
# list: the Makefile reads it through `build_native.py --sources`.
NATIVE_MODULES = (  # block_pool.py and the modules it imports, compiled as one group
    "engine/core/block.py",
    "engine/core/eviction.py",
    "engine/core/chain_keys.py",
    "engine/core/pool_invariants.py",
    "engine/core/block_pool.py",
)
REPOSITORY_ROOT = Path(__file__).resolve().parent.parent  # the folder that holds the `engine` package
REBUILD = "make native"  # the command that rebuilds both native builds


class StaleBuildError(ImportError):
    """A native build no longer matches its sources, so using it would run code that is no longer there.

    The message says what is stale and why, then the two ways out: REBUILD, or delete the build to run
    without it.
    """

    def __init__(self, what: str, build: str, without: str) -> None:
        super().__init__(f"{what}: run `{REBUILD}` to rebuild, or delete {build} to run {without}")


class StaleNativeModuleError(StaleBuildError):
    """A compiled module is older than its source (the build_native.py side of the policy).

    Attributes:
        stale: the stale modules' sources, relative to the repository root.
    """

    def __init__(self, stale: list[str]) -> None:
        what = (
            f"compiled modules older than their source: {', '.join(stale)} (Python would import the compiled "
            "copy and run code that is no longer there)"
        )
        super().__init__(what, "engine/core/*.so", "the plain source")
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


def refuse_stale_modules(root: Path = REPOSITORY_ROOT) -> None:
    """Return if no compiled module under `root` is older than its source.

    Raises:
        StaleNativeModuleError: one is (the message names them and says to run `make native`).
    """
    stale = stale_modules(root)
    if stale:
        raise StaleNativeModuleError(stale)
