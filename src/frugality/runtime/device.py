"""The device a recipe's `train.device` names."""

from __future__ import annotations

import torch

from frugality.errors import UserError


def resolve_device(name: str) -> torch.device:
    """'auto' (a CUDA GPU where torch sees one, else the CPU), 'cpu', 'cuda', 'cuda:1'...;
    checked, with no other effect."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"train.device: {name!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device: {name!r} requested but this torch build sees no CUDA device")
    return device
