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

from frugality.config.recipe import Recipe
from frugality.distributed import world_from_env
from frugality.errors import UserError
from frugality.runtime.device import resolve_device
from frugality.tasks import get_task
from frugality.training.trainer import train

TRIAL_STEPS = 2


def compile_ahead(recipe: Recipe, progress: bool = True, ranks: int = 1) -> dict:
    """Compile and publish every graph `frugality train` needs for `recipe` run over `ranks`
    data-parallel ranks (their micro-batch: `Recipe.for_data_parallel`); returns the
    compile statistics (graphs, cache hits and misses, seconds, where the entry went).

    Each trial step is one micro-batch per rank: accumulating more would run the same
    graphs again (a Pythia recipe's step is 32 of them)."""
    if resolve_device(recipe.train.device, xla_ok=True).type == "xla":
        raise UserError(
            "frugality compile does not run on an xla device yet: XLA compiles a run's graphs in its "
            "first steps (docs/xla.md)"
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
                update={"eval_samples": recipe.data.micro_batch_size, "keep_checkpoints": 1}
            ),
            "data": recipe.data.model_copy(update={"global_batch_size": recipe.data.micro_batch_size * here}),
        }
    )
    steps = min(TRIAL_STEPS, recipe.train.steps)
    with tempfile.TemporaryDirectory(prefix="frugality-compile-") as scratch:
        result = train(trial, run_dir=Path(scratch) / "run", until_step=steps, progress=progress, tensorboard=False)
    return result.summary["compile"]
