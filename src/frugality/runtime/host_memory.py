"""Host memory for training on CPUs: keep freed large blocks for reuse.

PyTorch's CPU allocator hands large tensors to malloc. glibc serves blocks above its mmap
threshold (128 KB, rising with use to at most 32 MB) with fresh pages from mmap and unmaps
them on free, and trims freed memory at the top of the heap, so the large temporaries of
a training step (activations, gradients, the output layer's 200 MB of logits) are
page-faulted in and zeroed by the kernel anew on every step: 88,000-120,000 faults
(345-470 MB) per compiled Pythia-70m bf16-sr step at 4 x 512 tokens, measured on a 2-core
VM, and about 4,000 with the thresholds raised. Raising both thresholds
keeps such blocks in the heap. The first steps still fault while the heap grows (PyTorch
asks for 64-byte-aligned blocks, which glibc pads, so a freed block is a little too small
for the next request of the same size until its neighbours are freed too and coalesce);
after that, every step reuses the same memory. This is what preloading tcmalloc or
jemalloc achieves, as PyTorch's CPU performance guide recommends, without the dependency.

The price: the heap keeps its high-water mark, and fragmentation can add to it. It is
process-wide (in `frugality bench`, both implementations get it); set
FRUGALITY_KEEP_FREED_MEMORY=0 to leave glibc's defaults. `frugality train` leaves them under
an activation checkpointing mode, which asks for memory over time, and trims the heap after
each step there (`give_back_freed_memory`): Pythia-70m at 4 x 512 in fp32 with full
recomputation held about 600 MiB of freed memory in the heap at its peak (holes the next
step's blocks did not fit), more than the recomputation saved; trimmed, its peak less the
training state fell from 567-669 to 413-426 MiB for 6-7% more time a step (the pages
faulted in again). The setting holds for the rest of the process once made: a process that
trains under a checkpointing mode after one that kept freed memory (Python calling `train`
twice, `bench train`) keeps it.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import lru_cache

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST_INT = 2**31 - 1  # mallopt takes an int


@lru_cache(maxsize=1)
def _glibc():
    """glibc, loaded; None where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def give_back_freed_memory() -> bool:
    """Return the heap's free pages to the kernel (`malloc_trim`): after a step under an
    activation checkpointing mode, so that the next step's peak does not stand on the holes
    of the last (True if glibc did it)."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once; True if they took (False where the C library is not
    glibc, or when FRUGALITY_KEEP_FREED_MEMORY=0)."""
    if os.environ.get("FRUGALITY_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = _glibc()
    if libc is None:
        return False
    # Setting the mmap threshold also turns off its dynamic adjustment. Should this glibc
    # refuse 1 GB, take 32 MB, the top of the range its dynamic threshold moves in.
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) or libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, _LARGEST_INT)
    return bool(mmap_ok and trim_ok)
