"""`train.preflight`: the quick subset of `frugality doctor` on every rank before step 1 —
the device's products and stochastic rounding, free disk where the run goes and, across
ranks, that every collective gives the right values (up to 1 MiB; speed is the doctor's
business). A failure on any rank stops every rank before anything is written."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from frugality.errors import UserError
from frugality.health import FAIL, threshold_kind, thresholds
from frugality.health.device import product_checks, stochastic_rounding_check
from frugality.health.machine import free_disk_check


def preflight(device: torch.device, run_root: Path) -> int:
    """Run the checks; raise UserError naming what failed (here or on another rank).
    Returns how many checks passed on this rank."""
    limits = thresholds(threshold_kind(device))
    checks = product_checks(device, limits) + [
        stochastic_rounding_check(device, limits),
        free_disk_check(run_root, limits),
    ]
    if dist.is_initialized():
        from frugality.health.collectives import collective_checks

        checks += [c for c in collective_checks(device, limits, largest=1 << 20) if "op" in c.data]
    failures = [c for c in checks if c.status == FAIL]
    if dist.is_initialized():  # every rank learns whether any failed
        count = torch.tensor([len(failures)], device=device)
        dist.all_reduce(count)
        if count.item() and not failures:
            raise UserError(f"preflight failed on another rank (rank {dist.get_rank()} passed); see its error")
    if failures:
        where = f" on rank {dist.get_rank()}" if dist.is_initialized() else ""
        raise UserError(
            f"preflight failed{where}: "
            + "; ".join(f"{c.name}: {c.value} ({c.detail})" for c in failures)
            + " (train.preflight; `frugality doctor` for the full checks)"
        )
    return len(checks)
