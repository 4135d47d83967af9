"""The block pool runs compiled (build_native.py), and its plain source behaves exactly as the compiled one.

`make` compiles engine/core/block.py, engine/core/eviction.py and engine/core/block_pool.py with mypyc; Python imports
the compiled modules in their place. These tests pin both halves of that bargain: what runs is compiled
(the benchmarks' speed is the compiled pool's), and the source a reader reads is the same program: a copy
of the packages without the compiled modules replays traces to the same hits and evictions, and passes
the pool's own property and scenario tests.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from build_native import NATIVE_MODULES, compiled_module, copy_plain_source
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
    copy_plain_source(ROOT, copy, ("engine", "analysis", "storage", "fleet", "cli", "app", "pages", "tests"))
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
