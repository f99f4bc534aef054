"""On glibc, a training step's large temporaries stop being page-faulted in anew each step."""

import platform
import resource

import pytest
import torch

from frugality.runtime.host_memory import keep_freed_memory

# A step's pattern of large temporaries: each lives while the next two are made. All are
# above glibc's default mmap threshold's ceiling (32 MB) or the dynamic threshold's start.
_SIZES_MB = (48, 8, 100, 33, 8, 200)


def _step() -> None:
    live = []
    for size in _SIZES_MB:
        live.append(torch.empty(size << 20, dtype=torch.uint8).fill_(1))
        if len(live) > 2:
            live.pop(0)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_repeated_steps_reuse_freed_blocks_instead_of_faulting_them_in():
    assert keep_freed_memory()
    for _ in range(6):  # the heap grows to the steps' high-water mark (2-3 steps here), then stays
        _step()
    faults = []
    for _ in range(3):
        before = _faults()
        _step()
        faults.append(_faults() - before)
    # Fresh pages would be ~100,000 faults (397 MB) a step; glibc's defaults fault nearly all
    # of them every step. (In a test process other allocations can shift the heap once more.)
    assert min(faults) < 2_000, faults


def _resident_mb() -> float:
    from pathlib import Path

    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_giving_freed_memory_back_lowers_the_resident_set_the_kept_blocks_held():
    """What a step under activation checkpointing ends with: the blocks the heap kept (with
    the thresholds raised) go back to the kernel."""
    from frugality.runtime.host_memory import give_back_freed_memory

    assert keep_freed_memory()
    _step()  # (its blocks freed, kept in the heap: 400 MB)
    kept = _resident_mb()
    assert give_back_freed_memory()
    assert _resident_mb() < kept - 100, (kept, _resident_mb())
