"""CPUs: the host's RAM, shared by the machine's ranks; frugality's C kernels."""

from __future__ import annotations

import os
from typing import ClassVar

from frugality.backends.base import Backend


class CpuBackend(Backend):
    kind: ClassVar[str] = "cpu"
    host_memory: ClassVar[bool] = True
    c_kernels: ClassVar[bool] = True
    on_host: ClassVar[bool] = True

    def local_count(self) -> int | None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
