"""What `auto` and `train.tf32` choose on each kind of CUDA GPU, with the device's
properties faked (a CPU machine runs these; the choices read nothing else of the GPU)."""

from types import SimpleNamespace

import pytest
import torch

from frugality import hardware
from frugality.precision import apply_tf32, resolve_policy

GPUS = {  # compute capability: a GPU of it
    (6, 1): "NVIDIA GeForce GTX 1080",
    (7, 0): "Tesla V100-SXM2-16GB",
    (7, 5): "Tesla T4",
    (8, 0): "NVIDIA A100-SXM4-40GB",
    (8, 9): "NVIDIA L4",
    (9, 0): "NVIDIA H100 80GB HBM3",
}


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(capability): torch.cuda answers as that GPU would; the settings tf32 changes are restored."""
    saved = torch.get_float32_matmul_precision()

    def fake(capability):
        hardware._probe_cuda.cache_clear()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        props = SimpleNamespace(name=GPUS[capability], multi_processor_count=80)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        return torch.device("cuda")

    yield fake
    hardware._probe_cuda.cache_clear()
    torch.set_float32_matmul_precision(saved)


@pytest.mark.parametrize(
    "capability,chosen",
    [
        ((6, 1), "fp32"),
        ((7, 0), "amp-fp16"),
        ((7, 5), "amp-fp16"),
        ((8, 0), "bf16-sr"),
        ((8, 9), "bf16-sr"),
        ((9, 0), "bf16-sr"),
    ],
)
def test_auto_picks_amp_fp16_where_a_gpu_has_fp16_tensor_cores_but_no_bf16_ones(fake_gpu, capability, chosen):
    policy, note = resolve_policy("auto", fake_gpu(capability))
    assert policy.name == chosen
    assert note.startswith(f"precision auto -> {chosen}: ")
    assert f"compute capability {capability[0]}.{capability[1]}" in note
    assert policy.loss_scaling == (chosen == "amp-fp16")


def test_amp_fp16_where_fp16_products_are_slow_says_so(fake_gpu):
    policy, note = resolve_policy("amp-fp16", fake_gpu((6, 1)))
    assert policy.name == "amp-fp16" and "fp16 products are emulated on this GPU" in note
    policy, note = resolve_policy("amp-fp16", torch.device("cpu"))
    assert policy.compute_dtype == torch.float16 and "emulated on this CPU" in note
    assert resolve_policy("amp-fp16", fake_gpu((7, 5)))[1] == "precision amp-fp16"


def test_tf32_is_on_by_default_where_the_gpu_has_it_and_off_when_asked(fake_gpu):
    from frugality.config.recipe import TrainConfig

    assert TrainConfig().tf32 is True
    line = apply_tf32(fake_gpu((8, 0)), True)
    assert line.startswith("tf32: fp32 matrix products in TF32")
    # both of torch's names for the setting agree, so Inductor's autotuning can read it
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.fp32_precision == "tf32"
    line = apply_tf32(fake_gpu((9, 0)), False)
    assert torch.get_float32_matmul_precision() == "highest" and line.startswith("tf32: off")
    assert apply_tf32(fake_gpu((7, 5)), True) is None  # no TF32 before Ampere: nothing set, nothing said
    assert torch.get_float32_matmul_precision() == "highest"
    assert apply_tf32(torch.device("cpu"), True) is None


def test_the_measured_peak_is_kept_apart_for_tf32(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("FRUGALITY_CACHE", str(tmp_path))
    measured = iter([1e12, 8e12])
    monkeypatch.setattr(hardware, "measure_product_rate", lambda device, dtype: next(measured))
    monkeypatch.setattr(hardware, "fingerprint", lambda device: "a100")
    device = fake_gpu((8, 0))
    apply_tf32(device, False)
    assert hardware.product_rate(device, torch.float32) == 1e12
    apply_tf32(device, True)
    assert hardware.product_rate(device, torch.float32) == 8e12  # measured again, at TF32's rate
    apply_tf32(device, False)
    assert hardware.product_rate(device, torch.float32) == 1e12  # the full-fp32 figure, from the cache
