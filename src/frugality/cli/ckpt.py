"""`frugality ckpt ...`: a run's checkpoints."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def ckpt() -> None:
    """Inspect a run's checkpoints."""


@ckpt.command("verify")
@click.argument("path", type=click.Path())
def verify_command(path) -> None:
    """Check every checkpoint of PATH (a run directory, its checkpoints folder, or one
    checkpoint) against its manifest: each file's size and SHA-256. Exit status 1 when one
    is unusable, or cannot be verified (no manifest: only its files' sizes are checked)."""
    from frugality.checkpoint import MANIFEST, CheckpointManager, step_of, verify
    from frugality.errors import UserError

    root = Path(path)
    if (root / ".metadata").is_file() or (root / MANIFEST).is_file():
        found = [root]
    else:
        folder = root / "checkpoints" if (root / "checkpoints").is_dir() else root
        if not folder.is_dir():
            raise UserError(f"{path}: not a run directory, checkpoints folder or checkpoint")
        found = sorted(
            (p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step_")),
            key=lambda p: (len(p.name), p.name),
        )
        if not found:
            raise UserError(f"{path}: holds no checkpoints (step_* folders)")
    bad = unverified = 0
    for checkpoint in found:
        problem = verify(checkpoint)
        if problem is not None:
            bad += 1
            click.echo(f"unusable   {checkpoint}  {problem}")
        elif not (checkpoint / MANIFEST).is_file():
            unverified += 1
            click.echo(
                f"unverified {checkpoint}  no {MANIFEST} (written before manifests, or deleted): its files' sizes "
                "match .metadata, their bytes cannot be checked"
            )
        else:
            click.echo(f"ok         {checkpoint}  verified")
    if unverified:
        click.echo(f"{unverified} of {len(found)} checkpoint(s) could not be verified (no {MANIFEST})", err=True)
        if not bad:
            raise click.exceptions.Exit(1)
    if bad:
        usable = CheckpointManager(found[0].parent).complete() if len(found) > 1 else []
        newest = next((p for p in reversed(usable) if verify(p) is None), None)
        click.echo(
            f"{bad} of {len(found)} checkpoint(s) unusable"
            + (f"; a resume would start from step {step_of(newest)}" if newest else ""),
            err=True,
        )
        raise click.exceptions.Exit(1)
