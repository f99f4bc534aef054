"""Memory accounting: what the training state really occupies, and the process peak."""

from __future__ import annotations

import os
import resource
import sys
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of weights, gradients and optimizer state, counting each storage once (flat
    buffers that parameters are views of are not counted twice).

    Optimizers that free gradients between steps (`zero_grad(set_to_none=True)`) still
    hold them through every backward and update, so a missing gradient counts at its
    parameter's size and dtype, which is what backward allocates. Sharded tensors (FSDP2's
    DTensors) count their local shard: this process's bytes."""
    params = [_local(p) for p in model.parameters()]
    tensors = params + [_local(p.grad) for p in model.parameters() if p.grad is not None]
    missing_grads = sum(
        p.numel() * p.element_size() for p, full in zip(params, model.parameters(), strict=True) if full.grad is None
    )
    for state in optimizer.state.values():
        tensors += [_local(t) for t in state.values() if isinstance(t, torch.Tensor)]
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t.device.type == "xla":  # XLA tensors have no storage pointer: each counts alone
            seen[(t.device, id(t))] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values()) + missing_grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return cast("DTensor", t).to_local() if hasattr(t, "to_local") else t


def peak_memory_bytes(device: torch.device) -> int | None:
    """CUDA: the allocator's peak on the device. CPU: the process's peak resident set.

    On Linux this reads VmHWM from /proc/self/status rather than getrusage's ru_maxrss,
    which a process inherits from its parent across fork and exec (so a small child of a
    big parent would report the parent's peak)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type == "xla" and os.environ.get("PJRT_DEVICE", "CPU") != "CPU":
        return None  # a TPU's or Trainium's memory is not the host's (XLA's CPU client's is)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
