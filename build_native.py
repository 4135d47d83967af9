"""Compile the block pool with mypyc, in place: engine/core/block.py, engine/core/eviction.py, engine/core/block_pool.py.

The three modules are plain, typed Python and run as they are. Compiled, the same source replays the
workload analyzer's traces about 1.7x faster (benchmarks/analyzer.py measures both in one run), and
the engine's bookkeeping per step gets the same speed-up. `make` runs this whenever one of them changed;
Python then imports the compiled module in preference to its source, so tests/conftest.py refuses to
run the tests against a compiled module older than its source.

What the compiled modules change for their callers: arguments and attributes are checked against their
annotations at run time (a TypeError where plain Python would carry on), and only `EvictionPolicy` and
`LruPolicy` may be subclassed in plain Python.

Run: `.venv/bin/python build_native.py` (a C compiler and the Python headers). Generated C and object
files go to .build/native; each extension module lands beside its source in engine/core/.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

NATIVE_MODULES = ("engine/core/block.py", "engine/core/eviction.py", "engine/core/block_pool.py")  # compiled as one group
BUILD_DIR = ".build/native"


def compiled_module(source: Path) -> Path | None:
    """The compiled module Python imports instead of `source`, if one was built."""
    built = (source.with_suffix(suffix) for suffix in EXTENSION_SUFFIXES)
    return next((path for path in built if path.is_file()), None)


def stale_modules(root: Path) -> list[str]:
    """The modules under `root` whose compiled module is older than their source: Python would import the
    compiled one and run code that is no longer there."""
    stale = []
    for name in NATIVE_MODULES:
        built = compiled_module(root / name)
        if built is not None and built.stat().st_mtime < (root / name).stat().st_mtime:
            stale.append(name)
    return stale


def copy_plain_source(root: Path, into: Path, packages: Iterable[str]) -> None:
    """Copy `packages` of the repository at `root`, and this script, into `into` without any compiled
    module: Python runs the plain source there (to compare it with the compiled one)."""
    for package in packages:
        shutil.copytree(root / package, into / package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(root / "build_native.py", into)


def main() -> None:
    from mypyc.build import mypycify  # build-time only: the product imports neither
    from setuptools import setup

    os.chdir(Path(__file__).resolve().parent)  # the paths here are relative to the repository
    for old in Path("engine").rglob("*.so"):  # unlinked, not overwritten: a running console keeps its mapped copy
        old.unlink()
    setup(
        name="prefix-console-native",
        ext_modules=mypycify(list(NATIVE_MODULES), group_name="engine.core.native", target_dir=BUILD_DIR),
        script_args=["build_ext", "--inplace", "--build-temp", f"{BUILD_DIR}/temp", "--build-lib", f"{BUILD_DIR}/lib"],
    )
    for name in NATIVE_MODULES:  # the copies keep the times of their last change: stamp them as built now
        built = compiled_module(Path(name))
        if built is None:
            raise SystemExit(f"mypyc built no module for {name}")
        built.touch()


if __name__ == "__main__":
    main()
