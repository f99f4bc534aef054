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

import torch

from frugality.hardware import ProductProbe, product_rate


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None where the peak is unknown or the ratio impossible."""
    if not peak or not math.isfinite(peak) or peak <= 0:
        return None
    ratio = flops_per_s / peak
    return ratio if 0.0 <= ratio <= 1.0 else None


PeakProbe = ProductProbe  # a benchmark samples the product speed between its own steps


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's peak for MFU: the machine's cached product rate (`hardware.product_rate`)."""
    return product_rate(device, dtype)
