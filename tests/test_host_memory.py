"""glibc's allocator thresholds, fixed once for the forward's temporaries, and weights on huge pages
(engine/runner/host_memory.py)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.runner.host_memory import HUGE_PAGE, keep_freed_memory, on_huge_pages

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


def test_a_weight_on_huge_pages_is_an_equal_contiguous_copy_starting_on_a_huge_page():
    weight = torch.randn(1536, 576)
    copy = on_huge_pages(weight)
    assert torch.equal(copy, weight) and copy.is_contiguous() and copy.data_ptr() != weight.data_ptr()
    assert copy.data_ptr() % HUGE_PAGE == 0
    del weight
    assert copy.sum().isfinite()  # the copy holds its own mapping


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="no transparent huge pages")
def test_where_the_kernel_grants_them_the_copy_is_backed_by_huge_pages():
    """The mapping's AnonHugePages in /proc/self/smaps (THP in "always" or "madvise" mode)."""
    if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("transparent huge pages are off here")
    copy = on_huge_pages(torch.ones(4 * HUGE_PAGE // 4))
    start = copy.data_ptr()
    huge_kb = 0
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        low, _, high = line.partition(" ")[0].partition("-")
        if high and int(low, 16) <= start < int(high, 16):
            huge_kb = next(int(entry.split()[1]) for entry in lines[i + 1 :] if entry.startswith("AnonHugePages:"))
            break
    assert huge_kb >= 4 * HUGE_PAGE // 1024


def test_small_or_strided_tensors_stay_where_they_are():
    small = torch.randn(100, 100)
    strided = torch.randn(1536, 1152)[:, ::2]
    assert on_huge_pages(small) is small and on_huge_pages(strided) is strided
