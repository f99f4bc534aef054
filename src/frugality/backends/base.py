"""The interface every device kind's backend gives (`frugality.backends`)."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from typing import ClassVar

import torch


class Backend:
    """A device of one kind. Class attributes say what holds for the kind; methods act on
    the device given."""

    kind: ClassVar[str]
    process_group: ClassVar[str] = "gloo"  # torch.distributed's backend for its ranks
    traced: ClassVar[bool] = False  # ops recorded into graphs, compiled and run at a step's end
    host_memory: ClassVar[bool] = False  # a CPU: its memory is the host's RAM, which a machine's ranks share
    plans_memory: ClassVar[bool] = True  # its free memory is known: a run is planned against it
    model_parallel: ClassVar[bool] = True  # tensor and pipeline parallel are built for it
    recomputes: ClassVar[bool] = True  # activation checkpointing is built for it
    one_process: ClassVar[bool] = False  # one process drives all of the machine's devices (no torchrun over them)
    c_kernels: ClassVar[bool] = False  # frugality's C kernels run on its tensors
    fused_optimizer: ClassVar[bool] = True  # the optimizer's step can run as one fused kernel (else traced)
    initialises_on_host: ClassVar[bool] = False  # a model is built on the host first (the seed's values as on a CPU)
    # its ops run on the host's cores (a CPU): synchronous (a host clock around an op times
    # it), sharing the cores with the process's other work; Inductor builds C++ for them and
    # oneDNN runs their products (int8, packed bf16)
    on_host: ClassVar[bool] = False
    device_per_rank: ClassVar[bool] = False  # each rank has a device of its own, priced and metered apart
    # Inductor can capture a compiled graph and replay it whole (CUDA graphs, mode
    # "reduce-overhead"): a decoding step's hundreds of kernel launches become one
    replays_graphs: ClassVar[bool] = False
    # its ops are queued and run while the host goes on (a GPU): host tensors bound for it go
    # through page-locked memory, copied without blocking, and results come back in bulk
    asynchronous: ClassVar[bool] = False

    def __init__(self, device: torch.device):
        self.device = device

    def local_device(self, local_rank: int, distributed: bool) -> torch.device:
        """The device a rank of this machine runs on."""
        return self.device

    def join(self, local_rank: int) -> None:
        """What a rank does for its device before the process group opens."""

    @classmethod
    def available(cls) -> bool:
        """Whether this torch build can use devices of this kind."""
        return True

    def local_count(self) -> int | None:
        """How many ranks this machine holds for the kind, one each (None: not counted; XLA:
        one process drives them all)."""
        return None

    def compute_capability(self) -> tuple[int, int] | None:
        """A CUDA GPU's compute capability (None elsewhere)."""
        return None

    def synchronize(self) -> None:
        """Wait for the work queued on the device (before a clock stops)."""

    def peak_memory(self) -> int | None:
        """The process's peak memory on the device, bytes (None where it cannot be read)."""
        return host_peak_memory()

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes: the host's RAM unless the kind says otherwise."""
        return host_memory()

    def release_cached(self) -> None:
        """Hand the device memory this process's allocator keeps for reuse back to the device
        (for another process to have it: a benchmark's fresh memory probe)."""

    def generator_device(self) -> torch.device:
        """Where a torch.Generator drawing for this device lives."""
        return self.device

    def inference(self) -> contextlib.AbstractContextManager:
        """The context inference runs in."""
        return torch.inference_mode()


class OtherBackend(Backend):
    """A kind frugality has no backend for (`meta`, `mps`, ...): run as plain PyTorch, none
    of frugality's kernels, its free memory not planned against (the host's peak is read)."""

    kind: ClassVar[str] = "other"
    plans_memory: ClassVar[bool] = False


def host_peak_memory() -> int | None:
    """The process's peak resident set, bytes. On Linux this reads VmHWM from
    /proc/self/status rather than getrusage's ru_maxrss, which a process inherits from its
    parent across fork and exec (so a small child of a big parent would report the
    parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def host_memory() -> tuple[int, int]:
    """(free, total) bytes of the host's RAM (free: the kernel's estimate of what can be
    allocated without swapping, MemAvailable), within the limit of this process's memory
    cgroup (a container's) where one is set."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = total
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_memory()
    if limit is not None:
        total, free = min(total, limit[0]), min(free, max(0, limit[0] - limit[1]))
    return free, total


def _cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) bytes of this process's memory cgroup (v2, else v1), or None unlimited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if text == "max" or not text.isdigit() or int(text) >= 1 << 60:  # v1 says "unlimited" with a huge number
            return None
        return int(text), usage
    return None
