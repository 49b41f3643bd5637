"""Whether this process runs with phalanx's allocator setting, judged by its effect (glibc's
mallinfo2): a freshly allocated 64 MiB block lands on the heap instead of in its own mmap. The
setting is made by mallopt inside the process (binding.keep_freed_memory_mapped), so no
environment variable shows it; this looks at what it does."""

from __future__ import annotations

import ctypes

import torch

_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def keeps_large_blocks_off_mmap() -> bool:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    before = libc.mallinfo2().hblkhd
    block = torch.empty(64 << 20, dtype=torch.uint8)
    mapped = libc.mallinfo2().hblkhd - before
    del block
    return mapped == 0
