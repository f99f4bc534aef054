"""Activation checkpointing, applied from outside the model: a checkpointed block keeps only
its input for backward and runs its forward again there (torch.utils.checkpoint, non-reentrant,
as torchtitan's and Megatron-LM's full recomputation do).

- `full`: every block of `model.layers`;
- `selective`: every k-th block (`train.selective_every`; torchtitan's layer-wise selective
  mode): about half the saving for about half the recomputation at k = 2;
- `none`: nothing.

A block is checkpointed by giving it a subclass of its own class whose `forward` wraps the
original (FSDP2's `fully_shard` changes classes the same way): its parameters, their names and
checkpoints stay those of the plain model, and compiling the block (`nn.Module.compile`), FSDP2
and pipeline stages see the same module: applied before them (and after tensor parallel's
plans, which swap the blocks' linear layers, not the blocks). Without gradients (evaluation,
generation) the block runs as it is. The RNG state is kept for the recomputation (the models
have no random op today; a dropout would need it), so a run trains the same bits with and
without it eagerly (compiled in bf16, the low digits differ: Inductor keeps the recomputed
values in float32; docs/training.md).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


def checkpointed_blocks(num_layers: int, mode: str, every: int, stage: int | None = None) -> list[int]:
    """The indices of the blocks a mode recomputes: every one (full), each `every`-th from the
    first (selective; within each pipeline stage of `stage` blocks, counted from its first),
    none."""
    if mode == "full":
        return list(range(num_layers))
    if mode == "selective":
        return [i for i in range(num_layers) if (i % (stage or num_layers)) % every == 0]
    return []


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2, stage: int | None = None) -> int:
    """Checkpoint the blocks of `model.layers` that `mode` names (`stage`: blocks a pipeline
    stage holds), in place; returns how many."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: one of {MODES}")
    layers = getattr(model, "layers", None)
    chosen = checkpointed_blocks(len(layers), mode, every, stage) if isinstance(layers, nn.ModuleList) else []
    for i in chosen:
        block = layers[i]  # type: ignore[index]
        if not isinstance(block, _Checkpointed):
            block.__class__ = _checkpointed(type(block))
    keep_output_workspace(model, mode)
    return len(chosen)


def keep_output_workspace(model: nn.Module, mode: str) -> None:
    """Under a checkpointing mode, the fused output loss gives its tokens x vocab buffer back
    after each forward rather than keeping it for the next step (kernels.output_loss): at the
    step's peak, beside the gradients and moments, it outweighed what recomputation saves.
    Called again for layers swapped in after the mode was applied (a pipeline stage's parts)."""
    for module in model.modules():
        if hasattr(module, "keep_workspace"):
            module.keep_workspace = mode == "none"  # pyright: ignore[reportArgumentType] (a plain attribute)


def checkpointing_of(model: nn.Module) -> str:
    """The mode `model`'s blocks run under: none, full (every block) or selective."""
    layers = list(getattr(model, "layers", []))
    recomputed = sum(isinstance(block, _Checkpointed) for block in layers)
    return "none" if not recomputed else "full" if recomputed == len(layers) else "selective"


class _Checkpointed:
    """Marks a checkpointed block's class."""


@functools.cache
def _checkpointed(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return cls.forward(self, *args, **kwargs)
        return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

    return type(f"Checkpointed{cls.__name__}", (cls, _Checkpointed), {"forward": forward, "__module__": __name__})
