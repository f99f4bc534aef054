"""Does the device compute correctly: matrix products in each precision against a float64
reference, stochastic rounding without bias, and its measured peak."""

from __future__ import annotations

import torch

from frugality.hardware import measure_product_rate, probe
from frugality.health import INFO, Check, at_most
from frugality.precision.stochastic_rounding import noise16x3, round_to_bf16


def product_checks(device: torch.device, limits: dict[str, float], n: int = 256) -> list[Check]:
    """A 256-square product in fp32 and bf16 against float64 on the same (rounded) inputs:
    relative error in the Frobenius norm."""
    gen = torch.Generator().manual_seed(0)
    a64, b64 = (
        torch.randn(n, n, generator=gen, dtype=torch.float64),
        torch.randn(n, n, generator=gen, dtype=torch.float64),
    )
    checks = []
    for dtype, key in ((torch.float32, "fp32_product_rel_error"), (torch.bfloat16, "bf16_product_rel_error")):
        a, b = a64.to(dtype), b64.to(dtype)
        reference = a.double() @ b.double()  # exact products of the rounded inputs
        got = (a.to(device) @ b.to(device)).cpu().double()
        error = ((got - reference).norm() / reference.norm()).item()
        checks.append(
            at_most(
                "device",
                f"{str(dtype).removeprefix('torch.')} product",
                error,
                limits[key],
                f"rel. error {error:.1e}",
                key,
            )
        )
    return checks


def stochastic_rounding_check(device: torch.device, limits: dict[str, float], n: int = 1 << 20) -> Check:
    """Round 1 + 0.3 bf16 steps a million times with the optimizer's noise: the mean must
    be the value itself (round-to-nearest would give 1 exactly, 0.3 steps off)."""
    step = 2.0**-7  # bf16's spacing in [1, 2)
    value = 1.0 + 0.3 * step
    x = torch.full((n,), value, dtype=torch.float32, device=device)
    index = torch.arange(n, dtype=torch.int64, device=device)
    noise = noise16x3(index, torch.tensor(12345, dtype=torch.int64, device=device))[0]
    mean = round_to_bf16(x, noise).double().mean().item()
    bias = abs(mean - value) / step
    return at_most(
        "device",
        "stochastic rounding bias",
        bias,
        limits["sr_mean_bias_steps"],
        f"{bias:.4f} bf16 steps",
        "sr_mean_bias_steps",
    )


def peak_checks(device: torch.device) -> list[Check]:
    """The measured product peak in fp32 and bf16 (information: the speed MFU is against)."""
    hw = probe(device)
    checks = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        size = None if dtype == torch.float32 or hw.native_bf16 else 256  # emulated bf16: keep it short
        gflops = measure_product_rate(device, dtype, size) / 1e9
        checks.append(
            Check(
                "device",
                f"{name} peak",
                INFO,
                f"{gflops:,.1f} GFLOP/s",
                "native" if dtype == torch.float32 or hw.native_bf16 else f"not native: {hw.why}",
                {"gflops": gflops},
            )
        )
    return checks
