"""The device a recipe's `train.device` (or a command's `--device`) names."""

from __future__ import annotations

import torch

from frugality import xla
from frugality.backends import backend
from frugality.errors import UserError


def names_xla(name: str) -> bool:
    """Whether `name` resolves to an XLA device, without opening its client (SPMD must be
    chosen before it opens)."""
    return name.split(":")[0] == "xla" or (name == "auto" and xla.requested() and xla.installed())


def resolve_device(
    name: str, key: str = "train.device", xla_ok: bool = False, what: str = "this command"
) -> torch.device:
    """'auto', 'cpu', 'cuda', 'cuda:1', 'xla'...; checked, with no other effect than opening an
    XLA client. `auto` is XLA where the caller runs there (`xla_ok`) and
    `PJRT_DEVICE` is set with torch_xla installed, else a CUDA GPU where torch sees one, else
    the CPU. `key` names the setting in messages, `what` the command."""
    if name == "auto":
        if xla_ok and xla.requested() and xla.installed():
            return xla.device()
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] == "xla":
        if not xla_ok:
            raise UserError(
                f"{key}: {name!r}: {what} does not run on an xla device yet "
                "(train, compile, embed, generate and doctor do; docs/xla.md)"
            )
        if name not in ("xla", "xla:0"):
            raise UserError(f"{key}: {name!r}: a process runs on its own XLA device, xla (or xla:0)")
        return xla.device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{key}: {name!r} is not a device (cpu, cuda, cuda:1, xla, ...)") from None
    if not backend(device).available():
        raise UserError(f"{key}: {name!r} requested but this torch build sees no CUDA device")
    return device


def check_local_processes(device: torch.device, nproc: int, flag: str = "--nproc") -> None:
    """Refuse, in one line, more local processes than this machine has devices for: a GPU
    each on CUDA, a core each on a CPU (more only contend for them). `train --nproc` and
    `doctor --nproc` alike."""
    import os

    kind = backend(device)
    slots = kind.local_count()
    if kind.device_per_rank and slots is not None and nproc > slots:
        raise UserError(f"{flag} {nproc}: this machine has {slots} CUDA device(s), one per rank")
    cores = len(os.sched_getaffinity(0))
    if kind.on_host and nproc > cores:
        raise UserError(
            f"{flag} {nproc}: this machine has {cores} CPU cores, and each CPU rank needs one; "
            "more ranks than cores only contend for them (use torchrun across machines for more)"
        )
