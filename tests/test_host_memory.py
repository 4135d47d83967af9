"""glibc's allocator thresholds, fixed once for the forward's temporaries (engine/runner/host_memory.py)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runner.host_memory import keep_freed_memory

GLIBC = platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[1]

# In a fresh process: malloc 16 MB, free it, malloc 16 MB again; print whether the address came back.
REUSE = """
import ctypes, sys
sys.path.insert(0, {root!r})
from engine.runner.host_memory import keep_freed_memory
if {keep}:
    assert keep_freed_memory(environ={{}})
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
first = libc.malloc(16 << 20); libc.free(first)
second = libc.malloc(16 << 20); libc.free(second)
print(first == second)
"""


def reused(keep: bool) -> bool:
    code = REUSE.format(root=str(ROOT), keep=keep)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={})
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_with_the_thresholds_fixed_a_freed_16_mb_block_is_reused_instead_of_mapped_anew():
    assert not reused(keep=False)  # glibc's default: the first block is a fresh mapping, unmapped when freed
    assert reused(keep=True)


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_an_operators_own_threshold_wins(name):
    assert keep_freed_memory(environ={name: "131072"}) is False
