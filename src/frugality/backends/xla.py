"""XLA devices (TPU, Trainium, XLA's CPU and CUDA clients): ops traced into graphs that are
compiled and run at a step's end; one process drives all of its client's devices (SPMD)."""

from __future__ import annotations

import contextlib
import os
from typing import ClassVar

import torch

from frugality import xla
from frugality.backends.base import Backend, host_peak_memory


class XlaBackend(Backend):
    kind: ClassVar[str] = "xla"
    traced: ClassVar[bool] = True
    one_process: ClassVar[bool] = True
    plans_memory: ClassVar[bool] = False
    model_parallel: ClassVar[bool] = False
    recomputes: ClassVar[bool] = False  # (torch_xla's own checkpoint is not wired in)
    fused_optimizer: ClassVar[bool] = False  # the traced step fuses it
    initialises_on_host: ClassVar[bool] = True

    def synchronize(self) -> None:
        xla.sync()  # the graph so far cut, compiled, run...
        xla.wait()  # ...and waited for

    def peak_memory(self) -> int | None:
        if os.environ.get("PJRT_DEVICE", "CPU") != "CPU":
            return None  # a TPU's or Trainium's memory is not the host's (XLA's CPU client's is)
        return host_peak_memory()

    def generator_device(self) -> torch.device:
        return torch.device("cpu")  # draws on the host, as a CPU would: the same tokens

    def inference(self) -> contextlib.AbstractContextManager:
        return torch.no_grad()  # (XLA's linear layers set version counters, which inference tensors refuse)
