"""Stochastic rounding is unbiased, reproducible, and leaves special values alone."""

import math

import pytest
import torch

from frugality.precision.stochastic_rounding import mix_key, noise16x3, round_to_bf16


def _noise(n, key, which=0):
    return noise16x3(torch.arange(n, dtype=torch.int64), torch.tensor(key))[which]


def test_noise_is_uniform_16_bit():
    for which in range(3):
        noise = _noise(1 << 20, mix_key(1, 2, 3), which)
        assert noise.min() >= 0 and noise.max() < 1 << 16
        counts = torch.bincount(noise >> 12, minlength=16).double()  # 16 bins of 4096 values
        expected = (1 << 20) / 16
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 45.0  # chi-square, 15 degrees of freedom: p < 1e-4 beyond this


@pytest.mark.parametrize("value", [1.0 + 2**-10, -3.0 - 5 * 2**-9 / 7, 1e-3 * (1 + 1 / 3), 12345.678])
def test_rounding_is_unbiased(value):
    """E[round(x)] = x: the mean of many roundings converges to x, far below a bf16 step."""
    n = 1 << 20
    x = torch.full((n,), value, dtype=torch.float32)
    rounded = round_to_bf16(x, _noise(n, mix_key(7, 0, 1))).double()
    low, high = torch.unique(rounded).tolist()[0], torch.unique(rounded).tolist()[-1]
    step = high - low
    assert step > 0  # the value lies strictly between two bf16 numbers
    p_up = (x.double()[0].item() - low) / step
    # The mean is within 5 standard errors of the exact value; round-to-nearest misses by far more.
    std_error = step * math.sqrt(p_up * (1 - p_up) / n)
    assert abs(rounded.mean().item() - x.double()[0].item()) < 5 * std_error
    nearest = x.to(torch.bfloat16).double()[0].item()
    assert abs(nearest - x.double()[0].item()) > 50 * std_error


def test_exact_values_and_specials_survive():
    special = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), 3.3e38])
    for key in range(20):
        out = round_to_bf16(special, _noise(len(special), key)).float()
        assert torch.equal(out[:6], special[:6]) and torch.signbit(out[1])
        assert torch.isnan(out[6]) and math.isfinite(out[7]) or out[7] == float("inf")


def test_reproducible_from_the_key_and_different_across_keys():
    x = torch.randn(10_000)
    a = round_to_bf16(x, _noise(10_000, mix_key(1, 0, 5)))
    b = round_to_bf16(x, _noise(10_000, mix_key(1, 0, 5)))
    c = round_to_bf16(x, _noise(10_000, mix_key(1, 0, 6)))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # Either way it lands on one of the two neighbours.
    down = round_to_bf16(x, torch.zeros(10_000, dtype=torch.int64)).float()
    assert torch.all((a.float() == down) | (a.float().abs() > down.abs()))


def test_nearest_when_no_noise():
    x = torch.randn(1000)
    assert torch.equal(round_to_bf16(x, None), x.to(torch.bfloat16))
