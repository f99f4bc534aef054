"""Host memory for training on CPUs: keep freed large blocks for reuse.

PyTorch's CPU allocator hands large tensors to malloc, and glibc's malloc serves large
blocks with fresh pages from mmap and unmaps them again on free, so every large
temporary of a training step (activations, gradients, the output layer's products) is
page-faulted in anew on every step: about 88,000 faults (345 MB) per step for Pythia-70m
at 4 x 512 tokens, measured on a 2-core VM, where page faults are dear. Raising glibc's
mmap and trim thresholds keeps such blocks in the heap, so later steps reuse them
(about 100 faults per step; peak memory unchanged, since each step needs the same blocks
again). This is what preloading tcmalloc or jemalloc does, as PyTorch's CPU performance
guide recommends, without a dependency. It is process-wide: in `frugality bench`, both
implementations get it.
"""

from __future__ import annotations

import ctypes
import platform
from functools import lru_cache

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once; True if they took (False elsewhere: musl, macOS...)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success; glibc caps the mmap threshold, so fall back to its cap.
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) or libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    return bool(mmap_ok and trim_ok)
