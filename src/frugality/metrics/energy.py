"""Energy meters: what a run's device drew, measured where a counter can be read and
estimated, with the assumption named, where none can.

- NVIDIA GPUs: NVML's total-energy counter (millijoules since the driver loaded; Volta
  and later), as Megatron-LM's energy monitor and Zeus read it.
- CPUs: RAPL through Linux powercap (`/sys/class/powercap/intel-rapl:*`, AMD included),
  the package zones and their DRAM subzones; `energy_uj` counts microjoules and wraps at
  `max_energy_range_uj`. Since Linux 5.10 (CVE-2020-8694) it is readable by root only, so
  most users get an estimate instead.
- Otherwise an estimate: the declared `cost.watts`, or Cloud Carbon Footprint's per-vCPU
  model (watts = min + utilisation x (max - min), per vCPU, with the process's measured
  CPU utilisation), or an accelerator's board power from the price catalogue.

Every meter says whether it measures or estimates, and how (`Meter.label`), so no figure
is ever a silent mix of the two. Several processes on one host each count a `share` of
what the host draws (RAPL's sockets, declared watts, idle vCPUs), so that their sum, which
the run reports, counts the host once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")

# Cloud Carbon Footprint's average watts per vCPU at 0% and 100% utilisation (AWS figures;
# https://www.cloudcarbonfootprint.org/docs/methodology).
CCF_VCPU_MIN_W, CCF_VCPU_MAX_W = 0.74, 3.5


class Meter:
    """Joules since `start()`. `sample()` is called often (every step) so that counters
    that wrap are never read a whole range apart. `kind`: measured, declared or estimated."""

    kind: str = "estimated"
    how: str = ""

    @property
    def measured(self) -> bool:
        return self.kind == "measured"

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.how})"

    def start(self) -> None: ...
    def sample(self) -> None: ...

    def joules(self) -> float:
        raise NotImplementedError


class _Counter:
    """A cumulative counter read as deltas, modulo its range when it wraps."""

    def __init__(self, read, wrap: float | None) -> None:
        self.read, self.wrap = read, wrap
        self.last = read()
        self.total = 0.0

    def sample(self) -> float:
        now = self.read()
        delta = now - self.last
        if delta < 0:  # wrapped (or, without a known range, reset: count nothing)
            delta = delta + self.wrap if self.wrap else 0.0
        self.total += delta
        self.last = now
        return self.total


class RaplMeter(Meter):
    """The CPU packages (and their DRAM where exposed) through Linux powercap. Counts the
    whole socket: other processes on it are included, as the label says."""

    kind = "measured"

    def __init__(self, root: Path = POWERCAP, share: int = 1) -> None:
        self.share = share
        self.zones: list[tuple[Path, str]] = []
        for zone in sorted(root.glob("intel-rapl:*")):
            name = _read_text(zone / "name")
            depth = zone.name.count(":")
            # package-N at the top, dram under it; core/uncore are parts of the package and psys
            # the whole platform, so counting them as well would count twice.
            if (depth == 1 and name.startswith("package")) or (depth == 2 and name == "dram"):
                self.zones.append((zone, name))
        if not self.zones:
            raise OSError(f"no RAPL package zone under {root}")
        self.counters: list[_Counter] = []
        names = sorted({name for _, name in self.zones})
        self.how = f"RAPL {', '.join(names)} via {root}; whole sockets"

    def start(self) -> None:
        self.counters = [
            _Counter(
                lambda z=zone: int(_read_text(z / "energy_uj")) * 1e-6,
                int(_read_text(zone / "max_energy_range_uj")) * 1e-6,
            )
            for zone, _ in self.zones
        ]

    def sample(self) -> None:
        for counter in self.counters:
            counter.sample()

    def joules(self) -> float:
        return sum(counter.sample() for counter in self.counters) / self.share


class NvmlMeter(Meter):
    """One NVIDIA GPU's total-energy counter (the GPU only, not the host). The GPU is found
    by its UUID where torch gives one: NVML numbers every GPU of the machine and ignores
    CUDA_VISIBLE_DEVICES, so torch's cuda:0 may be NVML's GPU 3."""

    kind = "measured"

    def __init__(self, index: int, nvml=None, uuid: str | None = None) -> None:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py

            nvml.nvmlInit()
        self.nvml = nvml
        if uuid is not None:
            self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            which = uuid
        elif not os.environ.get("CUDA_VISIBLE_DEVICES"):
            self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
            which = f"GPU {index}"
        else:
            raise LookupError("CUDA_VISIBLE_DEVICES is set and torch gives no UUID to find the GPU by")
        nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)  # raises where unsupported (before Volta)
        self.how = f"NVML energy counter of {which}; host CPU and memory not included"
        self.counter: _Counter | None = None

    def start(self) -> None:
        read = lambda: self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) * 1e-3
        self.counter = _Counter(read, None)  # 64 bits of millijoules: it does not wrap

    def sample(self) -> None:
        assert self.counter is not None  # set by start()
        self.counter.sample()

    def joules(self) -> float:
        assert self.counter is not None  # set by start()
        return self.counter.sample()


class ConstantPower(Meter):
    """A declared or catalogue power drawn for the whole wall time."""

    def __init__(self, watts: float, why: str, share: int = 1, kind: str = "estimated") -> None:
        self.watts, self.kind = watts / share, kind
        self.how = f"{watts:g} W x wall time; {why}"

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def joules(self) -> float:
        return self.watts * (time.perf_counter() - self.t0)


class CpuUtilisationModel(Meter):
    """Cloud Carbon Footprint's vCPU model with the measured CPU utilisation u:
    vCPUs x (min + u x (max - min)) W over the wall time, which is
    vCPUs x min x wall + CPU seconds x (max - min): each process adds its own CPU seconds
    and its share of the idle draw."""

    def __init__(
        self, vcpus: int, min_w: float = CCF_VCPU_MIN_W, max_w: float = CCF_VCPU_MAX_W, share: int = 1, cpu_seconds=None
    ) -> None:
        self.vcpus, self.min_w, self.max_w, self.share = vcpus, min_w, max_w, share
        self.cpu_seconds = cpu_seconds or _cpu_seconds
        self.how = (
            f"{vcpus} vCPUs x ({min_w:g} + utilisation x {max_w - min_w:g}) W, Cloud Carbon "
            f"Footprint's per-vCPU model, utilisation measured"
        )

    def start(self) -> None:
        self.t0, self.cpu0 = time.perf_counter(), self.cpu_seconds()

    def joules(self) -> float:
        wall = time.perf_counter() - self.t0
        busy = min(self.cpu_seconds() - self.cpu0, wall * self.vcpus / self.share)
        return self.vcpus * self.min_w * wall / self.share + busy * (self.max_w - self.min_w)


def open_meter(
    device_type: str,
    index: int | None = None,
    watts: float | None = None,
    accelerator_w: float | None = None,
    share: int = 1,
    powercap: Path = POWERCAP,
) -> tuple[Meter, list[str]]:
    """The best meter for a device, and why better ones were not used (one phrase each).

    Order: a declared `watts` (the user knows best what the whole machine draws), then the
    device's own counter, then an estimate (an accelerator's board power from the
    catalogue, or the vCPU model on CPUs)."""
    if watts is not None:
        return ConstantPower(watts, "cost.watts, the machine's draw", share, kind="declared"), []
    passed: list[str] = []
    if device_type == "cuda":
        try:
            return NvmlMeter(index or 0, uuid=_torch_uuid(index or 0)), passed
        except Exception as e:  # no library, no driver, a GPU before Volta
            passed.append(f"NVML energy counter unreadable ({type(e).__name__}: {e})")
        if accelerator_w is not None:
            return ConstantPower(
                accelerator_w, "the accelerator's board power from the price catalogue, an upper bound"
            ), passed
        passed.append("no board power for this GPU in the catalogue: the GPU is not counted")
    else:
        try:
            meter = RaplMeter(powercap, share)
            meter.start()  # reads every counter once: fails here if they are root-only
            return meter, passed
        except (OSError, ValueError) as e:
            passed.append(f"RAPL unreadable ({e.strerror if isinstance(e, OSError) and e.strerror else e})")
    return CpuUtilisationModel(vcpus(), share=share), passed


def _torch_uuid(index: int) -> str | None:
    """NVML's name for torch's cuda:index ("GPU-<uuid>"), where torch knows it."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _read_text(path: Path) -> str:
    return path.read_text().strip()


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def vcpus() -> int:
    """The logical CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
