"""On glibc, freed large blocks stay in the heap: allocating one again costs no page faults."""

import platform
import resource

import pytest
import torch

from frugality.training.host_memory import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_large_tensor_allocated_again_is_not_faulted_in_again():
    assert keep_freed_memory()
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # 64 MB: above glibc's default mmap threshold
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 1000  # 64 MB of fresh pages would be 16,384 faults
