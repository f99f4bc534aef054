"""Stochastic rounding from float32 to bfloat16, driven by a counter-based hash.

Round-to-nearest drops any update smaller than half a bf16 step (2^-9 relative), so
weights stored in bf16 stop learning once updates are small. Stochastic rounding rounds up
with probability equal to the discarded fraction, so E[round(x)] = x and small updates
survive on average (Gupta et al., 2015; Zamirai et al., 2020, "Revisiting BFloat16
Training").

The trick: bf16 is the top 16 bits of a float32. Adding a uniform 16-bit integer to the
float32's bit pattern and clearing the low 16 bits rounds the magnitude up exactly when
the noise carries into bit 16, i.e. with probability (low 16 bits) / 2^16. Sign-magnitude
encoding makes this symmetric for negatives; infinities stay infinite.

The noise comes from a hash of (key, element index), not from a generator's stream: it
is a few integer ops that fuse into the optimizer's kernel, it costs no memory traffic,
and it gives the same bits eager or compiled, on any device and thread count. All
arithmetic stays within int64 without overflow (32-bit values times constants < 2^31).
"""

from __future__ import annotations

import torch

from frugality import xla
from frugality.backends import backend

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply rounds, after Wellons' "lowbias32",
    with multipliers below 2^31 so int64 products never overflow) on values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """`_mix32` on a Python int (the same bits)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def mix_key(*parts: int) -> int:
    """Fold non-negative integers (seed, group, step) into one 32-bit key."""
    key = 0x9E3779B9
    for p in parts:
        key = _mix32_int(key ^ (p & _MASK32))
        key = _mix32_int(key ^ ((p >> 32) & _MASK32))
    return key


def noise16x3(index: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Three 16-bit uniform noises per element (for a weight and its two moments), from
    int64 element indices and a 0-dim int64 key. One hash gives 32 bits, split in two
    halves; one more multiply-xorshift gives the third noise."""
    x = _mix32((index & _MASK32) ^ key ^ ((index >> 32) * 0x68E31DA4 & _MASK32))
    y = (x * 0x5BD1E995) & _MASK32
    return x & 0xFFFF, x >> 16, (y ^ (y >> 13)) >> 16


def round_to_bf16(x: torch.Tensor, noise16: torch.Tensor | None) -> torch.Tensor:
    """float32 -> bfloat16; stochastic when `noise16` (int64 in [0, 2^16)) is given, else
    round-to-nearest-even."""
    if noise16 is None:
        return x.to(torch.bfloat16)
    # Sign-extended int64 arithmetic on the float's bit pattern: adding to the low bits
    # and masking with ...FFFF0000 keeps every finite value inside the int32 range.
    # Infinities stay infinite; a quiet NaN (0x7FC00000, what arithmetic produces) stays
    # NaN. No isnan() guard: on CPU it costs more than the rest of the rounding.
    if backend(x.device).traced:  # a view as another dtype would run the step's graph so far
        bits = (xla.bitcast(x, torch.int32).to(torch.int64) + noise16) & -0x10000
        return xla.bitcast(bits.to(torch.int32), torch.float32).to(torch.bfloat16)
    bits = (x.view(torch.int32).to(torch.int64) + noise16) & -0x10000
    return bits.to(torch.int32).view(torch.float32).to(torch.bfloat16)  # exact
