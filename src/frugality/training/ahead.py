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
from frugality.errors import UserError
from frugality.training.trainer import train

TRIAL_STEPS = 2


def compile_ahead(recipe: Recipe, progress: bool = True) -> dict:
    """Compile and publish every graph `frugality train` needs for `recipe`; returns the
    compile statistics (graphs, cache hits and misses, seconds, where the entry went)."""
    if recipe.compile.level == "O0":
        raise UserError("compile.level is O0 (eager): nothing to compile; "
                        "choose a level with --level O1 or --set compile.level=O1")
    trial = recipe.model_copy(update={
        "train": recipe.train.model_copy(update={"eval_batches": 1, "keep_checkpoints": 1}),
    })
    steps = min(TRIAL_STEPS, recipe.train.steps)
    with tempfile.TemporaryDirectory(prefix="frugality-compile-") as scratch:
        result = train(trial, run_dir=Path(scratch) / "run", until_step=steps, progress=progress,
                       tensorboard=False)
    return result.summary["compile"]
