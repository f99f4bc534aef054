"""`frugality doctor`: health checks of this machine, its device and (with --nproc) the
collectives among its processes, before a run spends money on it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click


@click.command()
@click.argument("recipe", required=False)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Also test collectives among this many local processes (started through torchrun).",
)
@click.option(
    "--max-size",
    "max_mib",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Largest collective size in MiB (sizes from 1 KiB, x4 each).",
)
@click.option("--quick", is_flag=True, help="Skip the peak measurement.")
@click.option(
    "--threshold",
    "overrides_thresholds",
    multiple=True,
    metavar="NAME=VALUE",
    help="Override a threshold (names in the JSON and docs/reliability.md).",
)
@click.option("--run-dir", type=click.Path(), help="Where runs are written [default: train.runs_dir].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option("--json", "json_path", type=click.Path(), help="Also write the checks as JSON (a new file).")
@click.option("--collectives-worker", "worker_out", type=click.Path(), hidden=True)
def doctor(recipe, nproc, max_mib, quick, overrides_thresholds, run_dir, overrides, json_path, worker_out) -> None:
    """Check what a run of RECIPE needs here: the machine (device, memory, free disk and
    write speed where runs go, compile cache, dataset), the device's products and
    stochastic rounding against references, its measured peak, and with --nproc the
    collectives (values, latency, bus bandwidth). Exit status 1 when a check fails."""
    from frugality.backends import backend
    from frugality.config.recipe import load_recipe
    from frugality.errors import UserError
    from frugality.health import failed, markdown_table, threshold_kind, thresholds
    from frugality.runtime.device import resolve_device

    resolved = load_recipe(recipe, list(overrides))
    device = resolve_device(resolved.train.device, what="frugality doctor", xla_ok=True)
    if backend(device).one_process and nproc > 1:
        raise UserError("--nproc: doctor on an xla device checks that one device; drop --nproc")
    if nproc > 1:
        from frugality.runtime.device import check_local_processes

        check_local_processes(device, nproc)  # as `train --nproc` refuses it
    limits = thresholds(threshold_kind(device), list(overrides_thresholds))
    if worker_out:
        _collectives_worker(device, resolved.parallel.timeout_s, limits, max_mib, Path(worker_out))
        return
    if json_path and Path(json_path).exists():
        raise UserError(f"--json {json_path}: exists; choose another path or remove it")
    checks = _local_checks(device, resolved, Path(run_dir or resolved.train.runs_dir), limits, quick)
    if nproc > 1:
        args = [a for a in ([recipe] if recipe else [])] + [x for o in overrides for x in ("--set", o)]
        args += [x for t in overrides_thresholds for x in ("--threshold", t)]
        checks += _collectives(nproc, args, max_mib)
    click.echo(markdown_table(checks))
    bad = failed(checks)
    if json_path:
        from frugality.paths import write_atomically

        write_atomically(json_path, json.dumps([c.as_dict() for c in checks], indent=1) + "\n", overwrite=False)
    if bad:
        click.echo(f"doctor: {len(bad)} check(s) failed: " + "; ".join(f"{c.name} ({c.detail})" for c in bad), err=True)
        raise click.exceptions.Exit(1)
    click.echo(f"doctor: all {len(checks)} checks passed")


def _local_checks(device, recipe, run_root: Path, limits, quick: bool):
    from frugality.health.device import peak_checks, product_checks, stochastic_rounding_check
    from frugality.health.machine import machine_checks

    checks = machine_checks(device, recipe, run_root, limits)
    checks += product_checks(device, limits)
    checks.append(stochastic_rounding_check(device, limits))
    if not quick:
        checks += peak_checks(device)
    return checks


def _collectives(nproc: int, args: list[str], max_mib: int):
    """The collective rows, from `nproc` processes that torchrun starts; a launch that fails
    is a failed check naming the rank."""
    from frugality.distributed import launch_local
    from frugality.health import FAIL, Check

    with tempfile.TemporaryDirectory(prefix="frugality-doctor-") as scratch:
        out = Path(scratch) / "collectives.json"
        status = launch_local(nproc, ["doctor", *args, "--max-size", str(max_mib), "--collectives-worker", str(out)])
        if status != 0 or not out.is_file():
            return [
                Check(
                    "collectives",
                    f"collectives among {nproc} processes",
                    FAIL,
                    f"exit status {status}",
                    "the processes did not complete (the failed rank is named above)",
                )
            ]
        return [Check(**row) for row in json.loads(out.read_text())]


def _collectives_worker(device, timeout_s: int, limits, max_mib: int, out: Path) -> None:
    """One rank of `_collectives`: every rank runs the collectives, rank 0 writes the rows."""
    from frugality import distributed
    from frugality.health.collectives import collective_checks

    world = distributed.init(device, timeout_s)
    device = distributed.local_device(device, world)
    try:
        checks = collective_checks(device, limits, max_mib << 20)
        if world.is_main:
            out.write_text(json.dumps([c.as_dict() for c in checks]))
    finally:
        distributed.shutdown()
