"""The devices of this machine for `frugality ls` (what they are) and `frugality top`
(what they are doing): CPUs from Linux's /proc and torch's probe, NVIDIA GPUs from NVML
(`nvidia-ml-py`), XLA devices from their PJRT client (where `PJRT_DEVICE` is set), each
figure absent rather than guessed where it cannot be read. GPUs are numbered as NVML
numbers them (all of the machine's, as nvidia-smi shows them), which is not torch's
numbering under CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import cast

import torch

from frugality import xla
from frugality.errors import UserError
from frugality.hardware import device_memory, probe
from frugality.metrics.energy import POWERCAP, RaplMeter, vcpus


def inventory() -> list[dict]:
    """Every device, one dict each: kind, index, name and what it can do."""
    hw = probe("cpu")
    cpu = {
        "kind": "cpu",
        "index": 0,
        "name": hw.name,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": vcpus(),
        "instruction_sets": list(hw.features),
        "torch_isa": hw.torch_isa,
        "native_bf16": hw.native_bf16,
        "memory_gib": _memory_gib()[1],
    }
    return [cpu, *_nvml_inventory(), *_xla_inventory()]


def _xla_inventory() -> list[dict]:
    """The PJRT client's devices, where this process is started for XLA (`PJRT_DEVICE`) and
    torch_xla is installed: opening the client is the only way to know them."""
    if not (xla.requested() and xla.installed()):
        return []
    try:
        client, count, version = xla.client(), xla.device_count(), xla.version()
    except UserError as e:  # a mismatched torch_xla, a device not here: said, not raised
        return [{"kind": "xla", "index": 0, "name": f"not opened: {e}", "client": None, "torch_xla": None}]
    return [
        {"kind": "xla", "index": i, "name": f"XLA {client} client", "client": client, "torch_xla": version}
        for i in range(count)
    ]


def _nvml():
    """The NVML module, initialised; None without the library or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _nvml_inventory() -> list[dict]:
    nvml = _nvml()
    if nvml is None:
        return []
    gpus = []
    driver = _text(nvml.nvmlSystemGetDriverVersion())
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
        gpus.append(
            {
                "kind": "cuda",
                "index": i,
                "name": _text(nvml.nvmlDeviceGetName(h)),
                "memory_gib": round(nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
                "driver": driver,
                "compute_capability": f"{major}.{minor}",
                "power_limit_w": _maybe(lambda h=h: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000),
            }
        )
    return gpus


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(read):
    try:
        return read()
    except Exception:  # a figure this device or driver does not report
        return None


class Sampler:
    """Utilisation, memory and power of every device over the time between two calls of
    `sample()` (the first call measures from construction)."""

    def __init__(self, powercap: Path = POWERCAP, proc_stat: Path = Path("/proc/stat")) -> None:
        self.proc_stat = proc_stat
        self.cpu_before = self._cpu_times()
        self.t0 = time.perf_counter()
        self.rapl_joules = 0.0  # at the last sample
        try:
            self.rapl = RaplMeter(powercap)
            self.rapl.start()
        except (OSError, ValueError):
            self.rapl = None
        self.nvml = _nvml()

    def _cpu_times(self) -> tuple[int, int] | None:
        """(busy, total) jiffies of all CPUs, from /proc/stat's first line."""
        try:
            fields = [int(x) for x in self.proc_stat.read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def sample(self) -> list[dict]:
        now = time.perf_counter()
        seconds, self.t0 = now - self.t0, now
        times = self._cpu_times()
        util = None
        if times and self.cpu_before and times[1] > self.cpu_before[1]:
            util = (times[0] - self.cpu_before[0]) / (times[1] - self.cpu_before[1])
        self.cpu_before = times
        cpu = {
            "kind": "cpu",
            "index": 0,
            "utilisation": None if util is None else round(util, 3),
            "memory_used_gib": _memory_gib()[0],
            "memory_gib": _memory_gib()[1],
            "power_w": None,
        }
        if self.rapl is not None and seconds > 0:
            joules = self.rapl.joules()
            cpu["power_w"] = round((joules - self.rapl_joules) / seconds, 1)
            self.rapl_joules = joules
        devices = [cpu]
        if self.nvml is not None:
            nvml = self.nvml
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                memory = nvml.nvmlDeviceGetMemoryInfo(h)
                devices.append(
                    {
                        "kind": "cuda",
                        "index": i,
                        # a c_uint field (pynvml's __getattribute__, which decodes bytes, widens its type to str)
                        "utilisation": _maybe(lambda h=h: cast(int, nvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100),
                        "memory_used_gib": round(memory.used / 2**30, 2),
                        "memory_gib": round(memory.total / 2**30, 1),
                        "power_w": _maybe(lambda h=h: round(nvml.nvmlDeviceGetPowerUsage(h) / 1000, 1)),
                    }
                )
        return devices


def _memory_gib() -> tuple[float, float]:
    """(used, total) GiB of host memory, as `hardware.device_memory` reads it."""
    free, total = device_memory(torch.device("cpu"))
    return round((total - free) / 2**30, 1), round(total / 2**30, 1)
