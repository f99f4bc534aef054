"""An sbatch script for a training run on a SLURM cluster: one task per node, each starting
torchrun, whose c10d rendezvous at the first node joins the nodes. A first job step
compiles the recipe's graphs into the shared compile cache (where compile.level is above
O0), so the training step's ranks fetch them instead of each compiling. The job is
requeued on preemption or node failure; SLURM's SIGTERM reaches the ranks through torchrun,
each saves its part of a checkpoint at the end of its step, and the requeued job's
identical command resumes from it."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

RDZV_PORT = 29500
PYTHON = shlex.quote(sys.executable)  # this environment's interpreter (a shared filesystem's venv)


@dataclass(frozen=True)
class SlurmJob:
    recipe: str  # a shipped recipe's name or a TOML file, as `frugality train` takes it
    overrides: tuple[str, ...]  # --set KEY=VALUE
    name: str  # the recipe's name: job name and default run directory
    run_dir: str
    nodes: int
    gpus_per_node: int  # 0: CPU nodes
    procs_per_node: int  # ranks per node (= GPUs per node on GPU nodes)
    compile_first: bool
    partition: str | None = None
    time: str | None = None  # SLURM's time limit, e.g. 24:00:00
    cpus_per_task: int | None = None


def render(job: SlurmJob) -> str:
    """The sbatch script, as text."""
    sets = [a for o in job.overrides for a in ("--set", o)]
    recipe_args = " ".join(shlex.quote(a) for a in [job.recipe, *sets])
    directives = [
        f"--job-name=frugality-{job.name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",  # one torchrun per node, which starts the node's ranks
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []),
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--time={job.time}"] if job.time else []),
        "--requeue",  # preempted or a node lost: run again, resuming from the last checkpoint
        f"--output={job.run_dir}.slurm-%j.out",  # beside the run: SLURM opens it before the script runs
    ]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "# Written by `frugality launch slurm`; submit with sbatch.",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "",
    ]
    if job.compile_first:
        lines += [
            "# 1. compile the graphs once, into the shared cache (compile.cache or $FRUGALITY_COMPILE_CACHE)",
            f"srun --nodes=1 --ntasks=1 {PYTHON} -m frugality compile {recipe_args} "
            f"--ranks {job.nodes * job.procs_per_node} --no-progress",
            "",
        ]
    lines += [
        f"# {'2' if job.compile_first else '1'}. train: torchrun on every node, rendezvous at the first",
        "srun --kill-on-bad-exit=1 " + torchrun_command(job, "$SLURM_NNODES", "$head_node", "$SLURM_JOB_ID"),
        "",
    ]
    return "\n".join(lines)


def torchrun_command(job: SlurmJob, nnodes: str, head: str, job_id: str, port: int = RDZV_PORT) -> str:
    """The training step's command on one node (shell-quoted, variables left to the shell)."""
    sets = [a for o in job.overrides for a in ("--set", o)]
    train = ["-m", "frugality", "train", job.recipe, *sets, "--run-dir", job.run_dir, "--no-progress"]
    return (
        f"{PYTHON} -m torch.distributed.run --nnodes={nnodes} --nproc_per_node={job.procs_per_node} "
        f"--rdzv-backend=c10d --rdzv-endpoint={head}:{port} --rdzv-id={job_id} "
        + " ".join(shlex.quote(a) for a in train)
    )
