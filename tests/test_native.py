"""The block pool runs compiled (build_native.py), and its plain source behaves exactly as the compiled one.

`make` compiles engine/core/block.py, engine/core/eviction.py and engine/core/block_pool.py with mypyc; Python imports
the compiled modules in their place. These tests pin both halves of that bargain: what runs is compiled
(the benchmarks' speed is the compiled pool's), and the source a reader reads is the same program: a copy
of the packages without the compiled modules replays traces to the same hits and evictions, and passes
the pool's own property and scenario tests. A compiled module older than its source is refused on import
(engine/native_guard.py), while build_native.py, which repairs it, still loads. The module list is kept
once, there: the Makefile asks build_native.py for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from build_native import copy_plain_source
from engine.native_guard import NATIVE_MODULES, compiled_module, stale_modules
from tests.analysis_support import CONVERSATION_SAMPLE, SYNTHETIC_SAMPLE

ROOT = Path(__file__).resolve().parent.parent

# Replays through the pool that stress eviction: small pools, both engine policies, every victim named.
REPLAY = """
import json, sys
from analysis.pool_replay import PoolCache
from analysis.readers import load_trace
from analysis.sequential import replay
from engine.core.eviction import LruPolicy, ReuseLruPolicy

results = []
for path in sys.argv[1:]:
    trace = load_trace(path).split(16)
    for capacity in (40, 300, 2000):
        for make in (LruPolicy, lambda: ReuseLruPolicy(capacity)):
            cache = PoolCache(trace, capacity, make(), record_evictions=True)
            results.append({"hits": replay(trace, cache).tolist(), "evictions": cache.evictions})
            cache.check_invariants()
print(json.dumps(results))
"""
POOL_TESTS = [
    "tests/test_block_pool_properties.py",
    "tests/test_block_pool_chain.py",
    "tests/test_block_pool_batched_eviction.py",
    "tests/test_eviction.py",
    "tests/test_analysis_pool.py",
]


def _run(code_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=code_root, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def plain_source(tmp_path_factory) -> Path:
    """A copy of the packages with no compiled module in it: Python runs the plain source there."""
    copy = tmp_path_factory.mktemp("plain-source")
    copy_plain_source(ROOT, copy, ("engine", "serving", "analysis", "storage", "fleet", "cli", "app", "pages", "tests"))
    (copy / "pytest.ini").write_text("[pytest]\n")  # the copy is its own rootdir
    assert not list(copy.rglob("*.so"))
    return copy


def test_the_block_pool_modules_are_the_compiled_ones():
    for name in NATIVE_MODULES:
        built = compiled_module(ROOT / name)
        assert built is not None, f"{name} is not compiled: run `make native`"
        module = ".".join(Path(name).with_suffix("").parts)
        origin = importlib.util.find_spec(module).origin
        assert origin is not None and origin.endswith(tuple(EXTENSION_SUFFIXES)), (module, origin)


def test_the_plain_source_replays_traces_exactly_as_the_compiled_pool(plain_source):
    samples = [str(CONVERSATION_SAMPLE), str(SYNTHETIC_SAMPLE)]
    compiled = _run(ROOT, "-c", REPLAY, *samples)
    plain = _run(plain_source, "-c", REPLAY, *samples)
    assert compiled.returncode == 0 and plain.returncode == 0, compiled.stderr + plain.stderr
    compiled_runs, plain_runs = json.loads(compiled.stdout), json.loads(plain.stdout)
    assert len(compiled_runs) == 12 and sum(len(run["evictions"]) for run in compiled_runs) > 10_000
    assert plain_runs == compiled_runs


def test_the_plain_source_passes_the_pools_own_tests(plain_source):
    result = _run(plain_source, "-m", "pytest", "-q", "-p", "no:cacheprovider", *POOL_TESTS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture
def compiled_copy(tmp_path) -> Path:
    """A copy of the engine package with its compiled modules, each newer than its source, and build_native.py."""
    shutil.copytree(ROOT / "engine", tmp_path / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "build_native.py", tmp_path)
    for name in NATIVE_MODULES:
        built = compiled_module(tmp_path / name)
        if built is None:
            pytest.skip(f"{name} is not compiled: run `make native`")
        source_time = (tmp_path / name).stat().st_mtime
        os.utime(built, (source_time + 10, source_time + 10))
    assert stale_modules(tmp_path) == []
    return tmp_path


def make_stale(root: Path, name: str) -> None:
    """Date the compiled module of `name` a minute before its source, as an edit after the build would."""
    edited = (root / name).stat().st_mtime
    os.utime(compiled_module(root / name), (edited - 60, edited - 60))


def test_importing_the_bookkeeping_refuses_a_compiled_module_older_than_its_source(compiled_copy):
    assert _run(compiled_copy, "-c", "import engine.core").returncode == 0  # fresh: imported as usual
    make_stale(compiled_copy, "engine/core/block_pool.py")
    refused = _run(compiled_copy, "-c", "import engine.core")
    assert refused.returncode == 1
    assert "StaleNativeModuleError: compiled modules older than their source: engine/core/block_pool.py" in (
        refused.stderr
    )
    assert "run `make native`" in refused.stderr
    assert "engine/core/block.py" not in refused.stderr and "engine/core/eviction.py" not in refused.stderr


def test_the_build_script_loads_while_the_compiled_modules_are_stale(compiled_copy):
    """It must repair a stale build, so it imports the guard and never engine.core."""
    for name in NATIVE_MODULES:
        make_stale(compiled_copy, name)
    code = "import sys, build_native; print(sorted(m for m in sys.modules if m.startswith('engine')))"
    loaded = _run(compiled_copy, "-c", code)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "['engine', 'engine.native_guard']"


def test_the_makefile_takes_the_module_list_from_the_build_script_and_the_kernel_sources_by_glob():
    listed = _run(ROOT, "build_native.py", "--sources")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["build_native.py", "engine/native_guard.py", *NATIVE_MODULES]
    makefile = (ROOT / "Makefile").read_text()
    assert "$(shell python3 build_native.py --sources)" in makefile
    assert [name for name in NATIVE_MODULES if name in makefile] == []
    assert re.findall(r"csrc/\w+\.cpp", makefile) == []  # the kernels' sources: $(wildcard engine/runner/csrc/*.cpp)
