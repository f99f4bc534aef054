"""Energy meters against a fake powercap tree and a fake NVML: deltas, wrap-around,
unreadable counters, and every fallback labelled an estimate with its reason."""

from __future__ import annotations

import types

import pytest

from frugality.metrics import energy
from frugality.metrics.energy import ConstantPower, CpuUtilisationModel, NvmlMeter, RaplMeter, open_meter


def _zone(root, name, zone_name, uj, max_uj=1_000_000_000):
    z = root / name
    z.mkdir(parents=True)
    (z / "name").write_text(zone_name + "\n")
    (z / "energy_uj").write_text(f"{uj}\n")
    (z / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return z


@pytest.fixture
def powercap(tmp_path):
    """Two sockets, a DRAM subzone, and zones that must not be counted (core is part of
    the package, psys the whole platform, mmio a second view of the same package)."""
    root = tmp_path / "powercap"
    _zone(root, "intel-rapl:0", "package-0", 5_000_000)
    _zone(root, "intel-rapl:0:0", "core", 1_000_000)
    _zone(root, "intel-rapl:0:1", "dram", 2_000_000)
    _zone(root, "intel-rapl:1", "package-1", 999_000_000)  # near the top of its range
    _zone(root, "intel-rapl:2", "psys", 0)
    _zone(root, "intel-rapl-mmio:0", "package-0", 0)
    return root


def _set(root, zone, uj):
    (root / zone / "energy_uj").write_text(f"{uj}\n")


def test_rapl_sums_packages_and_dram_through_a_wrap_around(powercap):
    meter = RaplMeter(powercap)
    assert meter.measured and "dram, package-0, package-1" in meter.label and meter.label.startswith("measured")
    meter.start()
    _set(powercap, "intel-rapl:0", 7_000_000)  # +2 J
    _set(powercap, "intel-rapl:0:1", 2_500_000)  # +0.5 J
    _set(powercap, "intel-rapl:1", 999_500_000)  # +0.5 J
    _set(powercap, "intel-rapl:0:0", 90_000_000)  # core: not counted
    _set(powercap, "intel-rapl:2", 50_000_000)  # psys: not counted
    meter.sample()
    assert meter.joules() == pytest.approx(3.0)
    _set(powercap, "intel-rapl:1", 1_500_000)  # wrapped at 1000 J: 1000 - 999.5 + 1.5 = +2 J
    assert meter.joules() == pytest.approx(5.0)


def test_processes_sharing_a_host_count_their_share(powercap):
    meters = [RaplMeter(powercap, share=2) for _ in range(2)]
    for m in meters:
        m.start()
    _set(powercap, "intel-rapl:0", 9_000_000)  # +4 J on the socket both processes run on
    assert sum(m.joules() for m in meters) == pytest.approx(4.0)


def test_an_unreadable_counter_falls_back_to_an_estimate_that_says_why(powercap):
    (powercap / "intel-rapl:0" / "energy_uj").unlink()
    (powercap / "intel-rapl:0" / "energy_uj").symlink_to(powercap / "gone")  # as a root-only file reads for users
    meter, why = open_meter("cpu", powercap=powercap)
    assert isinstance(meter, CpuUtilisationModel) and not meter.measured
    assert meter.label.startswith("estimated (") and "Cloud Carbon Footprint" in meter.label
    assert len(why) == 1 and why[0].startswith("RAPL unreadable")
    meter, why = open_meter("cpu", powercap=powercap.parent / "nothing-here")
    assert isinstance(meter, CpuUtilisationModel) and "no RAPL package zone" in why[0]


def test_a_readable_tree_is_measured_and_declared_watts_win(powercap):
    meter, why = open_meter("cpu", powercap=powercap)
    assert isinstance(meter, RaplMeter) and why == []
    meter, why = open_meter("cpu", watts=300.0, share=2, powercap=powercap)
    assert isinstance(meter, ConstantPower) and meter.watts == 150.0 and "declared" in meter.label
    assert meter.label.startswith("declared (300 W")  # not a measurement, and not our estimate


def test_the_vcpu_model_adds_idle_and_busy_power(monkeypatch):
    clock = iter([100.0, 110.0])  # 10 s of wall time
    monkeypatch.setattr(energy.time, "perf_counter", lambda: next(clock))
    cpu = iter([50.0, 65.0])  # 15 CPU seconds on 2 vCPUs: 75% utilisation
    meter = CpuUtilisationModel(2, min_w=1.0, max_w=3.0, cpu_seconds=lambda: next(cpu))
    meter.start()
    assert meter.joules() == pytest.approx(2 * 1.0 * 10 + 15 * 2.0)  # 2 x (1 + 0.75 x 2) W x 10 s


class FakeNvml(types.SimpleNamespace):
    """NVML's calls as nvidia-ml-py names them; energy in millijoules since the driver loaded."""

    def __init__(self, supported=True):
        super().__init__(mj=123_456_789, supported=supported)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.supported:
            raise RuntimeError("Not Supported")  # pynvml's NVMLError_NotSupported on GPUs before Volta
        return self.mj


def test_nvml_counts_millijoules_of_its_gpu():
    nvml = FakeNvml()
    meter = NvmlMeter(3, nvml)
    meter.start()
    nvml.mj += 2_500
    meter.sample()
    nvml.mj += 1_000
    assert meter.joules() == pytest.approx(3.5)
    assert meter.label == "measured (NVML energy counter of GPU 3; host CPU and memory not included)"


def test_a_gpu_without_the_counter_is_estimated_from_its_board_power(monkeypatch):
    monkeypatch.setattr(energy, "NvmlMeter", lambda index, uuid: NvmlMeter(index, FakeNvml(supported=False)))
    meter, why = open_meter("cuda", 0, accelerator_w=400.0)
    assert isinstance(meter, ConstantPower) and meter.watts == 400.0
    assert meter.label.startswith("estimated (400 W") and "upper bound" in meter.label
    assert why and why[0].startswith("NVML energy counter unreadable (RuntimeError: Not Supported")
    meter, why = open_meter("cuda", 0)  # no board power known either: the GPU goes uncounted, and says so
    assert not meter.measured and why[-1] == "no board power for this GPU in the catalogue: the GPU is not counted"


def test_nvml_finds_torchs_gpu_by_uuid_not_by_index(monkeypatch):
    """NVML numbers all GPUs and ignores CUDA_VISIBLE_DEVICES: torch's cuda:0 may be GPU 3."""
    nvml = FakeNvml()
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: ("gpu", uuid)
    meter = NvmlMeter(0, nvml, uuid="GPU-1234")
    assert meter.handle == ("gpu", "GPU-1234") and "GPU-1234" in meter.label
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(LookupError):  # no uuid and a remapped index: refuse rather than read another GPU
        NvmlMeter(0, nvml)
