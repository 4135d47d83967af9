"""Where the CPU forward's memory lives: the C allocator's thresholds for its temporaries, and huge pages
for the weights it streams.

A CPU forward allocates and frees multi-megabyte tensors many times a step (for a 1,056-token prefill
of SmolLM2 in fp32: queries, keys and values 4 MB, the MLP's gate and up 13 MB, every layer). glibc serves
a block above its mmap threshold with a fresh mapping, unmapped again when freed, and returns freed heap
above its trim threshold to the kernel; either way the next layer page-faults the same memory in again.
Its thresholds adapt, but only after the fact. Fixed once (`keep_freed_memory`: mmap threshold at glibc's
maximum, 32 MB; trim threshold 1 GB), freed memory stays in the heap for the next allocation. Measured on
SmolLM2, fp32, two threads, the engine end to end: a cold 1,056-token prefill took 1.48-1.51 s instead of
1.54-1.63 s. The cost: the process keeps its peak heap (a forward's working set; the KV blocks, one large
allocation, are mapped separately and unaffected).

An operator's own `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` wins; other C libraries are left alone.

A decode step streams every weight from memory once. With 4 KB pages that stream crosses a page every
4 KB, and the CPU's prefetchers stop at each crossing; `on_huge_pages` copies a packed weight into memory
the kernel backs with 2 MB transparent huge pages (asked for with `madvise`, which Linux grants in its
default "madvise" mode). Measured on SmolLM2's 210 decoder weights as column panels, fp32, two threads,
interleaved: 1 row 10.8-12.8 ms a pass on 4 KB pages, 9.3-10.6 ms on huge pages; 8 rows 15.2-16.7 ms and
13.7-14.3 ms. The paged KV caches measured no different (the attention kernels read them in runs).
The cost: a copy's last huge page is faulted in whole, so each copy takes up to 2 MB more memory than
its bytes (SmolLM2 fp32: at most about 3 MB a layer, 96 MB over 538 MB of panels; bf16 14 MB).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Mapping

import torch

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest (HEAP_MAX / 2 on 64-bit: DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1024 * 1024 * 1024  # mallopt takes a C int
OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
HUGE_PAGE = 2 * 1024 * 1024  # x86-64's transparent huge page


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns:
        Whether they were set: False off glibc or where the operator set either threshold.
    """
    if any(name in environ for name in OPERATOR_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a contiguous CPU tensor in memory asked to be backed by transparent huge pages; the tensor
    itself where that cannot help or cannot be asked (under one huge page, off the CPU, a platform without
    `madvise`). The copy keeps its private anonymous mapping alive for as long as the copy lives; where
    the kernel declines huge pages (THP "never") it is ordinary memory, equally correct.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return tensor
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are faulted in huge
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping
    start = -raw.data_ptr() % HUGE_PAGE  # huge pages cover aligned 2 MB spans only
    copy = raw[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy
