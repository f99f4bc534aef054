"""The capability probe: instruction sets within the user's limits, the precision `auto`
picks from them, and MFU that is never above 100%."""

import pytest
import torch

from frugality import hardware, precision
from frugality.metrics.peak import PeakProbe, mfu
from frugality.precision import resolve_policy

AMX_FLAGS = {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}
AVX2_FLAGS = {"avx2", "fma"}


def _cpu(monkeypatch, flags, onednn="", aten=""):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: set(flags))
    return hardware._probe_cpu.__wrapped__(2, onednn, aten)


def test_this_machine_is_described_in_one_line():
    hw = hardware.probe("cpu")
    assert hw.device_type == "cpu" and hw.cores >= 1 and hw.threads >= 1
    assert set(hw.features) <= set(hardware.X86_FEATURES + hardware.ARM_FEATURES)
    line = hw.describe()
    assert "\n" not in line and ("not native" in line) == (not hw.native_bf16)


def test_amx_and_avx512_bf16_are_native_avx2_is_not(monkeypatch):
    assert _cpu(monkeypatch, AMX_FLAGS).native_bf16 and _cpu(monkeypatch, AMX_FLAGS).why == "AMX"
    assert _cpu(monkeypatch, {"avx2", "avx512f", "avx512_bf16"}).why == "AVX512-BF16"
    avx2 = _cpu(monkeypatch, AVX2_FLAGS)
    assert not avx2.native_bf16 and "AVX2" in avx2.why


@pytest.mark.parametrize(
    "onednn, aten, left",
    [
        ("AVX2", "", ("avx2", "fma")),
        ("AVX512_CORE", "", ("avx2", "fma", "avx512f", "avx512bw")),
        ("AVX512_CORE_AMX", "", tuple(sorted(AMX_FLAGS))),
        ("", "avx2", ("avx2", "fma", "amx_tile", "amx_bf16")),  # oneDNN still has AMX
        ("AVX2", "avx2", ("avx2", "fma")),  # both limits: how an AVX2-only machine is emulated
        ("ALL", "", tuple(sorted(AMX_FLAGS))),
    ],
)
def test_user_limits_on_torch_libraries_narrow_the_features(monkeypatch, onednn, aten, left):
    hw = _cpu(monkeypatch, AMX_FLAGS, onednn, aten)
    assert tuple(sorted(hw.features)) == tuple(sorted(left))
    assert hw.native_bf16 == ("amx_bf16" in left)
    if onednn == "AVX2":
        assert "ONEDNN_MAX_CPU_ISA" in hw.why


@pytest.mark.parametrize("flags, picked", [(AMX_FLAGS, "bf16-sr"), (AVX2_FLAGS, "fp32")])
def test_auto_picks_the_fastest_native_policy_and_says_why(monkeypatch, flags, picked):
    hw = _cpu(monkeypatch, flags)
    monkeypatch.setattr(precision, "probe", lambda device="cpu": hw)
    policy, note = resolve_policy("auto", torch.device("cpu"))
    assert policy.name == picked and not policy.fp32_products
    assert note.startswith(f"precision auto -> {picked}") and hw.why in note


def test_bf16_policies_without_native_products_keep_storage_and_compute_in_fp32(monkeypatch):
    hw = _cpu(monkeypatch, AVX2_FLAGS)
    monkeypatch.setattr(precision, "probe", lambda device="cpu": hw)
    cpu = torch.device("cpu")
    for name in ("bf16-sr", "bf16"):
        policy, note = resolve_policy(name, cpu)
        assert policy.storage_dtype == torch.bfloat16 and policy.state_bytes_per_param == 8
        assert policy.fp32_products and policy.compute_dtype == torch.float32
        assert "products computed in fp32" in note and policy.label == f"{name} (fp32 products)"
    amp, note = resolve_policy("amp-bf16", cpu)
    assert not amp.autocast and amp.compute_dtype == torch.float32 and "not bf16 autocast" in note
    assert resolve_policy("fp32", cpu)[0].label == "fp32"


def test_native_hardware_keeps_the_policies_as_named(monkeypatch):
    hw = _cpu(monkeypatch, AMX_FLAGS)
    monkeypatch.setattr(precision, "probe", lambda device="cpu": hw)
    for name in ("amp-bf16", "bf16-sr", "bf16"):
        policy = resolve_policy(name, torch.device("cpu"))[0]
        assert policy.compute_dtype == torch.bfloat16 and not policy.fp32_products and policy.label == name


def test_mfu_is_never_above_100_percent_and_unknown_without_a_peak():
    assert mfu(50.0, 100.0) == 0.5
    assert mfu(472.0, 100.0) is None  # the peak read low: unknown, not 472%
    assert mfu(1.0, None) is None and mfu(1.0, 0.0) is None and mfu(1.0, float("nan")) is None


def test_product_speeds_are_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FRUGALITY_CACHE", str(tmp_path))
    report = hardware.report(torch.device("cpu"))
    assert report["fp32_gflops"] > 0 and report["bf16_gflops"] > 0
    assert hardware.fingerprint(torch.device("cpu")) in (tmp_path / "products.json").read_text()


def test_the_peak_probe_shrinks_where_a_dtype_is_slow_here():
    """bf16 without native products ran 0.3 GFLOP/s: a 2048 probe would take a minute a call."""
    probe = PeakProbe(torch.device("cpu"), torch.bfloat16)
    if hardware.probe("cpu").native_bf16:
        assert probe.n >= 512
    else:
        assert probe.n < 2048
    assert probe.sample() > 0


def test_a_onednn_cap_below_an_isa_is_read_from_either_name(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert not hardware.onednn_capped_below("AVX512_CORE_VNNI")
    for value, capped in (("AVX2", True), ("avx512_core", True), ("AVX512_CORE_VNNI", False), ("ALL", False)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", value)
        assert hardware.onednn_capped_below("AVX512_CORE_VNNI") is capped, value
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "NOT_AN_ISA")  # oneDNN ignores it: no cap
    assert not hardware.onednn_capped_below("AVX512_CORE_VNNI")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # the older name
    assert hardware.onednn_capped_below("AVX512_CORE_VNNI")
