"""One backend per device kind (CPU, CUDA, XLA): what differs between them, in one place,
named for why the code asks. Code outside the backends, `hardware`'s probes (a device's
name, native bf16, product size) and `kernels/` asks `backend(device)` rather than
comparing `device.type` (`tests/test_backends.py`):

- what a process does once for its device (the process group's backend, the local device
  under torchrun, memory settings at start),
- how the device runs (`traced`: ops recorded into graphs that run at a step's end, so a
  host read mid-step would run the graph so far; XLA),
- memory (free and total, the peak, whether ranks share it, whether it can be planned),
- what is built on it (tensor and pipeline parallel, activation checkpointing, frugality's
  C kernels, a fused optimizer step),
- synchronisation before a clock stops.

Adding a device kind: a module here with a `Backend` subclass, its name in `KINDS`, and
its probe in `frugality.hardware`.
"""

from __future__ import annotations

import torch

from frugality.backends.base import Backend, OtherBackend
from frugality.backends.cpu import CpuBackend
from frugality.backends.cuda import CudaBackend
from frugality.backends.xla import XlaBackend

KINDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "xla": XlaBackend}


def backend(device: torch.device | str) -> Backend:
    """The backend of `device` (a torch.device or its name)."""
    device = torch.device(device)
    return KINDS.get(device.type, OtherBackend)(device)


__all__ = ["KINDS", "Backend", "CpuBackend", "CudaBackend", "OtherBackend", "XlaBackend", "backend"]
