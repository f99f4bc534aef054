"""The compile session a run asks for, by its device: Inductor's (`compile.session`) on a CPU
or a GPU, XLA's guard of its own compilations (`compile.xla`) on an XLA device."""

from __future__ import annotations

import torch

from frugality.backends import backend
from frugality.compile.base import Session
from frugality.compile.session import CompileSession


def open_session(recipe, device: torch.device, policy, checkpointing: str = "none") -> Session:
    """The session for `recipe` on `device` under the resolved precision `policy` and
    activation checkpointing mode. On XLA its executable cache opens here, before the process
    compiles any graph."""
    if backend(device).traced:
        from frugality.compile.xla import XlaCompileSession  # (imports torch_xla's helpers)

        return XlaCompileSession.for_recipe(recipe, policy.key)
    return CompileSession.for_recipe(recipe, device, policy, checkpointing)
