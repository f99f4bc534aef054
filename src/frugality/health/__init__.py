"""Health checks before training (`frugality doctor`, `train.preflight`): what the machine
is, whether its device computes correctly, and whether its processes can talk to each other
fast enough. Each check gives a `Check` row; thresholds (per device kind, overridable by
name) decide pass or fail; informational rows never fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from frugality.backends import backend
from frugality.errors import UserError

PASS, FAIL, INFO = "pass", "fail", "info"

# Per device kind. Floors that catch a broken or misconfigured machine (a link fallen back
# to sockets, a full disk), not targets: a healthy machine clears them by far.
THRESHOLDS = {
    "cpu": {
        "fp32_product_rel_error": 1e-5,
        "bf16_product_rel_error": 1e-2,
        "sr_mean_bias_steps": 0.01,
        "min_free_disk_gib": 1.0,
        "min_disk_write_mb_s": 20.0,
        "min_bus_bandwidth_gb_s": 0.05,
        "max_small_latency_ms": 50.0,
    },
    "cuda": {
        "fp32_product_rel_error": 1e-2,  # TF32 products where enabled
        "bf16_product_rel_error": 1e-2,
        "sr_mean_bias_steps": 0.01,
        "min_free_disk_gib": 10.0,
        "min_disk_write_mb_s": 100.0,
        "min_bus_bandwidth_gb_s": 5.0,
        "max_small_latency_ms": 5.0,
    },
}
# TPU and Trainium: an accelerator's floors, as CUDA's (their fp32 products run as bf16
# passes by default, as TF32 does on GPUs)
THRESHOLDS["xla"] = dict(THRESHOLDS["cuda"])


@dataclass
class Check:
    group: str  # machine, device, collectives
    name: str  # unique, e.g. "all_reduce 1 MiB"
    status: str  # pass, fail or info
    value: str  # what was measured, as shown
    detail: str = ""  # the threshold, or why it failed
    data: dict = field(default_factory=dict)  # the numbers, for JSON

    def as_dict(self) -> dict:
        return asdict(self)


def threshold_kind(device) -> str:
    """Which thresholds a device is held to: its type, and for an XLA device its client's
    kind (XLA's CPU client: the CPU's)."""
    if not backend(device).traced:
        return device.type
    from frugality import xla

    return "cpu" if xla.client() == "CPU" else "xla"


def thresholds(device_type: str, overrides: Sequence[str] = ()) -> dict[str, float]:
    """The device kind's thresholds (`threshold_kind`) with `NAME=VALUE` overrides applied."""
    values = dict(THRESHOLDS[device_type if device_type in ("cuda", "xla") else "cpu"])
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in values:
            raise UserError(f"--threshold {item}: NAME=VALUE with NAME one of {', '.join(sorted(values))}")
        try:
            values[name] = float(value)
        except ValueError:
            raise UserError(f"--threshold {item}: {value!r} is not a number") from None
    return values


def at_most(group: str, name: str, value: float, limit: float, shown: str, key: str) -> Check:
    ok = value <= limit
    return Check(
        group,
        name,
        PASS if ok else FAIL,
        shown,
        f"{'<=' if ok else 'above'} {limit:g} ({key})",
        {"value": value, "limit": limit},
    )


def at_least(group: str, name: str, value: float, limit: float, shown: str, key: str) -> Check:
    ok = value >= limit
    return Check(
        group,
        name,
        PASS if ok else FAIL,
        shown,
        f"{'>=' if ok else 'below'} {limit:g} ({key})",
        {"value": value, "limit": limit},
    )


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == FAIL]


def markdown_table(checks: list[Check]) -> str:
    lines = ["| group | check | result | value | threshold / detail |", "|---|---|---|---|---|"]
    lines += [f"| {c.group} | {c.name} | {c.status} | {c.value} | {c.detail} |" for c in checks]
    return "\n".join(lines)
