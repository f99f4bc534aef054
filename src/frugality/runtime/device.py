"""The device a recipe's `train.device` (or a command's `--device`) names."""

from __future__ import annotations

import torch

from frugality import xla
from frugality.errors import UserError


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """'auto' (XLA where `PJRT_DEVICE` is set and torch_xla is installed, else a CUDA GPU
    where torch sees one, else the CPU), 'cpu', 'cuda', 'cuda:1', 'xla'...; checked, with no
    other effect than opening an XLA client. `key` names the setting in messages."""
    if name == "auto":
        if xla.requested() and xla.installed():
            return xla.device()
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] == "xla":
        return xla.device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{key}: {name!r} is not a device (cpu, cuda, cuda:1, xla, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key}: {name!r} requested but this torch build sees no CUDA device")
    return device
