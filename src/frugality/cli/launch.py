"""`frugality launch ...`: scripts that start runs on a cluster's scheduler."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import click


@click.group()
def launch() -> None:
    """Write (and submit) a scheduler job for a training run."""


@launch.command("slurm")
@click.argument("recipe", required=False)
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="GPUs per node, one rank each; 0 for CPU nodes.",
)
@click.option("--procs-per-node", type=click.IntRange(min=1), help="Ranks per node on CPU nodes [default: 1].")
@click.option("--partition", help="SLURM partition.")
@click.option("--time", "time_limit", help="SLURM time limit, e.g. 24:00:00.")
@click.option("--cpus-per-task", type=click.IntRange(min=1), help="CPUs per node's task.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option("--run-dir", help="Run directory [default: <train.runs_dir>/<name>].")
@click.option("--out", type=click.Path(), help="Where to write the script [default: <run-dir>.sbatch].")
@click.option("--submit", is_flag=True, help="Submit it with sbatch.")
def slurm(
    recipe, nodes, gpus_per_node, procs_per_node, partition, time_limit, cpus_per_task, overrides, run_dir, out, submit
) -> None:
    """Write an sbatch script that trains RECIPE on SLURM: the compile step, then torchrun
    on every node with c10d rendezvous; requeued on preemption, resuming its checkpoint."""
    import torch

    from frugality.config.recipe import load_recipe
    from frugality.distributed import World
    from frugality.distributed.slurm import SlurmJob, render
    from frugality.errors import UserError
    from frugality.paths import write_atomically
    from frugality.runtime.layout import check_layout

    resolved = load_recipe(recipe, list(overrides))  # checked here, before anything is written
    if gpus_per_node and procs_per_node and procs_per_node != gpus_per_node:
        raise UserError(
            f"--procs-per-node {procs_per_node}: on GPU nodes there is one rank per GPU "
            f"(--gpus-per-node {gpus_per_node})"
        )
    ranks = nodes * (gpus_per_node or procs_per_node or 1)
    # the ranks' layout, before the job waits in a queue: what they would refuse on arrival
    check_layout(resolved, torch.device("cuda" if gpus_per_node else "cpu"), World(0, ranks))
    run_dir = run_dir or str(Path(resolved.train.runs_dir) / resolved.name)
    job = SlurmJob(
        recipe or "tiny",
        tuple(overrides),
        resolved.name,
        run_dir,
        nodes,
        gpus_per_node,
        gpus_per_node or procs_per_node or 1,
        resolved.compile.level != "O0",
        partition,
        time_limit,
        cpus_per_task,
    )
    path = Path(out or f"{run_dir.rstrip('/')}.sbatch")
    if path.exists():
        raise UserError(f"--out {path}: exists; choose another path or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(run_dir).parent.mkdir(parents=True, exist_ok=True)  # SLURM writes its log beside the run
    write_atomically(path, render(job), overwrite=False)  # (a full disk leaves no empty script)
    click.echo(f"wrote {path} ({nodes} node(s) x {job.procs_per_node} rank(s))")
    if submit:
        if shutil.which("sbatch") is None:
            raise UserError("--submit: sbatch is not on this machine's PATH (the script is written)")
        done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(f"sbatch {path}: {done.stderr.strip() or 'failed'}")
        click.echo(done.stdout.strip())
