"""`frugality compile`: the ahead-of-time warm-up.

It runs the real training code path on throwaway state, so what it compiles is what the run
will ask for, under the same cache key: the warm-up trial (training forward + backward,
evaluation forward), two optimizer steps (the second proves nothing recompiles), one
evaluation and one checkpoint save, in a temporary run directory that is deleted after.
A real run's directory and checkpoints are never touched.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from frugality import xla
from frugality.config.recipe import Recipe
from frugality.distributed import World, world_from_env
from frugality.errors import UserError
from frugality.runtime.device import names_xla, resolve_device
from frugality.runtime.layout import plan_layout
from frugality.tasks import get_task
from frugality.training.trainer import train

TRIAL_STEPS = 2
XLA_TRIAL_STEPS = 3  # two of warm-up, one that must compile nothing


def compile_ahead(recipe: Recipe, progress: bool = True, ranks: int = 1) -> dict:
    """Compile and publish every graph `frugality train` needs for `recipe` run over `ranks`
    data-parallel ranks (their micro-batch: `Recipe.for_data_parallel`); returns the
    compile statistics (graphs, cache hits and misses, seconds, where the entry went).

    Each trial step is one micro-batch per rank: accumulating more would run the same
    graphs again (a Pythia recipe's step is 32 of them)."""
    if names_xla(recipe.train.device):  # not opened here: an SPMD run must choose SPMD first
        if ranks != 1:
            raise UserError("--ranks: an xla device trains in one process (parallel.spmd shares out its devices)")
        return _trial_on_xla(recipe, progress)
    if recipe.compile.backend != "inductor":
        raise UserError(
            f"compile.backend {recipe.compile.backend!r}: frugality compile fills the shared cache with "
            "Inductor's graphs; a run with another backend compiles in its first steps"
        )
    if recipe.compile.level == "O0":
        raise UserError(
            "compile.level is O0 (eager): nothing to compile; choose a level with --level O1 or --set compile.level=O1"
        )
    recipe, _ = recipe.for_data_parallel(ranks, get_task(recipe.train.task).min_micro_batch)
    here = world_from_env().world_size  # this command's own ranks, under torchrun
    trial = recipe.model_copy(
        update={
            # one micro-batch of validation: the run's shape (a split smaller than one: the whole of it, as the run's)
            "train": recipe.train.model_copy(
                update={
                    "eval_samples": recipe.data.micro_batch_size,
                    "keep_checkpoints": 1,
                    "activation_checkpointing": _run_checkpointing(recipe, ranks),
                }
            ),
            "data": recipe.data.model_copy(update={"global_batch_size": recipe.data.micro_batch_size * here}),
        }
    )
    if ranks != here:
        _check_the_trial_fits(trial, ranks, here)
    steps = min(TRIAL_STEPS, recipe.train.steps)
    with tempfile.TemporaryDirectory(prefix="frugality-compile-") as scratch:
        result = train(trial, run_dir=Path(scratch) / "run", until_step=steps, progress=progress, tensorboard=False)
    return result.summary["compile"]


def _check_the_trial_fits(trial: Recipe, ranks: int, here: int) -> None:
    """The trial trains the run's graphs (its mode of activation checkpointing and all) in
    `here` processes holding what the run's `ranks` share (FSDP2's state whole): refused in
    one line, before anything compiles, where they cannot hold it."""
    device = resolve_device(trial.train.device)
    try:
        plan_layout(trial, device, World(0, here))
    except UserError as e:
        if " needs about " not in str(e):
            raise
        needs = str(e).split(" needs about ", 1)[-1].split(" (activations", 1)[0]
        raise UserError(
            f"frugality compile --ranks {ranks}: its trial trains the run's graphs in {here} process"
            f"{'es' if here > 1 else ''}, which would need about {needs}, more than is free here; the run "
            "compiles them in its first steps, or compile on a machine with more memory (or under torchrun, "
            "as many processes as the run)"
        ) from None


def _run_checkpointing(recipe: Recipe, ranks: int) -> str:
    """The activation checkpointing mode the run over `ranks` would take on this machine
    (its graphs differ by mode): `auto` resolved with the run's plan per rank (sharded state
    and all), not the trial's one process's."""
    if recipe.train.activation_checkpointing != "auto":
        return recipe.train.activation_checkpointing
    return plan_layout(recipe, resolve_device(recipe.train.device), World(0, ranks)).checkpointing[0]


def _trial_on_xla(recipe: Recipe, progress: bool) -> dict:
    """XLA compiles a run's graphs in its first steps; where the PJRT client loads
    executables back (TPU, CUDA: `compile.xla_executables`), the trial's go into the shared
    cache for the run to fetch (frugality.compile.xla). The trial is the run's own first steps: every
    micro-batch of a step (the first makes the gradients, the next add to them: two graphs),
    an evaluation at each, a checkpoint's save, through the warm-up (two calls a phase) and
    one step more, which must compile nothing (`compile.on_recompile = "error"`): the proof
    that the run after the warm-up compiles nothing new. Two micro-batches a step make both
    graphs (the count is no constant of the graph: XLA_NO_SPECIAL_SCALARS; with SPMD, whose
    micro-batches hold every device's rows, the recipe's own batch). The statistics,
    with the client. compile.level does not apply on XLA; compile.cache holds the executables where
    compile.xla_executables stores them."""
    steps = min(XLA_TRIAL_STEPS, recipe.train.steps)
    accumulated = recipe.data.global_batch_size // recipe.data.micro_batch_size > 1
    micro_batches = recipe.data.micro_batch_size * (2 if accumulated else 1)
    if recipe.parallel.spmd:  # its micro-batches hold every device's rows: the recipe's own batch
        micro_batches = recipe.data.global_batch_size
    trial = recipe.model_copy(
        update={
            "train": recipe.train.model_copy(
                update={
                    "eval_interval": 1,  # the run's own validation set: one graph reads all its batches' losses
                    "save_interval": 2,
                    "keep_checkpoints": 1,
                }
            ),
            "compile": recipe.compile.model_copy(update={"on_recompile": "error"}),
            "data": recipe.data.model_copy(update={"global_batch_size": micro_batches}),
        }
    )
    with tempfile.TemporaryDirectory(prefix="frugality-compile-") as scratch:
        result = train(trial, run_dir=Path(scratch) / "run", until_step=steps, progress=progress, tensorboard=False)
    return result.summary["compile"] | {"xla_client": xla.client(), "trial_steps": steps}
