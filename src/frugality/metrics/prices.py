"""The price catalogue: cloud instances with their accelerators, on-demand price per hour,
region and board power, each row with its public source and date (`prices.csv`, shipped
with frugality). A user's CSV of the same columns merges over it, row by instance name.

`accelerator_bf16_tflops` is one accelerator's dense bf16 peak as its vendor states it, for
MFU against an instance (`frugality cost train --recipe`): Trainium 190 and Inferentia2 190
(two NeuronCore-v2 each), Trainium2 667 (eight NeuronCore-v3), from the AWS Neuron
architecture pages (awsdocs-neuron.readthedocs-hosted.com, general/arch/neuron-hardware:
trainium, inferentia2, trainium2; read 2026-11-24).

A run is priced by `cost.price_per_hour` (declared), `cost.instance` (a catalogue row), or
else an estimate: this machine's share of the catalogue instance that holds the same
accelerator, or, on a CPU, the same vendor's cheapest CPU instance, per vCPU.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from frugality.errors import UserError

COLUMNS = (
    "provider",
    "instance",
    "accelerator",
    "accelerator_count",
    "accelerator_memory_gib",
    "vcpus",
    "memory_gib",
    "usd_per_hour",
    "region",
    "accelerator_tdp_w",
    "accelerator_bf16_tflops",
    "source",
    "date",
)
_NUMBERS = {
    "accelerator_count": int,
    "vcpus": int,
    "accelerator_memory_gib": float,
    "memory_gib": float,
    "usd_per_hour": float,
    "accelerator_tdp_w": float,
    "accelerator_bf16_tflops": float,
}
_REQUIRED = ("provider", "instance", "usd_per_hour", "source")

# Power usage effectiveness by provider, as Cloud Carbon Footprint uses them
# (https://www.cloudcarbonfootprint.org/docs/methodology); machines of no provider: 1.0.
PROVIDER_PUE = {"aws": 1.135, "gcp": 1.1, "azure": 1.185}


@dataclass(frozen=True)
class Instance:
    provider: str
    instance: str
    accelerator: str
    accelerator_count: int
    accelerator_memory_gib: float | None
    vcpus: int | None
    memory_gib: float | None
    usd_per_hour: float
    region: str
    accelerator_tdp_w: float | None
    accelerator_bf16_tflops: float | None  # dense, per accelerator, as the vendor states it
    source: str
    date: str


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    label: str  # "declared ...", "catalogue ...", "estimated ..."
    provider: str | None = None
    accelerator_w: float | None = None  # the board power of what the run uses, where known


def load_catalogue(user_file: str | Path | None = None) -> dict[str, Instance]:
    """The bundled catalogue, with `user_file`'s rows merged over it (by instance name)."""
    text = resources.files("frugality.metrics").joinpath("prices.csv").read_text()
    rows = _parse(text, "the bundled price catalogue")
    if user_file is not None:
        path = Path(user_file)
        try:
            rows |= _parse(path.read_text(), str(path))
        except OSError as e:
            raise UserError(f"cost.catalogue {path}: {e.strerror or e}") from None
    return rows


def _parse(text: str, where: str) -> dict[str, Instance]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in _REQUIRED if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{where}: no column {', '.join(missing)} (columns: {', '.join(COLUMNS)})")
    rows = {}
    for line, row in enumerate(reader, start=2):
        values = {}
        for column in COLUMNS:
            raw = (row.get(column) or "").strip()
            if column in _NUMBERS:
                if not raw:
                    values[column] = 0 if column == "accelerator_count" else None
                    continue
                try:
                    values[column] = _NUMBERS[column](raw)
                except ValueError:
                    raise UserError(f"{where} line {line}: {column} {raw!r} is not a number") from None
                if values[column] < 0:
                    raise UserError(f"{where} line {line}: {column} {raw} is negative")
            else:
                values[column] = raw
        for column in _REQUIRED:
            if values[column] in ("", None):
                raise UserError(f"{where} line {line}: {column} is empty")
        rows[values["instance"]] = Instance(**values)
    return rows


def check_cost(instance: str | None, user_file: str | None) -> dict[str, Instance]:
    """The catalogue, with `instance` checked against it: before a run writes anything."""
    catalogue = load_catalogue(user_file)
    if instance and instance not in catalogue:
        raise UserError(
            f"cost.instance {instance!r} is not in the price catalogue; `frugality cost "
            f"instances` lists them, or set cost.price_per_hour"
        )
    return catalogue


def resolve_price(
    catalogue: dict[str, Instance],
    price_per_hour: float | None,
    instance: str | None,
    device_type: str,
    device_name: str,
    vcpus: int,
    devices: int = 1,
    hosts: int = 1,
) -> Price | None:
    """What this run costs per hour, and how that is known; None where nothing in the
    catalogue resembles its machines. A declared or catalogue price is per machine, times
    `hosts`; `devices` is the number of accelerators the run uses (or of hosts on CPUs),
    `vcpus` all hosts' together."""
    row = catalogue.get(instance) if instance else None
    if instance and row is None:
        check_cost(instance, None)  # raises, naming the instance
    machines = f" x {hosts} machines" if hosts > 1 else ""
    if price_per_hour is not None:
        provider = row.provider if row else None
        return Price(
            price_per_hour * hosts,
            f"declared in cost.price_per_hour (${price_per_hour:g}/h{machines})",
            provider,
            _board_power(row, devices) if row else None,
        )
    if row is not None:
        return Price(
            row.usd_per_hour * hosts,
            f"catalogue: {row.instance} on demand in {row.region}, "
            f"${row.usd_per_hour:g}/h{machines} ({row.source}, {row.date})",
            row.provider,
            _board_power(row, devices),
        )
    return _estimate(catalogue, device_type, device_name, vcpus, devices)


def _board_power(row: Instance, devices: int) -> float | None:
    return row.accelerator_tdp_w * devices if row.accelerator_tdp_w and row.accelerator_count else None


def _estimate(catalogue, device_type, device_name, vcpus, devices) -> Price | None:
    if device_type == "cuda":
        name = device_name.upper()
        matches = [
            r
            for r in catalogue.values()
            if r.accelerator_count and re.search(rf"\b{re.escape(_accelerator_family(r.accelerator))}\b", name)
        ]
        if not matches:
            return None
        row = min(matches, key=lambda r: r.usd_per_hour / r.accelerator_count)
        hourly = row.usd_per_hour / row.accelerator_count * devices
        return Price(
            hourly,
            f"estimated: {devices} of {row.instance}'s {row.accelerator_count} "
            f"{row.accelerator} at ${row.usd_per_hour:g}/h on demand in {row.region} ({row.date})",
            row.provider,
            _board_power(row, devices),
        )
    vendor = "c7a" if "AMD" in device_name.upper() else "c7i"
    matches = [r for r in catalogue.values() if not r.accelerator_count and r.vcpus and r.instance.startswith(vendor)]
    if not matches:
        return None
    row = min(matches, key=lambda r: r.usd_per_hour / r.vcpus)
    hourly = row.usd_per_hour / row.vcpus * vcpus
    return Price(
        hourly,
        f"estimated: {vcpus} vCPUs at the rate of {row.instance} (${row.usd_per_hour:g}/h for "
        f"{row.vcpus}) on demand in {row.region} ({row.date})",
        row.provider,
    )


def _accelerator_family(accelerator: str) -> str:
    """'A100-SXM4-40GB' -> 'A100': the part torch's device names contain."""
    return accelerator.split("-")[0].upper()
