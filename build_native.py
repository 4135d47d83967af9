"""Compile the block pool with mypyc, in place: engine/core/block.py, engine/core/eviction.py, engine/core/block_pool.py.

The three modules are plain, typed Python and run as they are. Compiled, the same source replays the
workload analyzer's traces about 1.7x faster (benchmarks/analyzer.py measures both in one run), and
the engine's bookkeeping per step gets the same speed-up. `make` runs this whenever one of them changed;
Python then imports the compiled module in preference to its source, so importing `engine.core` refuses a
compiled module older than its source (engine/native_guard.py, which also lists the modules). This script
imports only that guard, never `engine.core`, so it runs, and repairs, a stale build.

What the compiled modules change for their callers: arguments and attributes are checked against their
annotations at run time (a TypeError where plain Python would carry on), and only `EvictionPolicy` and
`LruPolicy` may be subclassed in plain Python.

Run: `.venv/bin/python build_native.py` (a C compiler and the Python headers). Generated C and object
files go to .build/native; each extension module lands beside its source in engine/core/.
`python3 build_native.py --sources` prints the files a build depends on (the Makefile's prerequisites),
with the standard library alone.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from engine.native_guard import NATIVE_MODULES, compiled_module

BUILD_DIR = ".build/native"
BUILD_INPUTS = ("build_native.py", "engine/native_guard.py", *NATIVE_MODULES)  # a change to any one rebuilds


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
    if sys.argv[1:] == ["--sources"]:
        print(" ".join(BUILD_INPUTS))
    else:
        main()
