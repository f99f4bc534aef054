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

import json
import math
import statistics
import time
from pathlib import Path

import torch

from frugality.hardware import fingerprint


def _cache_key(device: torch.device, dtype: torch.dtype) -> str:
    return f"{fingerprint(device)}|{dtype}"  # the ISA limits in force change the peak


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None where the peak is unknown or the ratio impossible."""
    if not peak or not math.isfinite(peak) or peak <= 0:
        return None
    ratio = flops_per_s / peak
    return ratio if 0.0 <= ratio <= 1.0 else None


class PeakProbe:
    """Times `size`-square matmuls (2·n³ FLOPs each) in `dtype`, one call per `sample()`.
    Without a `size`: 8192 on GPUs, 2048 on CPUs, or smaller where the dtype is slow here
    (emulated bf16 ran at 0.3 GFLOP/s: 57 s a call at 2048), so that a call stays short."""

    def __init__(self, device: torch.device, dtype: torch.dtype, size: int | None = None) -> None:
        self.device = device
        self.n = size or (8192 if device.type == "cuda" else _cpu_size(dtype))
        self.a = torch.randn(self.n, self.n, device=device, dtype=dtype)
        self.b = torch.randn(self.n, self.n, device=device, dtype=dtype)
        torch.mm(self.a, self.b)  # warms up the kernel and the allocator

    def sample(self) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        torch.mm(self.a, self.b)
        _sync(self.device)
        return 2.0 * self.n**3 / (time.perf_counter() - t0)


def _cpu_size(dtype: torch.dtype, largest: int = 2048, seconds: float = 0.25) -> int:
    """The largest power-of-two size up to `largest` whose product takes about `seconds` at
    the rate a 256-square product shows."""
    n = 256
    a = torch.randn(n, n).to(dtype)
    torch.mm(a, a)
    t0 = time.perf_counter()
    torch.mm(a, a)
    rate = 2.0 * n**3 / max(time.perf_counter() - t0, 1e-9)
    while n < largest and 2.0 * (2 * n) ** 3 / rate <= seconds:
        n *= 2
    return n


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int | None = None) -> float:
    """FLOP/s of square matmuls: the median of five timed calls after a warm-up call. Not
    the best call: one mistimed call on a shared machine once read 2.3x the sustained rate
    here and would have halved every MFU computed against it."""
    probe = PeakProbe(device, dtype, size)
    return statistics.median(probe.sample() for _ in range(5))


def peak_flops(device: torch.device, dtype: torch.dtype, cache_file: Path) -> float:
    """The cached probe's rate for `device` and `dtype`, measured on first use."""
    key = _cache_key(device, dtype)
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = measure_peak_flops(device, dtype)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(cache_file)
    return float(cached[key])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
