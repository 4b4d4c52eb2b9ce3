"""glibc's allocator, told to give model-sized buffers back to the system when they are freed.

glibc serves a large block from its own mmap and unmaps it on free, but after the first such free it
raises that threshold (up to 32 MiB on 64-bit) and serves later blocks of that size from its heaps,
where freed memory stays in the process: a node's per-tensor temporaries (the outer step's, a
round's, a state download's) then pile up as resident memory that no buffer owns, and a forked
child keeps whatever the parent freed under it. Setting the threshold fixes it (glibc's mallopt(3):
an explicit M_MMAP_THRESHOLD disables the adjustment). Elsewhere (macOS, musl) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 256 * 1024  # blocks from 256 KiB (64k fp32 values) up: their own mapping, unmapped on free


def return_freed_memory() -> bool:
    """Call once at start, before model-sized buffers exist. :returns: whether glibc took the setting."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False
