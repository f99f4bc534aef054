"""Data parallel over the devices of one XLA process, through SPMD (`parallel.spmd`): the
program stays the one-device program, its tensors carry sharding annotations, and XLA's
partitioner splits each graph over the devices and inserts the collectives. What
torchrun's processes do with DDP and FSDP2 on CPUs and GPUs, TPUs (and XLA's CPU client)
do this way:
- every micro-batch is split along its rows over the devices (a forward pre-hook on the
  training module, applied from outside like DDP's wrapping); the loss is the mean over
  the whole micro-batch, as one device computes it on all the rows;
- `fsdp` also splits each parameter along its first dimension where the devices divide it
  (the rest stay whole on each); the optimizer's moments, made from the parameters by the
  traced update, follow them.
"""

from __future__ import annotations

from torch import nn

from frugality import xla
from frugality.config.recipe import ParallelConfig


def wrap_spmd(module: nn.Module, model: nn.Module, parallel: ParallelConfig) -> tuple[nn.Module, str]:
    """`module` (the task's training module around `model`, both on the XLA device) with
    its batches and, for fsdp, `model`'s parameters sharded; a line for the run header.
    (hsdp, refused before anything starts, would need a two-axis mesh.)"""
    count = xla.device_count()
    split = []
    if parallel.data == "fsdp":
        for name, p in model.named_parameters():
            if p.dim() and p.shape[0] % count == 0:
                xla.shard(p)
                split.append(name)
    module.register_forward_pre_hook(_shard_batch)
    total = len(list(model.parameters()))
    what = f"parameters split ({len(split)} of {total}), " if parallel.data == "fsdp" else ""
    return module, f"SPMD over {count} XLA devices ({parallel.data}): {what}each micro-batch split by rows"


def _shard_batch(module: nn.Module, args: tuple) -> None:
    xla.shard(args[0])
