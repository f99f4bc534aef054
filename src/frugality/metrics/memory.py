"""Memory accounting: what the training state really occupies, and the process peak."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from frugality.backends import backend

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
        if backend(t.device).traced:  # XLA tensors have no storage pointer: each counts alone
            seen[(t.device, id(t))] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values()) + missing_grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return cast("DTensor", t).to_local() if hasattr(t, "to_local") else t


def peak_memory_bytes(device: torch.device) -> int | None:
    """The process's peak memory on `device`: the allocator's peak on a GPU, the process's
    peak resident set on a CPU (`frugality.backends`)."""
    return backend(device).peak_memory()
