"""The device's peak matrix-product throughput, measured rather than looked up.

A table of vendor peaks goes stale and is wrong for shared or throttled machines (nanoGPT
#464 reports 104% MFU). We time large square matmuls in the training dtype once per
machine, torch version, thread count and dtype, and cache the median rate.

On a shared VM the same probe can read 30% lower or higher an hour later, so a benchmark
can also sample the probe between its own steps (`PeakProbe`) and report MFU against the
peak of that moment beside the cached one.

A peak that cannot be measured, or an MFU above 100% (the peak read low, or was taken in
another dtype than the products ran in), is reported as unknown (None), never as a wrong
figure: `mfu()` is where every MFU is computed.
"""

from __future__ import annotations

import math
import time

import torch

from frugality.hardware import product_rate, product_size


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None where the peak is unknown or the ratio impossible."""
    if not peak or not math.isfinite(peak) or peak <= 0:
        return None
    ratio = flops_per_s / peak
    return ratio if 0.0 <= ratio <= 1.0 else None


class PeakProbe:
    """`hardware.measure_product_rate`'s product, one call per `sample()`: a benchmark
    samples it between its own steps, for MFU against the peak of that moment."""

    def __init__(self, device: torch.device, dtype: torch.dtype, size: int | None = None) -> None:
        self.device = device
        self.n = size or product_size(device, dtype)
        self.a = torch.randn(self.n, self.n, device=device, dtype=dtype)
        self.b = torch.randn(self.n, self.n, device=device, dtype=dtype)
        torch.mm(self.a, self.b)  # warms up the kernel and the allocator

    def sample(self) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        torch.mm(self.a, self.b)
        _sync(self.device)
        return 2.0 * self.n**3 / (time.perf_counter() - t0)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's peak for MFU: the machine's cached product rate (`hardware.product_rate`)."""
    return product_rate(device, dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
